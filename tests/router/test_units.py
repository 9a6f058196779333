"""Quotas, config validation, the weightless model spec and the cache-aware cost model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.server import event_loop
from services.router.config import RouterConfig
from services.router.model import load_model_spec
from services.router.quotas import QuotaBook, QuotaExceeded, TenantQuota, load_quotas


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_charges_refunds_and_refills() -> None:
    clock = Clock()
    book = QuotaBook({"t": TenantQuota(tokens_per_minute=600, burst_tokens=100)}, clock)
    book.acquire("t", 80)
    with pytest.raises(QuotaExceeded) as err:
        book.acquire("t", 30)
    assert err.value.retry_after == pytest.approx(1.0)  # 10 tokens missing at 10 tokens/s
    book.release("t", unused_tokens=30)  # generated 30 fewer than charged
    book.acquire("t", 30)
    clock.now = 10.0  # 100 tokens regained, capped at the burst
    book.acquire("t", 100)
    with pytest.raises(QuotaExceeded, match="above the quota's burst") as err:
        book.acquire("t", 101)
    assert err.value.retry_after is None
    book.acquire("unlisted", 10**9)  # no default: unlimited


def test_concurrency_cap_and_default_quota() -> None:
    book = QuotaBook({"": TenantQuota(max_concurrent=2)})
    book.acquire("x", 1)
    book.acquire("x", 1)
    with pytest.raises(QuotaExceeded, match="max_concurrent=2"):
        book.acquire("x", 1)
    book.acquire("y", 1)  # each tenant has its own slots
    book.release("x", 0)
    book.acquire("x", 1)


@pytest.mark.parametrize(("content", "needle"), [
    ("{", "not valid JSON"),
    ('{"limits": {}}', "must be an object with keys"),
    ('{"tenants": {"a": {"tokens_per_minute": -1}}}', "tenants.a.tokens_per_minute"),
    ('{"default": {"max_concurrent": 0}}', "default.max_concurrent"),
    ('{"tenants": {"a": {"rpm": 3}}}', "tenants.a: unknown field"),
    ('{"tenants": {"a": 5}}', "tenants.a must be an object"),
])
def test_bad_quotas_file_names_the_entry(tmp_path: Path, content: str, needle: str) -> None:
    path = tmp_path / "q.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="--quotas-file") as err:
        load_quotas(str(path))
    assert needle in str(err.value)
    with pytest.raises(ValueError, match=needle.split(".")[0]):
        RouterConfig(prefill=("h:1",), quotas_file=str(path))


def test_quotas_file_roundtrip(tmp_path: Path) -> None:
    path = tmp_path / "q.json"
    path.write_text(json.dumps({"default": {"tokens_per_minute": 60},
                                "tenants": {"a": {"max_concurrent": 3}}}))
    assert load_quotas(str(path)) == {"": TenantQuota(tokens_per_minute=60),
                                      "a": TenantQuota(max_concurrent=3)}


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"policy": "random"}, "--policy"),
    ({"prefill": ("nohostport",)}, "--prefill"),
    ({"decode": ("h:0",)}, "--decode"),
    ({"max_tokens": 0}, "--max-tokens"),
    ({"max_retries": -1}, "--max-retries"),
    ({"poll_interval": 0.0}, "--poll-interval"),
    ({"index_timeout": 0.0}, "--index-timeout"),
    ({"prefill": (), "decode": ()}, "no instances"),
    ({"quotas_file": "/nonexistent/q.json"}, "--quotas-file: cannot read"),
    ({"model": ""}, "--model"),
    ({"loop": "trio"}, r"--loop: invalid value .trio. \(accepted: auto, asyncio, uvloop\)"),
])
def test_config_errors_name_the_flag(kwargs: dict, needle: str) -> None:
    base = {"prefill": ("127.0.0.1:1",), "decode": ("127.0.0.1:2",)}
    with pytest.raises(ValueError, match=needle):
        RouterConfig(**{**base, **kwargs})


def test_flags_and_env_build_the_config() -> None:
    cfg = RouterConfig.from_argv(["--prefill", "a:1,b:2", "--decode", "c:3",
                                  "--policy", "round_robin", "--index-timeout", "0.01"])
    assert (cfg.prefill, cfg.decode, cfg.policy, cfg.index_timeout) == (
        ("a:1", "b:2"), ("c:3",), "round_robin", 0.01)


def test_the_loop_flag_picks_the_event_loop() -> None:
    uvloop = pytest.importorskip("uvloop")  # pdserve[fast]
    assert event_loop("asyncio") is None
    assert event_loop("uvloop") is event_loop("auto") is uvloop.new_event_loop
    assert RouterConfig.from_argv(["--decode", "c:3", "--loop", "asyncio"]).loop == "asyncio"


def test_model_spec_matches_the_engines_fingerprint(tmp_path: Path) -> None:
    from pdserve.models import load_model, save_builtin

    directory = str(save_builtin("tiny", tmp_path / "tiny"))
    for name in ("tiny", "tiny@3", directory):
        spec, loaded = load_model_spec(name), load_model(name)
        assert spec.fingerprint == loaded.config.fingerprint
        assert spec.max_context == loaded.config.max_position_embeddings
    with pytest.raises(ValueError, match="--model"):
        load_model_spec("no-such-model")
