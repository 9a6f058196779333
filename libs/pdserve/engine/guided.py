"""Grammar-constrained decoding for one engine: llguidance matchers and their token masks.

    GuideFactory(tokenizer, vocab_size)   one per engine; builds llguidance's tokenizer view
                                          (the vocabulary's bytes) once, on first use
      .guide(structured, replay) -> Guide a matcher for one request, advanced past ``replay``
    Guide.fill(row)                       the allowed tokens of the next step, 1 bit each
    Guide.accept(token)                   advance after a sampled token
    Guide.is_done                         the grammar is complete (or broken): stop here

Hand-off: the matcher's state after a token depends only on the tokens, so a decode engine
continuing a prefilled request replays the prefill's first token (``replay``) and is where the
prefill's matcher was, as the detokenizer does (``pdserve.engine.detokenizer``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from pdserve.errors import BadRequest
from pdserve.structured import StructuredOutput
from pdserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask."""
    return (vocab_size + 31) // 32


class Guide:
    """One request's grammar state (an ``llguidance.LLMatcher``)."""

    def __init__(self, matcher: object) -> None:
        self._m = matcher

    def fill(self, row: torch.Tensor) -> None:
        """Write the next step's allowed tokens into ``row`` (contiguous int32, CPU)."""
        self._m.unsafe_compute_mask_ptr(  # type: ignore[attr-defined]
            row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token: int) -> None:
        if not self._m.consume_token(token):  # type: ignore[attr-defined]
            log.warning("grammar refused a token", extra={"fields": {
                "token": token, "error": self.error}})

    @property
    def is_done(self) -> bool:
        """Nothing but EOS can follow (the grammar is complete), or the matcher failed."""
        return bool(self._m.is_stopped())  # type: ignore[attr-defined]

    @property
    def error(self) -> str:
        return str(self._m.get_error())  # type: ignore[attr-defined]


class GuideFactory:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._lltok: Any = None

    def guide(self, structured: StructuredOutput, replay: Sequence[int] = ()) -> Guide:
        import llguidance

        grammar = structured.grammar()
        matcher = llguidance.LLMatcher(self._tokenizer_view(), grammar, log_level=0)
        if matcher.is_error():
            raise BadRequest(f"structured.{structured.kind}: {matcher.get_error()}")
        guide = Guide(matcher)
        for token in replay:
            guide.accept(token)
        return guide

    def _tokenizer_view(self) -> Any:
        if self._lltok is None:
            import llguidance

            if self._tokenizer is None:
                raise BadRequest("structured: this model has no tokenizer to constrain with")
            self._lltok = llguidance.LLTokenizer(
                self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                eos_token=self._eos or None)
        return self._lltok


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf, in place: ``bitmask`` [len(rows), words]
    int32 (bit j of word w allows token 32 w + j) for the batch rows ``rows``."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    bits = (bitmask.to(logits.device, non_blocking=True).unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bits.shape[0], -1)[:, :vocab].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
