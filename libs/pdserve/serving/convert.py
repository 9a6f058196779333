"""Proto <-> dataclass at the edge of the engine services, and request validation.

Every check raises ``BadRequest`` whose message starts with the offending field's proto path
(``sampling.top_p``, ``blocks[3].hash``), which the servicers return as INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.request import Logprob
from pdserve.hashing import HASH_LEN, hash_blocks
from pdserve.proto.v1 import common_pb2
from pdserve.sampling_params import SamplingParams

MAX_LOGPROBS = 20
FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
ROLES = {
    "prefill": common_pb2.ROLE_PREFILL,
    "decode": common_pb2.ROLE_DECODE,
    "colocated": common_pb2.ROLE_COLOCATED,
}
ROLE_NAMES = {v: k for k, v in ROLES.items()}


class BadRequest(ValueError):
    """A client error; the message names the field."""


@dataclass(frozen=True)
class Limits:
    """What this instance accepts: prompt length, vocabulary, default max_tokens."""

    max_prompt_tokens: int
    vocab_size: int
    default_max_tokens: int


@dataclass(frozen=True)
class BlockRefIn:
    """A received block reference, checked: 32-byte hash and its checksum."""

    hash: bytes
    checksum: int
    node_id: str = ""


@dataclass(frozen=True)
class Exported:
    """A block held by the kvd: its hash and the xxh3 checksum of its bytes."""

    hash: bytes
    checksum: int


def sampling_from_proto(sp: common_pb2.SamplingParams, limits: Limits) -> SamplingParams:
    logprobs = sp.logprobs if sp.HasField("logprobs") else None
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise BadRequest(f"sampling.logprobs must be in 0..{MAX_LOGPROBS}, got {logprobs}")
    bad_stop = [t for t in sp.stop_token_ids if t >= limits.vocab_size]
    if bad_stop:
        raise BadRequest(f"sampling.stop_token_ids must be < vocab_size {limits.vocab_size}, "
                         f"got {bad_stop[:5]}")
    top_k = sp.top_k if sp.HasField("top_k") else -1
    try:
        return SamplingParams(
            max_tokens=sp.max_tokens or limits.default_max_tokens,
            temperature=sp.temperature if sp.HasField("temperature") else 1.0,
            top_p=sp.top_p if sp.HasField("top_p") else 1.0,
            top_k=-1 if top_k == 0 else top_k,
            min_p=sp.min_p if sp.HasField("min_p") else 0.0,
            seed=sp.seed if sp.HasField("seed") else None,
            stop=tuple(sp.stop), stop_token_ids=tuple(sp.stop_token_ids),
            ignore_eos=sp.ignore_eos, logprobs=logprobs)
    except ValueError as exc:
        raise BadRequest(f"sampling.{exc}") from exc


def check_prompt(ids: Sequence[int], limits: Limits, field: str = "prompt_token_ids") -> None:
    if not ids:
        raise BadRequest(f"{field} must not be empty")
    if len(ids) > limits.max_prompt_tokens:
        raise BadRequest(f"{field} has {len(ids)} tokens; this instance accepts at most "
                         f"{limits.max_prompt_tokens} (--max-prompt-tokens)")
    bad = [t for t in ids if t >= limits.vocab_size]
    if bad:
        raise BadRequest(f"{field} must be < vocab_size {limits.vocab_size}, got {bad[:5]}")


def check_request_id(request_id: str) -> None:
    if not request_id:
        raise BadRequest("meta.request_id must not be empty")
    if len(request_id) > 256:
        raise BadRequest(f"meta.request_id is {len(request_id)} characters; at most 256")


def block_refs_from_proto(refs: Sequence[common_pb2.BlockRef], prompt: Sequence[int],
                          block_size: int, fingerprint: str, cache_salt: str) -> list[BlockRefIn]:
    """Check that ``refs`` name the leading full blocks of ``prompt`` on this model (a wrong
    prompt, model or salt would otherwise hand the sequence someone else's KV)."""
    num_full = len(prompt) // block_size
    if len(refs) > num_full:
        raise BadRequest(f"blocks has {len(refs)} entries but the prompt has only {num_full} "
                         f"full blocks of {block_size} tokens")
    for i, ref in enumerate(refs):
        if len(ref.hash) != HASH_LEN:
            raise BadRequest(f"blocks[{i}].hash must be {HASH_LEN} bytes, got {len(ref.hash)}")
    expected = hash_blocks(prompt[: len(refs) * block_size], block_size, fingerprint, cache_salt)
    for i, (ref, want) in enumerate(zip(refs, expected, strict=True)):
        if ref.hash != want:
            raise BadRequest(f"blocks[{i}].hash is not block {i} of this prompt on this model "
                             "(wrong prompt_token_ids, model or meta.cache_salt)")
    return [BlockRefIn(r.hash, r.checksum, r.node_id) for r in refs]


def logprobs_to_proto(token_id: int, lp: Logprob) -> common_pb2.PositionLogprobs:
    return common_pb2.PositionLogprobs(
        sampled=common_pb2.TokenLogprob(token_id=token_id, logprob=lp.logprob),
        top=[common_pb2.TokenLogprob(token_id=t, logprob=v) for t, v in lp.top])


def finish_to_proto(reason: str | None) -> common_pb2.FinishReason:
    return FINISH_REASONS.get(reason or "", common_pb2.FINISH_REASON_UNSPECIFIED)
