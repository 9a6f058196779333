"""The in-place actuator and the gRPC Stats source against real flex engine services (gRPC
servers on port 0 around real tiny engines): a role flip under load drops no request and leaks
no block; the monitor's rates come from the engines' real counters."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from pdserve.controller.actuator import ActuationError, InPlaceActuator
from pdserve.controller.monitor import GrpcStatsSource, ResourceMonitor
from pdserve.controller.optimizer import Plan
from pdserve.proto.v1 import common_pb2, engine_pb2
from services.engine.config import EngineServiceConfig
from tests.services.harness import Client, engine, serve, tokens_of

PROMPT = list(range(2, 30))
SHORT = list(range(2, 12))
NEW = 200  # long enough answers to still stream when the flip starts


@contextlib.asynccontextmanager
async def two_flex() -> AsyncIterator[tuple[Client, Client]]:
    cfg = EngineServiceConfig(role="flex", num_blocks=64)
    async with serve(cfg, engine(tag="ctl-a")) as a, serve(cfg, engine(tag="ctl-b")) as b:
        yield a, b


def _address(c: Client) -> str:
    assert c.instance is not None
    return c.instance.address


async def test_flip_under_load_drops_no_request_and_leaks_no_block() -> None:
    async with two_flex() as (a, b):
        act = InPlaceActuator([_address(a), _address(b)])
        # both start as prefill; p=1 d=1 flips the least busy (ties: by address)
        flips = await act.apply(Plan(1, 1))
        assert len(flips) == 1 and flips[0].to_role == "decode"
        decode = a if flips[0].address == _address(a) else b
        assert (await decode.stats()).role == common_pb2.ROLE_DECODE
        assert await act.apply(Plan(1, 1)) == []  # the plan in force: nothing to do
        # prompts shorter than a block: no KV to import, decode computes the tail itself
        first = engine_pb2.PrefillResponse(first_token_id=5)
        streams = [asyncio.ensure_future(decode.decode(
            f"r{i}", SHORT, max_tokens=NEW, prefilled=first, ignore_eos=True)) for i in range(3)]
        async with asyncio.timeout(20):
            while (await decode.stats()).num_running == 0:
                await asyncio.sleep(0.005)
        flips = await act.apply(Plan(2, 0))  # flip it back while the answers stream
        assert [f.to_role for f in flips] == ["prefill"] and flips[0].num_in_flight >= 1
        for s in streams:
            # none dropped or cut: every answer ran to max_tokens (the first came with the
            # request, as from a prefill instance)
            assert s.done() and len(tokens_of(s.result())) == NEW - 1
            assert s.result()[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        stats = await decode.stats()
        assert stats.role == common_pb2.ROLE_PREFILL and not stats.draining
        assert stats.kv_blocks_used == 0  # every block of the finished answers freed
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await decode.decode("late", SHORT, prefilled=first)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        await act.close()


async def test_plans_it_cannot_carry_out_are_refused_with_the_reason() -> None:
    async with two_flex() as (a, b):
        act = InPlaceActuator([_address(a), _address(b)])
        with pytest.raises(ActuationError, match="needs 3 flex engines, 2 answered Stats"):
            await act.apply(Plan(2, 1))
        with pytest.raises(ActuationError, match=r"colocated=3 needs 3 flex engines"):
            await act.apply(Plan(0, 0, 3))
        await act.close()
    with pytest.raises(ActuationError, match="Stats failed: UNAVAILABLE"):
        await InPlaceActuator(["127.0.0.1:1"], rpc_timeout_s=1).apply(Plan(1, 0))


async def test_grpc_source_samples_real_engines_and_skips_unreachable_ones() -> None:
    async with two_flex() as (a, b):
        source = GrpcStatsSource([_address(a), "127.0.0.1:1"], timeout_s=1)
        monitor = ResourceMonitor(source, window_s=60)
        first = await monitor.poll()
        assert [s.address for s in first] == [_address(a)]  # the dead address left out
        assert first[0].role == "prefill" and first[0].is_flex
        for i in range(3):
            await a.prefill(f"p{i}", [i + 2, *PROMPT])
        await monitor.poll()
        rates = monitor.rates(first[0].instance_id)
        assert rates is not None and rates.prefill_tokens_per_s > 0
        latest = monitor.latest()[0]
        assert latest.prefill_tokens_computed - first[0].prefill_tokens_computed == \
            3 * (len(PROMPT) + 1)
        await source.close()


async def test_engines_switched_to_colocated_run_the_controllers_chunk() -> None:
    async with two_flex() as (a, b):
        act = InPlaceActuator([_address(a), _address(b)])
        act.chunk_tokens = 48
        assert len(await act.apply(Plan(0, 0, 2))) == 2
        assert [(await c.stats()).max_prefill_tokens for c in (a, b)] == [48, 48]
        await act.apply(Plan(1, 1))  # a split: each engine's own budget again
        assert [(await c.stats()).max_prefill_tokens for c in (a, b)] == [512, 512]
        act.chunk_tokens = 1024  # more than the engines' budget: refused, with the reason
        with pytest.raises(ActuationError, match=r"SetRole on .* failed: INVALID_ARGUMENT: "
                           r"max_prefill_tokens: at most this engine's --max-num-batched-tokens "
                           r"\(512\), got 1024"):
            await act.apply(Plan(0, 0, 2))
        await act.close()
