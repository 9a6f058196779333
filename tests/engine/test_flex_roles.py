"""A flex engine's role switches (``Engine.SetRole``) on real in-process engine services: to
colocated it serves the colocated path exactly as a ``--role colocated`` engine does; a switch
away hands its queued, unstarted prompts back (UNAVAILABLE, for the router to place elsewhere)
while its running requests finish, and leaves no page used."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from pdserve.engine.engine import Engine
from pdserve.proto.v1 import common_pb2, engine_pb2
from services.engine.config import EngineServiceConfig
from tests.services.harness import Client, engine, serve, tokens_of
from tests.services.test_bridge_loopback import LoopbackKvd

PROMPT = list(range(2, 40))
HANDED_BACK = "instance is switching role: try another"
P, D, C = common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE, common_pb2.ROLE_COLOCATED


async def _set_role(client: Client, role: common_pb2.Role) -> engine_pb2.SetRoleResponse:
    return await client.admin.SetRole(engine_pb2.SetRoleRequest(role=role), timeout=60)


async def _until(check: object, timeout: float = 20) -> None:
    async with asyncio.timeout(timeout):
        while not await check():  # type: ignore[operator]
            await asyncio.sleep(0.005)


def _one_seat_engine() -> Engine:
    """Its own engine with one sequence at a time, so later requests stay queued."""
    return Engine.from_model("tiny", EngineServiceConfig(num_blocks=64,
                                                         max_num_seqs=1).engine_args())


async def test_a_flex_engine_switched_to_colocated_serves_as_a_colocated_engine() -> None:
    flex_cfg = EngineServiceConfig(role="flex", num_blocks=64)
    colo_cfg = EngineServiceConfig(role="colocated", num_blocks=64)
    async with serve(flex_cfg, engine(tag="flex-colo")) as flex, \
            serve(colo_cfg, engine(tag="colo")) as colo:
        with pytest.raises(grpc.aio.AioRpcError) as err:  # prefilling: no colocated path yet
            await flex.decode("early", PROMPT)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.details() == ("this instance runs role prefill; it serves this call "
                                       "only in role decode or colocated")
        switched = await _set_role(flex, C)
        assert (switched.role, switched.num_handed_back) == (C, 0)
        stats = await flex.stats()
        assert (stats.role, stats.is_flex, stats.draining) == (C, True, False)
        want = tokens_of(await colo.decode("c", PROMPT, max_tokens=24, ignore_eos=True))
        got = tokens_of(await flex.decode("f", PROMPT, max_tokens=24, ignore_eos=True))
        assert len(want) == 24 and got == want  # greedy: the same answer as --role colocated
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await flex.prefill("p", PROMPT)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "runs role colocated; it serves this call only in role prefill" in \
            err.value.details()
        assert (await _set_role(flex, P)).role == P  # and back
        assert (await flex.prefill("p2", PROMPT)).first_token_id == want[0]
        assert (await flex.stats()).kv_blocks_used == 0


async def test_a_colocated_flex_engine_copies_no_prompt_to_its_kvd() -> None:
    """As a ``--role colocated`` engine (which has no kvd): a flex engine's kvd is for the
    prefill/decode hand-over, not for the prompts it prefills itself."""
    eng = engine(tag="flex-kvd")
    kvd = LoopbackKvd(64, eng.cache.block_shape, eng.config.dtype)
    async with serve(EngineServiceConfig(role="flex", num_blocks=64), eng,
                     kvd_client=kvd) as flex:
        await _set_role(flex, C)
        chunks = await flex.decode("own", PROMPT * 2, max_tokens=40, ignore_eos=True)
        assert len(tokens_of(chunks)) == 40
        assert kvd.num_commits == 0
        assert (await flex.stats()).kv_blocks_used == 0


async def test_leaving_colocated_hands_queued_prompts_back_and_finishes_running_ones() -> None:
    cfg = EngineServiceConfig(role="flex", num_blocks=64, max_num_seqs=1)
    async with serve(cfg, _one_seat_engine()) as flex:
        await _set_role(flex, C)
        running = asyncio.ensure_future(flex.decode("a", PROMPT, max_tokens=200,
                                                    ignore_eos=True, timeout=60))
        await _until(lambda: _stat(flex, "num_running", 1))
        queued = [asyncio.ensure_future(flex.decode(f"q{i}", PROMPT, max_tokens=8))
                  for i in range(2)]
        await _until(lambda: _stat(flex, "queue_depth", 2))
        switched = await _set_role(flex, P)  # returns once the running answer is done
        assert (switched.role, switched.num_handed_back) == (P, 2)
        for q in queued:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await q
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert err.value.details() == HANDED_BACK
        chunks = await running  # never dropped: it ran to max_tokens
        assert len(tokens_of(chunks)) == 200
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        stats = await flex.stats()
        assert (stats.role, stats.draining, stats.queue_depth, stats.num_running,
                stats.kv_blocks_used) == (P, False, 0, 0, 0)


async def test_leaving_prefill_hands_back_prompts_queued_behind_a_busy_step() -> None:
    async with serve(EngineServiceConfig(role="flex", num_blocks=64),
                     engine(tag="flex-prefill")) as flex:
        inst = flex.instance
        assert inst is not None
        gate = threading.Event()  # holds the engine thread, as a long step would
        held = asyncio.ensure_future(inst.aengine.call(lambda e: gate.wait(20)))
        prompts = [asyncio.ensure_future(flex.prefill(f"p{i}", [i + 2, *PROMPT]))
                   for i in range(3)]
        await _until(lambda: _is(inst.num_in_flight == 3))
        switch = asyncio.ensure_future(_set_role(flex, D))
        await _until(lambda: _is(inst.draining))
        with pytest.raises(grpc.aio.AioRpcError) as err:  # a newcomer meanwhile: elsewhere
            await flex.prefill("late", PROMPT)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details() == "instance is draining: try another"
        gate.set()
        await held
        switched = await switch
        assert (switched.role, switched.num_handed_back) == (D, 3)
        for p in prompts:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await p
            assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAVAILABLE,
                                                               HANDED_BACK)
        stats = await flex.stats()
        assert (stats.role, stats.queue_depth, stats.kv_blocks_used) == (D, 0, 0)


async def test_set_role_refuses_what_a_flex_engine_cannot_run() -> None:
    async with serve(EngineServiceConfig(role="flex", num_blocks=64),
                     engine(tag="flex-bad")) as flex:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _set_role(flex, common_pb2.ROLE_UNSPECIFIED)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == ("role must be ROLE_PREFILL, ROLE_DECODE or "
                                       "ROLE_COLOCATED")


async def test_set_role_caps_a_steps_prompt_tokens_and_refuses_more_than_the_budget() -> None:
    async with serve(EngineServiceConfig(role="flex", num_blocks=64,
                                         max_num_batched_tokens=256),
                     engine(tag="flex-cap")) as flex:
        assert (await flex.stats()).max_prefill_tokens == 256
        await flex.admin.SetRole(engine_pb2.SetRoleRequest(role=C, max_prefill_tokens=16),
                                 timeout=60)
        assert (await flex.stats()).max_prefill_tokens == 16
        # served under the cap (alone, with no answer streaming, a step takes the whole budget)
        chunked = tokens_of(await flex.decode("c", PROMPT * 2, max_tokens=8, ignore_eos=True))
        await flex.admin.SetRole(engine_pb2.SetRoleRequest(role=C), timeout=60)  # role kept
        assert (await flex.stats()).max_prefill_tokens == 256
        whole = tokens_of(await flex.decode("w", PROMPT * 2, max_tokens=8, ignore_eos=True))
        assert len(whole) == 8 and chunked == whole
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await flex.admin.SetRole(engine_pb2.SetRoleRequest(role=P, max_prefill_tokens=257),
                                     timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == ("max_prefill_tokens: at most this engine's "
                                       "--max-num-batched-tokens (256), got 257")
        stats = await flex.stats()  # refused before anything changed
        assert (stats.role, stats.max_prefill_tokens, stats.draining) == (C, 256, False)


async def _stat(client: Client, name: str, value: int) -> bool:
    return getattr(await client.stats(), name) == value


async def _is(value: bool) -> bool:
    return value
