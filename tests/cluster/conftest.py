"""The namespace cluster for these tests, and what they ask of it (stats, the index, text).

Skipped, with the reason, only where network namespaces cannot be created (not root, no
iproute2, a container without the capability); anywhere else a failure to start is an error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc
import pytest

from pdserve import LLM, SamplingParams, auth
from pdserve.proto.v1 import engine_pb2, engine_pb2_grpc, kvd_pb2, kvd_pb2_grpc
from pdserve_bench.cluster import ClusterSpec, NetnsCluster
from pdserve_bench.netns import unavailable_reason

T = TypeVar("T")
MAX_TOKENS = 8
# Each prefill kvd sleeps this long before sending a transfer's bytes (a test hook), so a test
# can take a link down while the transfer is announced but not yet delivered.
SEND_DELAY_MS = 800
SPEC = ClusterSpec(model="tiny", num_prefill=2, num_decode=1,
                   kvd_args=("--fault-send-delay-ms", str(SEND_DELAY_MS)))


@pytest.fixture(scope="session")
def netns_reason() -> str | None:
    return unavailable_reason()


@pytest.fixture(scope="module", autouse=True)
def _needs_namespaces(netns_reason: str | None) -> None:
    """Runs before the module's other fixtures: no namespaces, no cluster to start."""
    if netns_reason is not None:
        pytest.skip(f"namespace cluster: {netns_reason}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsCluster]:
    c = NetnsCluster(SPEC, tmp_path_factory.mktemp("cluster-logs")).start()
    try:
        yield c
    finally:
        c.stop()
    assert c.net.leftovers() == [], "the cluster left namespaces or links behind"
    assert c.pools() == [], "the cluster left kvd pools in /dev/shm"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny")


def reference(llm: LLM, prompt: str) -> str:
    """The offline engine's greedy text: what every path through the cluster must answer."""
    out = llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return out[0].text


def kvd_stats(cluster: NetnsCluster, node: str) -> kvd_pb2.KvdStats:
    with grpc.insecure_channel(cluster.kvd_address(node)) as ch:
        return kvd_pb2_grpc.KvdStub(ch).Stats(kvd_pb2.KvdStatsRequest(), timeout=5,
                                              metadata=cluster.metadata(auth.DATA))


def engine_stats(cluster: NetnsCluster, node: str) -> engine_pb2.EngineStats:
    with grpc.insecure_channel(cluster.engine_address(node)) as ch:
        return engine_pb2_grpc.EngineStub(ch).Stats(engine_pb2.EngineStatsRequest(), timeout=5,
                                                    metadata=cluster.metadata(auth.DATA))


def eventually(check: Callable[[], T], timeout: float, what: str) -> T:
    """``check()``'s first truthy value within ``timeout`` seconds (AssertionError naming
    ``what`` otherwise)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.1)
