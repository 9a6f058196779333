"""SLO-aware admission on a real ``pdserve up`` stack: with --slo-admission reject and a TTFT
SLO no request can meet (1 ms), a client gets HTTP 429, a Retry-After header and the router's
reason, streaming or not, and nothing is left held on the engines."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from pdserve.proto.v1 import engine_pb2, engine_pb2_grpc
from tests.e2e.stack import UpStack


@pytest.fixture(scope="module")
def stack() -> Iterator[UpStack]:
    up = UpStack(["--router-arg=--slo-admission=reject", "--router-arg=--slo-ttft-ms=1",
                  "--no-restart"]).start()
    try:
        yield up
    finally:
        up.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_cannot_meet_its_ttft_slo_is_refused_with_retry_after(
        stack: UpStack, stream: bool) -> None:
    r = httpx.post(f"{stack.base_url}/completions", timeout=30,
                   json={"prompt": "hello there", "max_tokens": 4, "stream": stream})
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1"
    message = r.json()["error"]["message"]
    assert "router: predicted time to first token" in message
    assert message.endswith("exceeds the TTFT SLO of 1 ms (--slo-ttft-ms); refused "
                            "(--slo-admission reject)")
    for name, address in stack.addresses.items():
        if name.startswith(("prefill", "decode")):
            with stack.channel(address) as channel:
                stats = engine_pb2_grpc.EngineStub(channel).Stats(
                    engine_pb2.EngineStatsRequest(), timeout=5)
            assert stats.kv_blocks_used == 0 and stats.queue_depth == 0  # never reached them
