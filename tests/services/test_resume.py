"""A decode resuming an answer after a failover (``DecodeRequest.prior_output``), on a real
in-process engine: given the prompt and the answer so far, it streams exactly the rest of the
offline answer, tokens and text, with stop strings and penalties seeing the earlier output; a
bad ``prior_output`` is refused with a message naming it."""

from __future__ import annotations

import functools

import grpc
import pytest

from pdserve.engine.detokenizer import Detokenizer
from pdserve.llm import LLM
from pdserve.proto.v1 import common_pb2, engine_pb2
from pdserve.sampling_params import SamplingParams
from services.engine.config import EngineServiceConfig
from tests.services.harness import engine, greedy, serve, tokens_of

PROMPT = [(7 * i) % 300 + 2 for i in range(40)]
MAX_TOKENS = 24


@functools.cache
def llm() -> LLM:
    return LLM("tiny", num_blocks=64)


def _resume_request(rid: str, ids: list[int], k: int, **sampling: object,
                    ) -> engine_pb2.DecodeRequest:
    """The request a failover makes after ``k + 1`` tokens of ``ids`` were sent."""
    return engine_pb2.DecodeRequest(
        meta=common_pb2.RequestMeta(request_id=rid), prompt_token_ids=[*PROMPT, *ids[:k]],
        sampling=greedy(MAX_TOKENS - k, **sampling), first_token_id=ids[k], prior_output=k)


def _sent_text(ids: list[int], stop: tuple[str, ...] = ()) -> str:
    detok = Detokenizer(llm().tokenizer, stop)
    for token in ids:
        detok.append(token)
    return detok.take()


def _straddling_stop(ids: list[int], text: str) -> tuple[int, str]:
    """A failover point ``k`` and a stop string whose first occurrence in ``text`` starts in
    the text sent before it (tokens ``ids[:k + 1]``) and ends after it."""
    for k in range(1, len(ids) - 2):
        cut = len(_sent_text(ids[:k + 1]))
        for width in range(4, 12):
            stop = text[cut - 2: cut - 2 + width]
            if cut >= 2 and len(stop) == width and text.find(stop) == cut - 2:
                return k, stop
    raise AssertionError(f"no stop string straddles a failover point in {text!r}")


@pytest.mark.parametrize("k", [1, 5, 11])
async def test_a_resumed_answer_is_the_rest_of_the_offline_one(k: int) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                            frequency_penalty=0.5)
    want = llm().generate([PROMPT], params)[0]
    ids = list(want.token_ids)
    cfg = EngineServiceConfig(role="colocated", num_blocks=64)
    async with serve(cfg, engine()) as client:
        req = _resume_request(f"resume-{k}", ids, k, ignore_eos=True, frequency_penalty=0.5)
        chunks = [c async for c in client.decode_stub.Decode(req, timeout=30)]
    assert tokens_of(chunks) == ids[k + 1:]  # penalties counted the earlier output
    assert _sent_text(ids[:k + 1]) + "".join(c.text for c in chunks) == want.text


async def test_a_stop_string_begun_before_the_failover_is_found_after_it() -> None:
    base = llm().generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                   ignore_eos=True))[0]
    ids, text = list(base.token_ids), base.text
    k, stop = _straddling_stop(ids, text)
    want = llm().generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                   ignore_eos=True, stop=[stop]))[0]
    cfg = EngineServiceConfig(role="colocated", num_blocks=64)
    async with serve(cfg, engine()) as client:
        req = _resume_request("resume-stop", ids, k, ignore_eos=True, stop=[stop])
        chunks = [c async for c in client.decode_stub.Decode(req, timeout=30)]
    assert _sent_text(ids[:k + 1], (stop,)) + "".join(c.text for c in chunks) == want.text
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_STOP


@pytest.mark.parametrize(("change", "needle"), [
    ({"first_token_id": None}, "prior_output: given without first_token_id"),
    ({"prior_output": len(PROMPT)}, f"prior_output must be < the prompt's {len(PROMPT)} tokens"),
])
async def test_a_bad_prior_output_names_the_field(change: dict[str, object], needle: str) -> None:
    req = engine_pb2.DecodeRequest(meta=common_pb2.RequestMeta(request_id="bad"),
                                   prompt_token_ids=PROMPT, sampling=greedy(4),
                                   first_token_id=3, prior_output=2)
    for name, value in change.items():
        if value is None:
            req.ClearField(name)
        else:
            setattr(req, name, value)
    cfg = EngineServiceConfig(role="colocated", num_blocks=64)
    async with serve(cfg, engine()) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in client.decode_stub.Decode(req, timeout=10):
                pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (err.value.details() or "")
