"""Issue 13's findings, replayed as an attacker on the same host would (any local process, no
credentials; or, where noted, a process holding only the data-plane credential) against a
live ``pdserve up`` stack with API keys for two tenants. Each must now fail closed.
docs/security.md lists them: threat, before, after, test."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import redis

from pdserve import LLM, SamplingParams, auth
from pdserve.hashing import block_checksum, hash_blocks
from pdserve.kvd.client import CommitEntry, KvdClient
from pdserve.kvd.layout import BlockLayout
from pdserve.proto.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    kvd_pb2,
    kvd_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from tests.e2e.stack import ROOT, UpStack, child_env

KEYS = {"tenant-a": "sk-tenant-a", "tenant-b": "sk-tenant-b"}
# 6 full blocks of the built-in tokenizer's tokens, then a question.
PREFIX = "The shared system prompt of a product that many tenants use. " * 4
UNAUTHENTICATED, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny")


def _layout(llm: LLM) -> BlockLayout:
    """The stack's block layout (the tiny model's): a kvd pool holds one slot size."""
    cfg = llm.engine.config
    return BlockLayout(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, llm.engine.kv_dtype,
                       llm.engine.fingerprint)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpStack]:
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("".join(f"{key},{tenant}\n" for tenant, key in KEYS.items()))
    up = UpStack(["--model", "tiny", "--prefill", "1", "--decode", "1", "--keys-file",
                  str(keys), "--no-restart"]).start()
    yield up
    up.stop()


def _api(stack: UpStack, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=KEYS[tenant], max_retries=0,
                         timeout=60)


def _refused(call: object, code: grpc.StatusCode, needle: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()  # type: ignore[operator]
    assert err.value.code() == code, err.value.details()
    assert needle in (err.value.details() or "")


def _bare(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address)


def test_the_kvd_control_plane_refuses_anonymous_callers(stack: UpStack) -> None:
    with _bare(stack.addresses["kvd-p0"]) as ch:
        kvd = kvd_pb2_grpc.KvdStub(ch)
        needle = "metadata x-pdserve-secret: missing or wrong data credential"
        _refused(lambda: kvd.Allocate(kvd_pb2.AllocateRequest(num_slots=1), timeout=5),
                 UNAUTHENTICATED, needle)
        _refused(lambda: kvd.Commit(kvd_pb2.CommitRequest(), timeout=5), UNAUTHENTICATED,
                 needle)
        _refused(lambda: kvd.Release(kvd_pb2.ReleaseRequest(pin_ids=[1]), timeout=5),
                 UNAUTHENTICATED, needle)
        _refused(lambda: kvd.Transfer(kvd_pb2.TransferRequest(), timeout=5), UNAUTHENTICATED,
                 needle)
    with stack.channel(stack.addresses["kvd-p0"], auth.CLIENT) as ch:  # not the data one
        _refused(lambda: kvd_pb2_grpc.KvdStub(ch).Stats(kvd_pb2.KvdStatsRequest(), timeout=5),
                 UNAUTHENTICATED, "Kvd/Stats: metadata x-pdserve-secret")


def test_engine_admin_calls_need_the_admin_credential(stack: UpStack) -> None:
    address = stack.addresses["decode-0"]
    for creds, code in (((), UNAUTHENTICATED), ((auth.DATA,), DENIED)):
        with (stack.channel(address, *creds) if creds else _bare(address)) as ch:
            admin = engine_pb2_grpc.EngineStub(ch)
            _refused(lambda a=admin: a.Drain(engine_pb2.DrainRequest(), timeout=5), code,
                     "Engine/Drain")
            _refused(lambda a=admin: a.SetRole(engine_pb2.SetRoleRequest(
                role=common_pb2.ROLE_PREFILL), timeout=5), code, "Engine/SetRole")
            _refused(lambda a=admin: a.Abort(engine_pb2.AbortRequest(request_id="x"),
                                             timeout=5), code, "Engine/Abort")
    with stack.channel(address, auth.ADMIN) as ch:  # the router's credential may
        assert not engine_pb2_grpc.EngineStub(ch).Abort(
            engine_pb2.AbortRequest(request_id="nobody"), timeout=5).found
    # ... and the only decode instance still serves
    resp = _api(stack, "tenant-a").completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert resp.usage is not None and resp.usage.completion_tokens == 2


def test_engines_and_router_refuse_anonymous_data_calls(stack: UpStack) -> None:
    with _bare(stack.addresses["prefill-0"]) as ch:
        _refused(lambda: engine_pb2_grpc.PrefillStub(ch).Prefill(
            engine_pb2.PrefillRequest(prompt_token_ids=[5, 6]), timeout=5), UNAUTHENTICATED,
            "Prefill/Prefill: metadata x-pdserve-secret")
    with _bare(stack.router) as ch:
        _refused(lambda: list(router_pb2_grpc.RouterStub(ch).Generate(
            router_pb2.GenerateRequest(prompt="hi"), timeout=5)), UNAUTHENTICATED,
            "Router/Generate: metadata x-pdserve-client")


async def test_pins_belong_to_their_client_and_leases_are_capped(stack: UpStack,
                                                                llm: LLM) -> None:
    """With the data credential (a compromised engine at worst): another client's pins cannot
    be released, pin ids are not guessable, and a 49-day lease is capped."""
    secret = stack.secret(auth.DATA)
    owner = KvdClient(stack.addresses["kvd-d0"], "owner", secret=secret)
    thief = KvdClient(stack.addresses["kvd-d0"], "thief", secret=secret)
    layout = _layout(llm)
    try:
        await owner.register(layout)
        pins = await owner.allocate(2, lease_ms=4294967295)
        assert all(p.pin_id > 1 << 32 for p in pins)  # random 63-bit ids, not 1, 2, 3...
        _assert_code(await _raises(thief.release([pins[0].pin_id])),
                     grpc.StatusCode.INVALID_ARGUMENT, "unknown or expired pin")
        entry = CommitEntry(pins[0], b"\x01" * 32, block_checksum(owner.slot_memory(
            pins[0].slot)))
        _assert_code(await _raises(thief.commit([entry])), grpc.StatusCode.INVALID_ARGUMENT,
                     "is not a live Allocate pin")
        assert await owner.release([p.pin_id for p in pins]) == 2  # still the owner's
    finally:
        await owner.close()
        await thief.close()


async def test_a_lease_is_capped_and_one_client_cannot_pin_the_pool(tmp_path: Path) -> None:
    """A kvd of its own (a small pool, a 0.5 s lease cap) to watch the cap act quickly."""
    env = {**child_env(), "PDSERVE_SECRET": "s"}
    proc = subprocess.Popen([sys.executable, "-m", "services.kvd", "--port", "0",
                             "--capacity-mib", "1", "--max-lease-ms", "500", "--lease-ms", "500",
                             "--max-client-share", "0.25"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    address = proc.stdout.readline().split("listening on ")[1].split()[0]
    greedy = KvdClient(address, "greedy", secret="s")
    try:
        await greedy.register(BlockLayout(2, 16, 2, 16, "float32"))  # 8 KiB: 128 slots
        await greedy.allocate(32, lease_ms=4294967295)  # 25% of the pool: its whole quota
        _assert_code(await _raises(greedy.allocate(1)), grpc.StatusCode.RESOURCE_EXHAUSTED,
                     "quota of 32")
        await asyncio.sleep(1.0)  # the 49-day lease asked for lasted the 0.5 s cap
        stats = await greedy.stats()
        assert stats.num_lease_expiries == 32 and stats.slots_pinned == 0
    finally:
        await greedy.close()
        proc.terminate()
        proc.wait(timeout=10)


async def test_poisoning_with_the_public_recipe_gets_no_hit(stack: UpStack, llm: LLM) -> None:
    """The old attack: commit garbage under the unsalted hash of a prompt the victim is about
    to send. Without credentials it cannot even allocate; with the data credential its blocks
    still never match, because the gateway salts every tenant's hashes with a secret key."""
    assert llm.tokenizer is not None
    victim_prompt = PREFIX + "What does the victim ask?"
    ids = llm.tokenizer.encode(victim_prompt)
    hashes = hash_blocks(ids, 16, llm.engine.fingerprint)  # the public recipe, no salt
    anonymous = KvdClient(stack.addresses["kvd-p0"], "attacker")
    _assert_code(await _raises(anonymous.register(_layout(llm))),
                 UNAUTHENTICATED, "x-pdserve-secret")
    await anonymous.close()
    insider = KvdClient(stack.addresses["kvd-p0"], "insider", secret=stack.secret(auth.DATA))
    await insider.register(_layout(llm))
    pins = await insider.allocate(len(hashes))
    for p in pins:
        insider.slot_view(p.slot).fill_(7.0)  # garbage KV, with a valid checksum
    await insider.commit([CommitEntry(p, h) for p, h in zip(pins, hashes, strict=True)])
    unwritten = (await insider.allocate(1))[0]
    _assert_code(await _raises(insider.commit([CommitEntry(unwritten, b"\x02" * 32, 0)])),
                 grpc.StatusCode.INVALID_ARGUMENT, "entries[0].checksum: required")
    await insider.close()
    want = llm.generate([victim_prompt], SamplingParams(max_tokens=8, temperature=0))[0].text
    resp = _api(stack, "tenant-a").completions.create(model="tiny", prompt=victim_prompt,
                                                      max_tokens=8, temperature=0)
    assert resp.choices[0].text == want
    assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


def test_a_tenant_cannot_see_another_tenants_prefix(stack: UpStack) -> None:
    prompt = "Tenant A's private preamble, which no other tenant has sent before. " * 4
    a, b = _api(stack, "tenant-a"), _api(stack, "tenant-b")

    def cached(client: openai.OpenAI) -> int:
        resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                         temperature=0)
        assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
        return resp.usage.prompt_tokens_details.cached_tokens or 0

    assert cached(a) == 0
    assert cached(b) == 0  # B learns nothing of A's prefix
    assert cached(a) > 0  # A's own repeat is a hit


async def test_a_forged_push_destination_is_refused(stack: UpStack, llm: LLM) -> None:
    client = KvdClient(stack.addresses["kvd-p0"], "pusher", secret=stack.secret(auth.DATA))
    await client.register(_layout(llm))
    pins = await client.allocate(1)
    forged = common_pb2.KvdEndpoint(node_id="evil", address="127.0.0.1:9")
    entry = CommitEntry(pins[0], b"\x03" * 32)
    _assert_code(await _raises(client.commit([entry], forged)), DENIED,
                 "destination: 127.0.0.1:9 is not a registered kvd node")
    assert await client.release([pins[0].pin_id]) == 1  # nothing was committed
    await client.close()


def test_redis_needs_the_stacks_password(stack: UpStack) -> None:
    host, port = stack.redis_url.removeprefix("redis://").split("/")[0].split(":")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=host, port=int(port)).keys("*")


def test_the_gateway_opens_only_liveness_without_a_key(stack: UpStack) -> None:
    base = stack.base_url.removesuffix("/v1")
    health = httpx.get(f"{base}/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok",
                                                           "router_serving": True}
    for path in ("/metrics", "/docs", "/openapi.json", "/redoc", "/v1/models"):
        resp = httpx.get(f"{base}{path}", timeout=10)
        assert resp.status_code == 401, path
        assert resp.json()["error"]["message"].startswith("missing API key")
    ok = httpx.get(f"{base}/metrics", timeout=10,
                   headers={"Authorization": f"Bearer {KEYS['tenant-b']}"})
    assert ok.status_code == 200 and "pdserve_gateway" in ok.text


@pytest.mark.parametrize("service", ["kvd", "router", "prefill", "decode", "gateway"])
def test_a_service_on_all_interfaces_without_credentials_refuses_to_start(service: str) -> None:
    args = ["--host", "0.0.0.0", "--port", "0"]
    if service == "router":
        args += ["--decode", "127.0.0.1:1"]
    env = {k: v for k, v in child_env().items() if not k.startswith("PDSERVE_") or
           k == "PDSERVE_LOG_LEVEL"}
    proc = subprocess.run([sys.executable, "-m", f"services.{service}", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    needle = ("needs API keys" if service == "gateway" else
              "on a non-loopback address needs PDSERVE_")
    assert needle in proc.stderr and "refusing to start" in proc.stderr


async def _raises(awaitable: object) -> grpc.RpcError:
    try:
        await awaitable  # type: ignore[misc]
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("the call succeeded")


def _assert_code(err: grpc.RpcError, code: grpc.StatusCode, needle: str) -> None:
    assert err.code() == code, err.details()
    assert needle in (err.details() or ""), err.details()
