"""PrefixIndex contract, run against both implementations (Redis: the private test server)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest

from pdserve.index import IndexUnavailable, LocalPrefixIndex, NodeRecord, PrefixIndex
from pdserve.index.redis_index import RedisPrefixIndex


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def rec(node: str, epoch: int = 1) -> NodeRecord:
    return NodeRecord(node, f"{node}:1", b"\x01\x02", capacity=10, epoch=epoch)


@pytest.fixture(params=["local", "redis"])
async def index(request: pytest.FixtureRequest) -> AsyncIterator[PrefixIndex]:
    if request.param == "local":
        yield LocalPrefixIndex()
        return
    idx = RedisPrefixIndex(request.getfixturevalue("redis_url"), prefix="t:")
    yield idx
    await idx.close()


async def test_lookup_counts_leading_hashes_per_live_node(index: PrefixIndex) -> None:
    await index.register_node(rec("a"), ttl=30)
    await index.register_node(rec("b"), ttl=30)
    await index.add("a", [h(0), h(1), h(2)])
    await index.add("b", [h(0), h(2), h(3)])  # b lacks h1: its run stops at 1
    await index.add("ghost", [h(0), h(1)])  # no registry record: never listed
    assert await index.lookup([h(0), h(1), h(2), h(3)]) == {"a": 3, "b": 1}
    assert await index.lookup([h(2), h(3)]) == {"a": 1, "b": 2}
    assert await index.lookup([h(9), h(0)]) == {}
    await index.remove("a", [h(1)])
    assert await index.lookup([h(0), h(1)]) == {"a": 1, "b": 1}
    assert [n.node_id for n in await index.nodes()] == ["a", "b"]
    assert (await index.nodes())[0] == rec("a")


async def test_purge_respects_newer_epoch(index: PrefixIndex) -> None:
    await index.register_node(rec("a", epoch=5), ttl=30)
    await index.add("a", [h(0), h(1)])
    assert await index.purge_node("a", epoch=4) == -1  # an older incarnation cannot purge
    assert await index.lookup([h(0)]) == {"a": 1}
    assert await index.purge_node("a", epoch=5) == 2
    assert await index.lookup([h(0)]) == {}


async def test_redis_down_raises_index_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once we leave: nothing listens there
    idx = RedisPrefixIndex(f"redis://127.0.0.1:{port}/0", timeout_s=0.2)
    with pytest.raises(IndexUnavailable):
        await idx.lookup([h(0)])
    with pytest.raises(IndexUnavailable):
        await idx.add("a", [h(0)])
    await idx.close()


def test_node_record_validates_and_round_trips() -> None:
    with pytest.raises(ValueError, match="node_id"):
        NodeRecord("", "x:1", b"", 1, 1)
    with pytest.raises(ValueError, match="capacity"):
        NodeRecord("a", "x:1", b"", -1, 1)
    r = rec("a")
    assert NodeRecord.from_json(r.to_json()) == r
