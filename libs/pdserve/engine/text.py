"""Incremental text for streamed tokens, holding back what a stop string might still cut.

The engine decides where a stop string ends the text (``RequestOutput.stop_text``); streaming
must never have sent characters that the final text drops, so while stop strings are set the
last ``max(len(stop)) - 1`` characters wait for the next token.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.tokenizer import DetokenizeState, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer | None, context_ids: Sequence[int],
                 stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.state = DetokenizeState.from_prompt(context_ids)
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""      # everything decoded so far
        self.num_sent = 0   # characters of ``text`` already streamed

    def add(self, token_ids: Sequence[int]) -> str:
        """Decode new tokens; return the delta that is safe to stream now."""
        self._decode(token_ids)
        return self._send(max(self.num_sent, len(self.text) - self.holdback))

    def finish(self, token_ids: Sequence[int], stop_text: str | None) -> str:
        """The last tokens and the rest of the text. ``stop_text`` is the engine's output cut
        at a stop string (relative to the output tokens it saw, which start where this
        stream's context ends); it replaces the decoded text when it agrees with what was sent."""
        self._decode(token_ids)
        if self.tokenizer is not None:
            self.text += self.tokenizer.flush(self.state)
        if stop_text is not None and stop_text.startswith(self.text[: self.num_sent]):
            self.text = stop_text
        return self._send(len(self.text))

    def _decode(self, token_ids: Sequence[int]) -> None:
        if self.tokenizer is not None:
            for t in token_ids:
                self.text += self.tokenizer.decode_incremental(self.state, t)

    def _send(self, upto: int) -> str:
        delta = self.text[self.num_sent: upto]
        self.num_sent = max(self.num_sent, upto)
        return delta
