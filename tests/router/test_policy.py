"""The routing policies on hand-made instance states (no servers: the choice alone)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from pdserve.proto.v1 import common_pb2, engine_pb2
from services.router.instances import Instance
from services.router.policy import (
    CacheAware,
    Choice,
    LeastLoad,
    RoundRobin,
    RouteQuery,
    RoutingPolicy,
    make_policy,
)

P, D = common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE


@pytest.fixture
async def made() -> AsyncIterator[list[Instance]]:
    out: list[Instance] = []
    yield out
    for i in out:
        await i.close()


def _inst(made: list[Instance], name: str, role: int, node: str, **stats: float) -> Instance:
    inst = Instance(f"127.0.0.1:{1000 + len(made)}", role, instance_id=name, kvd_node_id=node,
                    is_healthy=True)
    stats.setdefault("kv_blocks_free", 1000)
    inst.apply_stats(engine_pb2.EngineStats(**stats))  # type: ignore[arg-type]
    made.append(inst)
    return inst


def query(held: dict[str, int] | None, num_blocks: int = 8) -> RouteQuery:
    return RouteQuery(num_blocks * 16 + 5, 16, num_blocks, held)


def pick(policy: RoutingPolicy, q: RouteQuery, prefills: list[Instance],
         decodes: list[Instance]) -> Choice:
    choice = policy.choose(q, prefills, decodes)
    assert choice is not None
    return choice


async def test_cache_aware_weighs_prefix_queue_and_rate(made: list[Instance]) -> None:
    a, b = _inst(made, "A", P, "na"), _inst(made, "B", P, "nb")
    d = _inst(made, "D", D, "nd")
    policy = CacheAware()
    assert policy.choose(query({"nb": 6}), [a, b], [d]) == (b, d, 6)
    b.num_inflight_prefill_tokens = 5000  # B is busy: 6 cached blocks are not worth the wait
    assert pick(policy, query({"nb": 6}), [a, b], [d]).prefill is a
    b.num_inflight_prefill_tokens = 0
    a.apply_stats(engine_pb2.EngineStats(queue_depth=2, prefill_tokens_per_s=50000))
    b.apply_stats(engine_pb2.EngineStats(queue_depth=2))  # idle-looking: the floor rate
    assert pick(policy, query(None), [a, b], [d]).prefill is a  # A has shown it is faster
    assert a.peak_prefill_tokens_per_s == 50000


async def test_cache_aware_decode_by_room_then_load_then_locality(made: list[Instance]) -> None:
    p = _inst(made, "P", P, "n1")
    far = _inst(made, "D1", D, "n2")
    near = _inst(made, "D2", D, "n1")  # shares P's node: nothing to transfer
    policy = CacheAware()
    assert pick(policy, query({}), [p], [far, near]).decode is near
    near.apply_stats(engine_pb2.EngineStats(num_running=3, kv_blocks_free=1000))
    assert pick(policy, query({}), [p], [far, near]).decode is far  # load before locality
    far.apply_stats(engine_pb2.EngineStats(kv_blocks_free=4))  # no room for 8 blocks
    assert pick(policy, query({}), [p], [far, near]).decode is near
    assert policy.choose(query({}), [p], []) is None


async def test_colocated_choice_has_no_prefill(made: list[Instance]) -> None:
    c1 = _inst(made, "C1", common_pb2.ROLE_COLOCATED, "n1")
    c2 = _inst(made, "C2", common_pb2.ROLE_COLOCATED, "n2")
    for policy in (CacheAware(), LeastLoad(), RoundRobin()):
        choice = policy.choose(query({"n2": 3}), [], [c1, c2])
        assert choice is not None and choice.prefill is None
    assert CacheAware().choose(query({"n2": 3}), [], [c1, c2]) == (None, c2, 3)


def test_make_policy_names() -> None:
    assert [make_policy(n).name for n in ("cache_aware", "least_load", "round_robin")] == [
        "cache_aware", "least_load", "round_robin"]
    with pytest.raises(ValueError, match="--policy"):
        make_policy("fastest")
