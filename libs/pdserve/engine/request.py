"""A request's state inside the engine, and what one step reports about it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from pdserve.engine.detokenizer import Detokenizer
from pdserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.logits_process import LogitsState


class RequestStatus(enum.Enum):
    WAITING = enum.auto()    # queued (new or preempted); holds no blocks
    RUNNING = enum.auto()    # scheduled every step until it finishes
    HELD = enum.auto()       # finished with hold (prefill_only): pages kept until release()
    FINISHED = enum.auto()   # done; blocks returned to the pool


class Logprob(NamedTuple):
    """The sampled token's logprob and the top-n (token id, logprob) pairs, best first."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    max_len: int                     # prompt + max_tokens, capped at the model's context
    eos_token_ids: frozenset[int]
    priority: int = 0
    cache_salt: str = ""
    prefill_only: bool = False       # finish after the first token (a decode engine goes on)
    hold: bool = False               # keep the pages once finished, until release()
    generator: torch.Generator | None = None
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)   # prompt + output
    num_computed_tokens: int = 0     # tokens whose KV is in the cache
    num_prefix_hit_tokens: int = 0   # of those, how many came from the prefix cache
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # full blocks of token_ids
    finish_reason: str | None = None
    detok: Detokenizer | None = None  # the output's text (None: the model has no tokenizer)
    logits_state: LogitsState | None = None  # grammar, bias, penalties (None: none asked)
    prompt_logprobs: list[Logprob] = field(default_factory=list)  # entry i: prompt token i + 1

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_tokens_to_compute(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """Some of the prompt is still to compute (a chunk, or a recompute after preemption)."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.HELD, RequestStatus.FINISHED)

    def sort_key(self) -> tuple[int, int]:
        """Lower priority number first, then arrival order (FIFO within a class)."""
        return (self.priority, self.arrival)


@dataclass
class RequestOutput:
    """What one step produced for one request.

    new_full_blocks: (hash, page id) of the full blocks whose KV this step completed, in order.
    A request finished with ``hold=True`` (prefill_only ones always) keeps its pages until
    ``Engine.release``; ``block_hashes``/``page_ids`` then list all its full blocks.
    text: the output text this step made safe to stream (the rest of it when finished);
    the pieces concatenate to the request's text. A finished prefill_only request's
    ``finish_reason`` is None when the request goes on (on a decode engine), else the reason
    its first token ended it.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[Logprob] | None = None
    new_full_blocks: list[tuple[bytes, int]] = field(default_factory=list)
    block_hashes: list[bytes] | None = None
    page_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    text: str = ""
    prompt_logprobs: list[Logprob] | None = None  # with the first token, when asked


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_held: int
    num_blocks_free: int
    num_blocks_used: int
    num_blocks_cached: int
    num_prefill_tokens: int      # cumulative tokens computed by prefill chunks
    num_prefix_hit_tokens: int   # cumulative prompt tokens served from the prefix cache
    num_decode_tokens: int       # cumulative tokens computed by decode steps
    num_preemptions: int
