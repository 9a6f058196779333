"""Engine.LoadWeights over real gRPC, in-process servers on port 0 with the admin guard: the
swap and the version in Stats and usage, in-flight requests finishing on their version, the
refusals (credential, architecture, missing dir, policy) with their messages, and blocks of
another version refused by a reloaded decode."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from pdserve import auth
from pdserve.engine.engine import Engine
from pdserve.llm import LLM
from pdserve.proto.v1 import engine_pb2
from pdserve.sampling_params import SamplingParams
from pdserve.server import make_server
from services.engine.config import EngineServiceConfig
from services.engine.instance import EngineInstance
from services.engine.server import RULES, servicers
from tests.services.harness import Client, tokens_of

ADMIN, DATA = "admin-secret-for-tests", "data-secret-for-tests"
PROMPT = [(5 * i) % 300 + 2 for i in range(40)]  # two full blocks and a tail


def expected(model: str, prompt: list[int], max_tokens: int) -> list[int]:
    out = LLM(model, num_blocks=64).generate([prompt], SamplingParams(max_tokens=max_tokens,
                                                                      temperature=0))
    return out[0].token_ids


@contextlib.asynccontextmanager
async def guarded(role: str, monkeypatch: pytest.MonkeyPatch,
                  creds: tuple[auth.Credential, ...] = (auth.DATA, auth.ADMIN),
                  ) -> AsyncIterator[Client]:
    """A guarded engine service of ``role`` on tiny; the client presents ``creds``."""
    monkeypatch.setenv(auth.ADMIN.var, ADMIN)
    monkeypatch.setenv(auth.DATA.var, DATA)
    config = EngineServiceConfig(role=role, num_blocks=64)  # type: ignore[arg-type]
    inst = EngineInstance(config, Engine.from_model("tiny", config.engine_args()))
    svc = make_server("127.0.0.1", 0, servicers(inst), RULES)
    await svc.server.start()
    await inst.start(svc.port)
    held = {auth.ADMIN.name: ADMIN, auth.DATA.name: DATA}
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}",
                                        interceptors=auth.presenters(auth.metadata(creds, held)))
    try:
        yield Client(channel, inst)
    finally:
        await channel.close()
        await svc.server.stop(1.0)
        await inst.stop()


async def load(client: Client, model: str, **kw: object) -> engine_pb2.LoadWeightsResponse:
    return await client.admin.LoadWeights(engine_pb2.LoadWeightsRequest(model=model, **kw),
                                          timeout=60)


async def refused(call: object, code: grpc.StatusCode, message: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == code, info.value.details()
    assert message in (info.value.details() or ""), info.value.details()


async def test_load_weights_swaps_version_and_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    async with guarded("colocated", monkeypatch) as client:
        before = await client.decode("a", PROMPT, max_tokens=8)
        assert tokens_of(before) == expected("tiny", PROMPT, 8)
        assert before[-1].usage.model_version == "tiny@0"
        resp = await load(client, "tiny@2")
        assert (resp.previous_model_version, resp.model_version) == ("tiny@0", "tiny@2")
        assert resp.swap_ms < 100, f"the swap paused serving {resp.swap_ms:.1f} ms"
        stats = await client.stats()
        assert (stats.model, stats.model_version) == ("tiny@2", "tiny@2")
        assert stats.kv_fingerprint == resp.kv_fingerprint and "tiny@2" in resp.kv_fingerprint
        after = await client.decode("b", PROMPT, max_tokens=8)
        assert tokens_of(after) == expected("tiny@2", PROMPT, 8) != tokens_of(before)
        assert after[-1].usage.model_version == "tiny@2"
        assert after[-1].usage.cached_tokens == 0  # version 0's cached blocks are not reused


async def test_in_flight_requests_finish_on_their_version(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with guarded("colocated", monkeypatch) as client:
        stream = client.decode_stream("long", PROMPT, max_tokens=120)
        first = await stream.read()  # running now
        reload = asyncio.create_task(load(client, "tiny@3"))
        rest = [c async for c in stream]
        resp = await reload
        chunks = [first, *rest]
        assert tokens_of(chunks) == expected("tiny", PROMPT, 120)
        assert chunks[-1].usage.model_version == "tiny@0"
        assert resp.model_version == "tiny@3" and resp.wait_ms > 0
        assert not (await client.stats()).draining  # it was serving, so it serves again


async def test_load_weights_needs_the_admin_credential(monkeypatch: pytest.MonkeyPatch) -> None:
    for creds, code in (((), grpc.StatusCode.UNAUTHENTICATED),
                        ((auth.DATA,), grpc.StatusCode.PERMISSION_DENIED)):
        async with guarded("colocated", monkeypatch, creds) as client:
            await refused(load(client, "tiny@2"), code, "Engine/LoadWeights")
            assert client.instance is not None
            assert client.instance.engine.model_version == "tiny@0"


@pytest.mark.parametrize(("model", "policy", "code", "message"), [
    ("tiny-moe", 0, grpc.StatusCode.INVALID_ARGUMENT,
     "model: 'tiny-moe' has a different architecture than the one served (architecture"),
    ("/no/such/checkpoint", 0, grpc.StatusCode.INVALID_ARGUMENT,
     "model: cannot load '/no/such/checkpoint': model directory '/no/such/checkpoint' does "
     "not exist"),
    ("", 0, grpc.StatusCode.INVALID_ARGUMENT, "model must not be empty"),
    ("tiny@2", 9, grpc.StatusCode.INVALID_ARGUMENT, "policy: unknown ReloadPolicy 9"),
    ("tiny@2", engine_pb2.RELOAD_POLICY_REPREFILL, grpc.StatusCode.FAILED_PRECONDITION,
     "policy: RELOAD_POLICY_REPREFILL is for decode and colocated instances"),
])
async def test_bad_reloads_are_refused_with_their_message(
        monkeypatch: pytest.MonkeyPatch, model: str, policy: int, code: grpc.StatusCode,
        message: str) -> None:
    async with guarded("prefill", monkeypatch) as client:
        await refused(load(client, model, policy=policy), code, message)
        stats = await client.stats()
        assert (stats.model_version, stats.draining) == ("tiny@0", False)


async def test_a_reloaded_decode_refuses_blocks_of_the_old_version(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with guarded("prefill", monkeypatch) as prefill, \
            guarded("decode", monkeypatch) as decode:
        pre = await prefill.prefill("p", PROMPT, max_tokens=8)
        assert pre.model_version == "tiny@0" and len(pre.blocks) == 2
        await load(decode, "tiny@2")
        await refused(decode.decode("d", PROMPT, max_tokens=8, prefilled=pre),
                      grpc.StatusCode.INVALID_ARGUMENT,
                      "blocks[0].hash is not block 0 of this prompt on this model")


async def test_reprefill_goes_on_on_the_new_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    async with guarded("colocated", monkeypatch) as client:
        stream = client.decode_stream("long", PROMPT, max_tokens=120)
        first = await stream.read()
        resp = await load(client, "tiny@2", policy=engine_pb2.RELOAD_POLICY_REPREFILL)
        chunks = [first, *[c async for c in stream]]
        assert resp.num_reprefilled == 1 and resp.wait_ms < 50
        tokens = tokens_of(chunks)
        assert len(tokens) == 120 and chunks[-1].usage.model_version == "tiny@2"
        assert tokens != expected("tiny", PROMPT, 120)  # it did go on on the new weights

