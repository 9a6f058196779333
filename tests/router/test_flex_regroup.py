"""Flex engines switching between colocated and prefill/decode under a request (scripted fake
engines, the real router): while no group can take a request — only one role is up, the other
engine draining — it waits instead of failing, and when the engines are back in their new
roles it starts over on the new kind of group (``running.Regroup``)."""

from __future__ import annotations

import asyncio
import time

import grpc

from tests.router.conftest import Cluster
from tests.router.fakes import FakeEngine

PROMPT = list(range(2, 20))


async def _later(delay: float, engine: FakeEngine, role: str) -> None:
    """``engine`` finishes draining ``delay`` seconds from now, in ``role``."""
    await asyncio.sleep(delay)
    engine.role, engine.stats.draining = role, False


async def test_2c_to_1p1d_waits_while_one_role_is_up_then_runs_on_the_split(
        cluster: Cluster) -> None:
    a, b = await cluster.engine("A", "colocated"), await cluster.engine("B", "colocated")
    _, client = await cluster.router([], [a, b], policy="round_robin", poll_interval=0.2)
    # A switched to prefill (a Decode without first token is refused there); B is draining
    # towards decode and hands the prompt back.
    a.role, a.decode_errors = "prefill", [grpc.StatusCode.FAILED_PRECONDITION]
    b.stats.draining, b.decode_errors = True, [grpc.StatusCode.UNAVAILABLE]
    switch = asyncio.ensure_future(_later(1.0, b, "decode"))
    start = time.monotonic()
    messages = await client.generate(ids=PROMPT, max_tokens=4, timeout=20)
    waited = time.monotonic() - start
    await switch
    assert [t for m in messages for t in m.token_ids] == [7, 100, 101, 102]
    assert waited >= 0.9  # held until the decode engine was back, not failed
    assert len(a.seen.prefills) == 1  # started over: prefilled on A, decoded on B
    assert b.seen.decodes[-1].first_token_id == 7
    assert messages[0].placement.prefill_instance == "A"
    assert messages[0].placement.decode_instance == "B"


async def test_1p1d_to_2c_a_prompt_handed_back_starts_over_colocated(cluster: Cluster) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    _, client = await cluster.router([p], [d], poll_interval=0.2)
    # P is draining towards colocated and hands the prompt back; D has switched to colocated
    # at once, which the router learns at its next poll (after the prefill was tried).
    p.stats.draining, p.prefill_errors = True, [grpc.StatusCode.UNAVAILABLE]

    async def switch_after_the_prefill() -> None:
        while not p.seen.prefills:
            await asyncio.sleep(0.001)
        d.role = "colocated"

    switch = asyncio.ensure_future(switch_after_the_prefill())
    messages = await client.generate(ids=PROMPT, max_tokens=3, timeout=20)
    await switch
    assert [t for m in messages for t in m.token_ids] == [100, 101, 102]
    assert len(p.seen.prefills) == 1  # tried there once, handed back
    assert not d.seen.decodes[-1].HasField("first_token_id")  # the whole request, colocated
    assert messages[0].placement.decode_instance == "D"
