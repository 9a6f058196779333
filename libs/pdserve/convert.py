"""Proto <-> dataclass conversions the router and the engines share.

``sampling_from_proto`` is the one reading of ``common.SamplingParams``: the router checks a
request with it (so a request it admits is one every engine accepts) and the engines build
their ``SamplingParams`` with it. Errors are ``BadRequest`` naming the proto field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.errors import BadRequest
from pdserve.proto.v1 import common_pb2
from pdserve.sampling_params import SamplingParams
from pdserve.structured import StructuredOutput

if TYPE_CHECKING:  # the router imports this module and must not pay for torch
    from pdserve.engine.request import Logprob
    from pdserve.tokenizer import Tokenizer

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


def sampling_from_proto(sp: common_pb2.SamplingParams, default_max_tokens: int,
                        vocab_size: int | None = None) -> SamplingParams:
    """``max_tokens`` 0 takes ``default_max_tokens``; unset optional fields take the
    engine's defaults; ``top_k`` 0 means off, as -1. With ``vocab_size``, stop token ids
    are checked against it."""
    if vocab_size is not None:
        bad_stop = [t for t in sp.stop_token_ids if t >= vocab_size]
        if bad_stop:
            raise BadRequest(f"sampling.stop_token_ids must be < vocab_size {vocab_size}, "
                             f"got {bad_stop[:5]}")
        bad_bias = sorted(t for t in sp.logit_bias if t >= vocab_size)
        if bad_bias:
            raise BadRequest(f"sampling.logit_bias: token ids must be < vocab_size "
                             f"{vocab_size}, got {bad_bias[:5]}")
    top_k = sp.top_k if sp.HasField("top_k") else -1
    try:
        return SamplingParams(
            max_tokens=sp.max_tokens or default_max_tokens,
            temperature=sp.temperature if sp.HasField("temperature") else 1.0,
            top_p=sp.top_p if sp.HasField("top_p") else 1.0,
            top_k=-1 if top_k == 0 else top_k,
            min_p=sp.min_p if sp.HasField("min_p") else 0.0,
            seed=sp.seed if sp.HasField("seed") else None,
            stop=tuple(sp.stop), stop_token_ids=tuple(sp.stop_token_ids),
            ignore_eos=sp.ignore_eos,
            logprobs=sp.logprobs if sp.HasField("logprobs") else None,
            presence_penalty=(sp.presence_penalty if sp.HasField("presence_penalty")
                              else 0.0),
            frequency_penalty=(sp.frequency_penalty if sp.HasField("frequency_penalty")
                               else 0.0),
            repetition_penalty=(sp.repetition_penalty if sp.HasField("repetition_penalty")
                                else 1.0),
            logit_bias=dict(sp.logit_bias),
            structured=structured_from_proto(sp.structured) if sp.HasField("structured")
            else None,
            prompt_logprobs=sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None)
    except BadRequest as exc:
        raise BadRequest(f"sampling.{exc.message}") from exc


def structured_from_proto(msg: common_pb2.StructuredOutput) -> StructuredOutput:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise BadRequest("structured: set one of json_schema, json_object, regex, choice, "
                         "grammar")
    if kind == "json_object" and not msg.json_object:
        raise BadRequest("structured.json_object: must be true when set")
    value = tuple(msg.choice.choices) if kind == "choice" else getattr(msg, kind)
    return StructuredOutput(kind, "" if kind == "json_object" else value)


def structured_to_proto(so: StructuredOutput) -> common_pb2.StructuredOutput:
    msg = common_pb2.StructuredOutput()
    if so.kind == "choice":
        msg.choice.choices.extend(so.value)
    elif so.kind == "json_object":
        msg.json_object = True
    else:
        setattr(msg, so.kind, so.value)
    return msg


def logprobs_to_proto(token_id: int, lp: Logprob,
                      tokenizer: Tokenizer | None) -> common_pb2.PositionLogprobs:
    """The sampled token and its alternatives, each with its own text and bytes."""

    def entry(tid: int, logprob: float) -> common_pb2.TokenLogprob:
        if tokenizer is None:
            return common_pb2.TokenLogprob(token_id=tid, logprob=logprob)
        raw = tokenizer.token_bytes(tid)
        return common_pb2.TokenLogprob(token_id=tid, logprob=logprob, token_bytes=raw,
                                       token=raw.decode("utf-8", errors="replace"))

    return common_pb2.PositionLogprobs(sampled=entry(token_id, lp.logprob),
                                       top=[entry(t, v) for t, v in lp.top])


def prompt_logprobs_to_proto(prompt: list[int], entries: list[Logprob],
                             tokenizer: Tokenizer | None) -> list[common_pb2.PositionLogprobs]:
    """Entry i scores prompt token i + 1 (the first prompt token has none)."""
    return [logprobs_to_proto(prompt[i + 1], lp, tokenizer) for i, lp in enumerate(entries)]


def finish_to_proto(reason: str | None) -> common_pb2.FinishReason:
    return FINISH_REASONS.get(reason or "", common_pb2.FINISH_REASON_UNSPECIFIED)
