"""Issue 6 end to end: with two prefill nodes, the second turn of a conversation goes to the
node holding its prefix under cache-aware routing, and round-robin does not follow it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from pdserve.proto.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.e2e.stack import ROOT, UpStack

TURN_1 = "Tell me about paged attention and block tables in serving systems. " * 4
TURN_2_SUFFIX = " And what about prefix caching across many turns of a chat?"


@pytest.fixture(scope="module")
def stack() -> Iterator[UpStack]:
    up = UpStack(["--model", "tiny", "--prefill", "2", "--decode", "1",
                  "--policy", "cache_aware", "--no-restart"]).start()
    yield up
    up.stop()


@pytest.fixture(scope="module")
def round_robin_router(stack: UpStack) -> Iterator[str]:
    """A second router over the same engines and index, with the round_robin policy."""
    prefill = ",".join(stack.addresses[f"prefill-{i}"] for i in range(2))
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.router", "--port", "0", "--model", "tiny",
         "--policy", "round_robin", "--prefill", prefill, "--decode",
         stack.addresses["decode-0"]],
        cwd=ROOT, env=stack.role_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "listening on" in line, line
    yield line.split("listening on ")[1].split()[0]
    proc.terminate()
    proc.wait(timeout=15)


def _generate(stack: UpStack, address: str, prompt: str) -> tuple[router_pb2.Placement, str]:
    with stack.channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        req = router_pb2.GenerateRequest(
            model="tiny", prompt=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.0))
        placement, text = None, ""
        for msg in stub.Generate(req, timeout=60):
            if msg.HasField("placement"):
                placement = msg.placement
            text += msg.text
    assert placement is not None
    return placement, text


def _state(stack: UpStack, address: str) -> router_pb2.ClusterStateResponse:
    with stack.channel(address) as channel:
        return router_pb2_grpc.RouterStub(channel).ClusterState(
            router_pb2.ClusterStateRequest(), timeout=10)


def _wait_healthy(stack: UpStack, address: str) -> None:
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = _state(stack, address)
        if sum(1 for i in state.instances if i.healthy) == 3:
            return
        time.sleep(0.2)
    raise AssertionError(f"instances never all healthy: {state}")


def test_cache_aware_follows_the_prefix(stack: UpStack) -> None:
    _wait_healthy(stack, stack.router)
    first, answer = _generate(stack, stack.router, TURN_1)
    assert first.cached_blocks == 0
    for _ in range(2):  # every later turn goes back to the node that holds the prefix
        second, _ = _generate(stack, stack.router, TURN_1 + answer + TURN_2_SUFFIX)
        assert second.prefill_instance == first.prefill_instance
        assert second.cached_blocks >= first.prompt_tokens // 16 > 0
    state = _state(stack, stack.router)
    assert state.policy == "cache_aware" and state.num_prefix_hit_blocks > 0


def test_round_robin_does_not_follow_the_prefix(stack: UpStack,
                                                round_robin_router: str) -> None:
    _wait_healthy(stack, round_robin_router)
    prompt = "A different conversation about UCX transports and shared memory pools. " * 4
    first, answer = _generate(stack, round_robin_router, prompt)
    second, _ = _generate(stack, round_robin_router, prompt + answer + TURN_2_SUFFIX)
    assert second.prefill_instance != first.prefill_instance
    assert _state(stack, round_robin_router).policy == "round_robin"
