"""Per-request sampling parameters (validated once, at construction)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdserve.errors import BadRequest
from pdserve.structured import StructuredOutput

MAX_LOGPROBS = 20  # most top alternatives a request may ask for, everywhere
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on one token's bias
MAX_PENALTY = 2.0  # OpenAI's bound on presence and frequency penalties


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token and when to stop.

    temperature 0 means greedy. top_k -1 (or 0) disables top-k; top_p 1 and min_p 0 disable
    theirs. ``seed`` gives the request its own generator, so its samples do not depend on what
    else is in the batch. ``logprobs`` = n asks for the sampled token's logprob plus the top n.

    Logits processing, before temperature and the filters (``pdserve.engine.logits_process``):
    the ``structured`` grammar's mask, ``logit_bias`` (token id -> bias, stored as sorted
    pairs), then ``repetition_penalty`` (prompt and output tokens), ``frequency_penalty`` and
    ``presence_penalty`` (output tokens), with vLLM's and OpenAI's definitions.
    ``prompt_logprobs`` = n asks for every prompt token's logprob (after the first) plus the
    top n.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] = ()
    structured: StructuredOutput | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience but stored as tuples so the object stays hashable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        self._check_processing()
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise BadRequest(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise BadRequest(f"max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("temperature", "top_p", "min_p"):
            if not math.isfinite(getattr(self, name)):
                raise BadRequest(f"{name} must be a finite number, got {getattr(self, name)}")
        if not self.temperature >= 0.0:
            raise BadRequest(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise BadRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise BadRequest(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise BadRequest(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise BadRequest(f"stop must be non-empty strings, got {self.stop!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise BadRequest(f"stop_token_ids must be >= 0, got {self.stop_token_ids!r}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"prompt_logprobs must be in 0..{MAX_LOGPROBS}, "
                             f"got {self.prompt_logprobs}")

    def _check_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise BadRequest(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                                 f"got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise BadRequest(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for token, bias in self.logit_bias:  # type: ignore[misc]
            if token < 0:
                raise BadRequest(f"logit_bias: token ids must be >= 0, got {token}")
            if not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
                raise BadRequest(f"logit_bias[{token}] must be in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {bias}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise BadRequest("structured must be a StructuredOutput, got "
                                 f"{type(self.structured).__name__}")
            self.structured.grammar()  # BadRequest naming structured.<kind> when invalid

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
