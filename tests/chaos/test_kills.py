"""kill -9 and SIGSTOP of the processes of one live stack (1 prefill node, 2 decode nodes):
the client sees a retryable error at worst, the stack serves again within its bound, the
supervisor restarts what died, a restarted kvd gets its engine back, nothing stays pinned. A
decode killed mid-stream fails over: the client's one stream carries the whole reference answer
(``LLM.generate``) with no token lost or sent twice, and its usage counts the failover."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from pdserve import LLM, SamplingParams
from pdserve_bench.chaos import ChaosStack, Probe
from tests.chaos.conftest import assert_idle, healthy

DECODE_NODE = ("kvd-d0", "decode-0")


def _wait_registered(stack: ChaosStack, kvd: str, old_epoch: int, timeout: float) -> float:
    """Seconds until the restarted ``kvd`` has a pool again: its engine registered with it
    (a kvd creates its pool at the first Register)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            s = stack.kvd_stats(kvd)
            if s.epoch != old_epoch and s.num_slots > 0:
                return time.monotonic() - start
        except Exception:  # noqa: BLE001 - not back yet
            pass
        time.sleep(0.1)
    raise AssertionError(f"no engine registered with the restarted {kvd} within {timeout}s")


def test_a_killed_decode_kvd_comes_back_with_its_engine(stack: ChaosStack) -> None:
    healthy(stack, DECODE_NODE)
    old = stack.kvd_stats("kvd-d0").epoch
    pid = stack.children()["kvd-d0"]
    recovery = stack.recover(lambda: stack.kill("kvd-d0"))
    assert recovery.seconds < 5.0, recovery  # the other decode node serves meanwhile
    stack.wait_restarted("kvd-d0", pid)
    _wait_registered(stack, "kvd-d0", old, timeout=30)
    results = [stack.probe() for _ in range(6)]  # both decode nodes take requests again
    assert all(r.ok for r in results), [r.error for r in results]
    assert_idle(stack)


def test_a_killed_decode_engine_is_routed_around_and_restarted(stack: ChaosStack) -> None:
    healthy(stack, DECODE_NODE)
    pid = stack.children()["decode-1"]
    recovery = stack.recover(lambda: stack.kill("decode-1"))
    assert recovery.seconds < 5.0, recovery
    stack.wait_restarted("decode-1", pid)
    healthy(stack)
    assert_idle(stack)


def test_a_prefill_killed_mid_request_fails_that_request_and_holds_nothing(
        stack: ChaosStack) -> None:
    healthy(stack, ("prefill-0", "kvd-p0"))
    long_prompt = "the quick brown fox jumps over the lazy dog " * 150
    seen: list[Probe] = []
    t = threading.Thread(target=lambda: seen.append(stack.probe(prompt=long_prompt,
                                                                max_tokens=2, timeout=60)))
    t.start()
    time.sleep(0.5)  # prefilling (chunked) on the only prefill instance
    pid = stack.kill("prefill-0")
    t.join(timeout=60)
    assert seen and (seen[0].ok or "HTTP 5" in seen[0].error), seen  # an answer, no hang
    assert seen[0].seconds < 30
    # The dead prefill's pins go with its session, long before their 30 s lease.
    start = time.monotonic()
    held = stack.wait_idle(timeout=10, names=("kvd-p0",))  # prefill-0 is restarting
    assert held.get("kvd-p0") == (0, 0, 0), held
    assert time.monotonic() - start < 10
    stack.wait_restarted("prefill-0", pid)
    healthy(stack)
    assert_idle(stack)


PROMPT = "Once upon a time, in a land of many rivers,"
MAX_TOKENS = 500  # long enough to be mid-stream when the kill lands


@pytest.fixture(scope="module")
def reference() -> str:
    llm = LLM("tiny")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return llm.generate([PROMPT], params)[0].text


def _streaming_decode(stack: ChaosStack) -> str:
    """The decode engine running a request now."""
    for _ in range(100):
        busy = [n for n, v in stack.held().items() if n.startswith("decode-") and v[1] > 0]
        if busy:
            return busy[0]
        time.sleep(0.02)
    raise AssertionError("no decode engine is running the request")


def _stream_with_fault(stack: ChaosStack, fault: Callable[[str], object], timeout: float
                       ) -> tuple[list[str], dict[str, object], list[tuple[str, object]]]:
    """Stream the reference request; at the 20th text piece call ``fault`` on the decode
    engine running it. The pieces, the usage, and [(engine, what fault returned)]."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    pieces: list[str] = []
    usage: dict[str, object] = {}
    faulted: list[tuple[str, object]] = []
    with httpx.stream("POST", f"{stack.base_url}/completions", json=body,
                      timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            pieces.extend(c["text"] for c in event["choices"])
            usage = event.get("usage") or usage
            if len(pieces) == 20 and not faulted:
                name = _streaming_decode(stack)
                faulted.append((name, fault(name)))
    assert faulted, "the answer ended before the fault"
    return pieces, usage, faulted


def test_a_decode_killed_mid_stream_fails_over_with_the_exact_text(
        stack: ChaosStack, reference: str) -> None:
    healthy(stack, ("decode-0", "decode-1"))
    pieces, usage, killed = _stream_with_fault(stack, stack.kill, timeout=120)
    assert len(pieces) > 20 + 10, "the kill landed after the answer was complete"
    assert "".join(pieces) == reference  # byte for byte: nothing lost, nothing twice
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["failovers"] == 1
    name, pid = killed[0]
    assert isinstance(pid, int)
    stack.wait_restarted(name, pid)
    healthy(stack)
    assert_idle(stack)


@pytest.mark.slow
def test_a_killed_prefill_kvd_comes_back_with_its_engine(stack: ChaosStack) -> None:
    healthy(stack, ("prefill-0", "kvd-p0"))
    old = stack.kvd_stats("kvd-p0").epoch
    pid = stack.children()["kvd-p0"]
    recovery = stack.recover(lambda: stack.kill("kvd-p0"))
    assert recovery.seconds < 20.0, recovery  # its only prefill node: the kvd's restart
    stack.wait_restarted("kvd-p0", pid)
    assert _wait_registered(stack, "kvd-p0", old, timeout=5) < 5
    assert_idle(stack)


@pytest.mark.slow
def test_redis_killed_routing_goes_on_and_redis_is_restarted(stack: ChaosStack) -> None:
    healthy(stack, ("redis",))
    pid = stack.children()["redis"]
    recovery = stack.recover(lambda: stack.kill("redis"))
    assert recovery.seconds < 5.0, recovery
    assert stack.wait_restarted("redis", pid, timeout=30) != pid
    results = [stack.probe() for _ in range(4)]
    assert all(r.ok for r in results), [r.error for r in results]
    assert_idle(stack)


def _at_once(stack: ChaosStack, n: int, timeout: float = 30) -> list[Probe]:
    """``n`` probes sent together (the policy spreads them: some land on every decode)."""
    seen: list[Probe] = []
    threads = [threading.Thread(target=lambda: seen.append(stack.probe(timeout=timeout)))
               for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("name", ["decode-0", "redis"])
def test_a_paused_process_resumes(stack: ChaosStack, name: str) -> None:
    healthy(stack, (name,))
    stack.signal(name, signal.SIGSTOP)
    try:  # at once: before a health poll finds it paused, some requests are placed on it
        during = _at_once(stack, 4)
    finally:
        stack.signal(name, signal.SIGCONT)
    # A decode that sends nothing and answers no health check is left after a few seconds:
    # the request goes to the other decode with its blocks, a complete answer.
    assert all(p.ok for p in during), during
    assert max(p.seconds for p in during) < 15, during
    healthy(stack)
    assert_idle(stack)


@pytest.mark.slow
def test_a_decode_paused_mid_stream_fails_over_with_the_exact_text(
        stack: ChaosStack, reference: str) -> None:
    healthy(stack, ("decode-0", "decode-1"))
    paused: list[str] = []

    def pause(name: str) -> None:
        paused.append(name)
        stack.signal(name, signal.SIGSTOP)

    start = time.monotonic()
    try:
        pieces, usage, _ = _stream_with_fault(stack, pause, timeout=60)
    finally:
        for name in paused:
            stack.signal(name, signal.SIGCONT)
    assert "".join(pieces) == reference  # the stall timeout, then on from the tokens sent
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["failovers"] == 1
    assert time.monotonic() - start < 30
    healthy(stack)
    assert_idle(stack)
