"""Prefill and decode servicers in-process (port 0) around one shared tiny engine: colocated
decode equals the offline LLM, prefill's first token equals it too, the Engine admin rpcs, bad
requests, back-pressure, cancellation and Abort free every block."""

from __future__ import annotations

import asyncio
import functools

import grpc
import pytest

from pdserve.hashing import hash_blocks
from pdserve.llm import LLM
from pdserve.proto.v1 import common_pb2, engine_pb2
from pdserve.sampling_params import SamplingParams
from services.engine.config import EngineServiceConfig
from tests.services.harness import engine, greedy, serve, tokens_of

PROMPTS = {"short": list(range(2, 9)), "one_block": list(range(10, 26)),
           "many_blocks": [(7 * i) % 300 + 2 for i in range(70)]}


@functools.cache
def llm() -> LLM:
    return LLM("tiny", num_blocks=64)


def expected(prompt: list[int], max_tokens: int) -> list[int]:
    return llm().generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))[0] \
        .token_ids


def colocated(**kw: object) -> EngineServiceConfig:
    return EngineServiceConfig(role="colocated", num_blocks=64, **kw)  # type: ignore[arg-type]


async def assert_idle(client: object) -> None:
    """No request left and no KV page referenced (cached pages are free)."""
    stats = await client.stats()  # type: ignore[attr-defined]
    assert (stats.queue_depth, stats.num_running, stats.kv_blocks_used) == (0, 0, 0)
    client.instance.engine.check_integrity()  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(PROMPTS))
async def test_colocated_decode_equals_offline_llm(name: str) -> None:
    prompt = PROMPTS[name]
    async with serve(colocated(), engine()) as client:
        chunks = await client.decode(f"colo-{name}", prompt, max_tokens=12)
        assert tokens_of(chunks) == expected(prompt, 12)
        last = chunks[-1]
        assert last.finish_reason in (common_pb2.FINISH_REASON_LENGTH,
                                      common_pb2.FINISH_REASON_STOP)
        assert last.usage.prompt_tokens == len(prompt)
        assert last.usage.completion_tokens == len(tokens_of(chunks))
        assert "".join(c.text for c in chunks) == llm().tokenizer.decode(tokens_of(chunks))
        await assert_idle(client)


async def test_prefill_first_token_blocks_and_tail_without_kvd() -> None:
    prompt = PROMPTS["many_blocks"]
    async with serve(EngineServiceConfig(role="prefill", num_blocks=64), engine()) as client:
        resp = await client.prefill("p1", prompt, max_tokens=4, logprobs=3)
        assert resp.first_token_id == expected(prompt, 1)[0]
        assert len(resp.blocks) == len(prompt) // 16
        assert all(len(b.hash) == 32 for b in resp.blocks)
        assert list(resp.tail_token_ids) == prompt[len(prompt) // 16 * 16:]
        assert resp.first_logprobs.sampled.token_id == resp.first_token_id
        assert len(resp.first_logprobs.top) == 3
        assert resp.timings.compute_ms > 0
        await assert_idle(client)  # held pages were released
        stats = await client.stats()
        assert stats.role == common_pb2.ROLE_PREFILL and stats.prefill_tokens_per_s > 0


async def test_prefill_reports_max_tokens_one_as_length() -> None:
    async with serve(EngineServiceConfig(role="prefill", num_blocks=64), engine()) as client:
        resp = await client.prefill("p-one", PROMPTS["short"], max_tokens=1)
        assert resp.finish_reason == common_pb2.FINISH_REASON_LENGTH


BAD = [
    ("prompt_token_ids", {"prompt_token_ids": []}, "prompt_token_ids must not be empty"),
    ("too long", {"prompt_token_ids": [5] * 40}, "prompt_token_ids has 40 tokens"),
    ("vocab", {"prompt_token_ids": [5, 10**6]}, "prompt_token_ids must be < vocab_size"),
    ("top_p", {"sampling": common_pb2.SamplingParams(top_p=1.5)}, "sampling.top_p"),
    ("temperature", {"sampling": common_pb2.SamplingParams(temperature=-1)},
     "sampling.temperature"),
    ("logprobs", {"sampling": common_pb2.SamplingParams(logprobs=21)}, "sampling.logprobs"),
    ("top_k", {"sampling": common_pb2.SamplingParams(top_k=-5)}, "sampling.top_k"),
]


@pytest.mark.parametrize(("case", "fields", "needle"), BAD, ids=[b[0] for b in BAD])
async def test_bad_requests_name_the_field(case: str, fields: dict[str, object],
                                           needle: str) -> None:
    base: dict[str, object] = {"meta": common_pb2.RequestMeta(request_id=f"bad-{case}"),
                               "prompt_token_ids": [5, 6, 7], "sampling": greedy(4)}
    base.update(fields)
    async with serve(EngineServiceConfig(role="prefill", max_prompt_tokens=32), engine()) as p:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await p.prefill_stub.Prefill(engine_pb2.PrefillRequest(**base), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in (err.value.details() or "")
    async with serve(colocated(max_prompt_tokens=32), engine()) as d:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in d.decode_stub.Decode(engine_pb2.DecodeRequest(**base), timeout=10):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in (err.value.details() or "")
        await assert_idle(d)


async def test_bad_block_refs_name_the_field() -> None:
    prompt = PROMPTS["many_blocks"]
    async with serve(EngineServiceConfig(role="decode", num_blocks=64), engine()) as d:
        cases = [
            ([common_pb2.BlockRef(hash=b"x" * 5)], "blocks[0].hash must be 32 bytes, got 5"),
            ([common_pb2.BlockRef(hash=b"x" * 32)], "blocks[0].hash is not block 0"),
            ([common_pb2.BlockRef(hash=b"x" * 32)] * 5, "blocks has 5 entries"),
        ]
        for refs, needle in cases:
            req = engine_pb2.DecodeRequest(meta=common_pb2.RequestMeta(request_id="r"),
                                           prompt_token_ids=prompt, sampling=greedy(4),
                                           first_token_id=3, blocks=refs)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in d.decode_stub.Decode(req, timeout=10):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in (err.value.details() or "")
        # A decode instance does not prefill: the first token is required (of this instance:
        # a colocated one takes the same request, so the router may retry it there).
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await d.decode("no-first", prompt)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "first_token_id is required" in (err.value.details() or "")


async def test_wrong_role_is_failed_precondition() -> None:
    async with serve(colocated(), engine()) as d:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await d.prefill("x", [3, 4])
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED  # not served at all


async def test_cancelling_a_stream_frees_its_blocks() -> None:
    async with serve(colocated(), engine()) as client:
        call = client.decode_stream("cancel-me", PROMPTS["many_blocks"], max_tokens=400,
                                    ignore_eos=True)
        got = 0
        async for chunk in call:
            got += len(chunk.token_ids)
            if got >= 3:
                break
        call.cancel()
        for _ in range(100):  # the server sees the cancellation asynchronously
            if (await client.stats()).kv_blocks_used == 0:
                break
            await asyncio.sleep(0.02)
        await assert_idle(client)


async def test_abort_ends_a_stream_with_abort_and_frees_blocks() -> None:
    async with serve(colocated(), engine()) as client:
        call = client.decode_stream("abort-me", PROMPTS["one_block"], max_tokens=400,
                                    ignore_eos=True)
        chunks = []
        async for chunk in call:
            chunks.append(chunk)
            if len(chunks) == 2:
                found = await client.admin.Abort(engine_pb2.AbortRequest(request_id="abort-me"))
                assert found.found
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        missing = await client.admin.Abort(engine_pb2.AbortRequest(request_id="nope"))
        assert not missing.found
        await assert_idle(client)


async def test_back_pressure_rejects_beyond_max_queued() -> None:
    async with serve(colocated(max_num_seqs=1, max_queued=1), engine()) as client:
        calls = [client.decode_stream(f"bp-{i}", PROMPTS["short"], max_tokens=60,
                                      ignore_eos=True) for i in range(3)]
        results = await asyncio.gather(*[_collect(c) for c in calls], return_exceptions=True)
        codes = sorted(r.code().name if isinstance(r, grpc.aio.AioRpcError) else "ok"
                       for r in results)
        assert codes == ["RESOURCE_EXHAUSTED", "ok", "ok"]
        await assert_idle(client)


async def _collect(call: object) -> list[engine_pb2.DecodeChunk]:
    return [c async for c in call]  # type: ignore[attr-defined]


async def test_drain_rejects_new_work_after_in_flight_finishes() -> None:
    async with serve(colocated(), engine()) as client:
        running = asyncio.ensure_future(_collect(client.decode_stream(
            "drain-1", PROMPTS["short"], max_tokens=30, ignore_eos=True)))
        await asyncio.sleep(0.05)
        resp = await client.admin.Drain(engine_pb2.DrainRequest(wait=True), timeout=30)
        assert resp.num_in_flight == 0
        assert len(tokens_of(await running)) == 30
        assert (await client.stats()).draining
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.decode("drain-2", PROMPTS["short"])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_set_role_switches_a_flex_instance_only() -> None:
    async with serve(EngineServiceConfig(role="flex", num_blocks=64), engine()) as flex:
        assert (await flex.stats()).is_flex
        resp = await flex.prefill("f1", PROMPTS["short"])
        await flex.admin.SetRole(engine_pb2.SetRoleRequest(role=common_pb2.ROLE_DECODE))
        assert (await flex.stats()).role == common_pb2.ROLE_DECODE
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await flex.prefill("f2", PROMPTS["short"])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert resp.first_token_id == expected(PROMPTS["short"], 1)[0]
    async with serve(colocated(), engine()) as fixed:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fixed.admin.SetRole(engine_pb2.SetRoleRequest(role=common_pb2.ROLE_PREFILL))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "only a flex instance" in (err.value.details() or "")


async def test_decode_without_room_for_the_blocks_is_resource_exhausted() -> None:
    prompt = PROMPTS["many_blocks"]  # 4 full blocks: needs 5 free pages to start
    small = engine("tiny", 4)
    fingerprint = small.fingerprint
    refs = [common_pb2.BlockRef(hash=h) for h in hash_blocks(prompt, 16, fingerprint)]
    async with serve(EngineServiceConfig(role="decode", num_blocks=4), small) as d:
        req = engine_pb2.DecodeRequest(meta=common_pb2.RequestMeta(request_id="full"),
                                       prompt_token_ids=prompt, sampling=greedy(4),
                                       first_token_id=3, blocks=refs)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in d.decode_stub.Decode(req, timeout=10):
                pass
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "needs 5 blocks to start, more than the 4 the cache has" in (
            err.value.details() or "")
