"""Request checks at the edge of the engine services: every error is ``BadRequest`` whose
message starts with the offending field's proto path (``prompt_token_ids``, ``blocks[3].hash``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.convert import sampling_from_proto
from pdserve.errors import BadRequest
from pdserve.hashing import HASH_LEN, hash_blocks
from pdserve.proto.v1 import common_pb2
from pdserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineLimits:
    """What this instance accepts: prompt length, vocabulary, default max_tokens."""

    max_prompt_tokens: int
    vocab_size: int
    default_max_tokens: int


def prompt_and_params(prompt_token_ids: Sequence[int], sampling: common_pb2.SamplingParams,
                      limits: EngineLimits) -> tuple[list[int], SamplingParams]:
    """What every Prefill and Decode request carries, checked against this instance."""
    prompt = list(prompt_token_ids)
    check_prompt(prompt, limits)
    return prompt, sampling_from_proto(sampling, limits.default_max_tokens, limits.vocab_size)


def check_prompt(ids: Sequence[int], limits: EngineLimits,
                 field: str = "prompt_token_ids") -> None:
    if not ids:
        raise BadRequest(f"{field} must not be empty")
    if len(ids) > limits.max_prompt_tokens:
        raise BadRequest(f"{field} has {len(ids)} tokens; this instance accepts at most "
                         f"{limits.max_prompt_tokens} (--max-prompt-tokens)")
    bad = [t for t in ids if t >= limits.vocab_size]
    if bad:
        raise BadRequest(f"{field} must be < vocab_size {limits.vocab_size}, got {bad[:5]}")


def check_block_refs(refs: Sequence[common_pb2.BlockRef], prompt: Sequence[int],
                     block_size: int, fingerprint: str,
                     cache_salt: str) -> list[common_pb2.BlockRef]:
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
    return list(refs)
