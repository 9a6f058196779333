"""Issue 21 end to end: ``pdserve.client`` against ``pdserve up`` (real processes: Redis, two
kvds, a prefill and a decode engine, the router, the gateway), next to the official ``openai``
client on the same stack's gateway."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import grpc
import openai
import pytest

from pdserve.client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    InvalidArgument,
    Model,
    NotFound,
)
from pdserve.proto.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.e2e.stack import UpStack, wait_until

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6  # several full blocks
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say something about blocks and caches."}]
MAX_TOKENS = 12
LONG = 1500  # tokens: a request that is still running when the test stops it


@pytest.fixture(scope="module")
def stack() -> Iterator[UpStack]:
    up = UpStack(["--model", "tiny", "--prefill", "1", "--decode", "1", "--no-restart"]).start()
    # The clients below take the router's credential from the environment, as a user's would.
    os.environ["PDSERVE_CLIENT_SECRET_FILE"] = f"{up.secrets_dir}/PDSERVE_CLIENT_SECRET"
    yield up
    os.environ.pop("PDSERVE_CLIENT_SECRET_FILE", None)
    up.stop()


@pytest.fixture(scope="module")
def client(stack: UpStack) -> Iterator[Client]:
    with Client(stack.router, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def gateway(stack: UpStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(stack: UpStack) -> Iterator[engine_pb2_grpc.EngineStub]:
    with stack.channel(stack.addresses["decode-0"]) as channel:
        yield engine_pb2_grpc.EngineStub(channel)


def _stats(engine: engine_pb2_grpc.EngineStub) -> engine_pb2.EngineStats:
    stats: engine_pb2.EngineStats = engine.Stats(engine_pb2.EngineStatsRequest(), timeout=5)
    return stats


def _idle(engine: engine_pb2_grpc.EngineStub, blocks_used: int) -> engine_pb2.EngineStats:
    """Wait until the decode engine runs nothing and holds no more blocks than before."""
    return wait_until(lambda: (s := _stats(engine)).num_running == 0 and s.queue_depth == 0
                      and s.kv_blocks_used <= blocks_used and s, timeout=10)


def _stopped_early(engine: engine_pb2_grpc.EngineStub, before: engine_pb2.EngineStats) -> None:
    """The request left the engine long before its LONG tokens, and nothing decodes since."""
    after = _idle(engine, before.kv_blocks_used)
    time.sleep(0.5)
    assert _stats(engine).decode_tokens == after.decode_tokens
    assert after.decode_tokens - before.decode_tokens < LONG // 2


def test_streams_the_same_text_as_the_openai_gateway(client: Client,
                                                     gateway: openai.OpenAI) -> None:
    stream = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(stream)
    rest = gateway.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                      temperature=0, stream=True,
                                      stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in rest:
        pieces.extend(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    assert "".join(c.text for c in chunks) == "".join(pieces) != ""
    assert len(chunks) > 1 and all(c.finish_reason is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason == "length" and last.usage is not None and usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        usage.prompt_tokens, usage.completion_tokens) == (usage.prompt_tokens, MAX_TOKENS)
    assert sum(len(c.token_ids) for c in chunks) == MAX_TOKENS
    assert stream.completion.placement is not None
    assert stream.completion.placement.prompt_tokens == usage.prompt_tokens


def test_logprobs_match_the_gateways(client: Client, gateway: openai.OpenAI) -> None:
    done = client.generate(PROMPT, max_tokens=4, temperature=0, logprobs=2).collect()
    rest = gateway.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                      logprobs=2)
    expected = rest.choices[0].logprobs
    assert expected is not None and expected.token_logprobs is not None
    assert [p.sampled.token_id for p in done.logprobs] == done.token_ids
    assert all(len(p.top) == 2 for p in done.logprobs)
    assert [p.sampled.token for p in done.logprobs] == expected.tokens
    assert [p.sampled.logprob for p in done.logprobs] == pytest.approx(
        expected.token_logprobs, abs=1e-4)


def test_chat_and_asyncio_client_match_the_gateway(stack: UpStack, client: Client,
                                                   gateway: openai.OpenAI) -> None:
    rest = gateway.chat.completions.create(model="tiny", messages=CHAT,  # type: ignore[arg-type]
                                           max_tokens=MAX_TOKENS, temperature=0)
    expected = rest.choices[0].message.content
    done = client.chat(CHAT, max_tokens=MAX_TOKENS, temperature=0).collect()
    assert done.text == expected and done.usage is not None
    assert done.usage.completion_tokens == len(done.token_ids) == MAX_TOKENS

    async def run() -> tuple[str, str]:
        async with AsyncClient(stack.router, timeout=60) as aclient:
            chat = await aclient.chat(CHAT, max_tokens=MAX_TOKENS, temperature=0).collect()
            text = "".join([c.text async for c in aclient.generate(
                PROMPT, max_tokens=MAX_TOKENS, temperature=0)])
            return chat.text, text

    chat_text, text = asyncio.run(run())
    assert chat_text == expected
    assert text == client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0).collect().text


def test_closing_the_stream_frees_the_engine_slot(client: Client,
                                                  engine: engine_pb2_grpc.EngineStub) -> None:
    before = _idle(engine, 10**9)
    stream = client.generate(PROMPT, max_tokens=LONG, ignore_eos=True, temperature=0)
    for _, chunk in zip(range(3), stream, strict=False):
        assert chunk.finish_reason is None
    running = _stats(engine)
    assert running.num_running == 1 and running.kv_blocks_used > before.kv_blocks_used
    stream.close()
    _stopped_early(engine, before)


def test_leaving_an_async_stream_early_frees_the_slot(stack: UpStack,
                                                      engine: engine_pb2_grpc.EngineStub) -> None:
    before = _idle(engine, 10**9)

    async def run() -> None:
        async with AsyncClient(stack.router) as aclient:
            async with aclient.generate(PROMPT, max_tokens=LONG, ignore_eos=True) as stream:
                num_chunks = 0
                async for _ in stream:
                    num_chunks += 1
                    if num_chunks == 3:  # the first comes from prefill, the rest from decode
                        assert _stats(engine).num_running == 1
                        break
            # The client (and its channel) stays open: the stream's own exit cancelled it.
            await asyncio.to_thread(_stopped_early, engine, before)

    asyncio.run(run())


def test_deadline_is_deadline_exceeded_and_frees_the_slot(
        client: Client, engine: engine_pb2_grpc.EngineStub) -> None:
    before = _idle(engine, 10**9)
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded) as err:
        client.generate(PROMPT, max_tokens=LONG, ignore_eos=True, timeout=1.0).collect()
    assert time.monotonic() - start < 5
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert isinstance(err.value, grpc.RpcError) and "Deadline Exceeded" in err.value.details()
    _stopped_early(engine, before)


def test_invalid_field_is_a_bad_request_violation_naming_it(client: Client,
                                                            gateway: openai.OpenAI) -> None:
    with pytest.raises(InvalidArgument) as err:
        client.generate("hi", max_tokens=4, top_p=1.5).collect()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message == "sampling.top_p must be in (0, 1], got 1.5"
    [violation] = err.value.field_violations
    assert (violation.field, violation.description) == ("sampling.top_p",
                                                       "must be in (0, 1], got 1.5")
    with pytest.raises(InvalidArgument) as err:
        client.chat([{"role": "robot", "content": "hi"}], max_tokens=4).collect()
    assert [v.field for v in err.value.field_violations] == ["chat.messages[0].role"]
    assert err.value.message == ("chat.messages[0].role: 'robot' is not one of system, user, "
                                 "assistant, tool")
    # The gateway reads the same violation: OpenAI's param is the field in its own name.
    with pytest.raises(openai.BadRequestError) as bad:
        gateway.completions.create(model="tiny", prompt="hi", max_tokens=4, top_p=1.0,
                                   extra_body={"top_k": -5})
    assert bad.value.param == "top_k"


def test_unknown_model_is_not_found(client: Client) -> None:
    with pytest.raises(NotFound) as err:
        client.generate("hi", model="no-such-model", max_tokens=4).collect()
    assert err.value.message == "model: 'no-such-model' is not served here (served: 'tiny')"


def test_models_and_cluster_state(client: Client) -> None:
    assert client.models() == [Model("tiny", client.models()[0].max_context, 16, "tiny")]
    state = client.cluster_state()
    roles = sorted(i.role for i in state.instances)
    assert roles == [common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE]
    assert all(i.healthy for i in state.instances) and state.policy == "cache_aware"
    assert state.num_requests > 0
