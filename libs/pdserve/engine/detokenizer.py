"""One request's output text, made where its tokens are appended (the engine's step).

    append(token)   tokenizers' ``DecodeStream`` turns the token into text (nothing while a
                    UTF-8 sequence is still open; bytes ``_SETTLED`` tokens back that still
                    form no character never will, and are released as ``decode`` renders
                    them); stop strings are searched in the held-back text plus the new text
                    only
    take() -> str   text safe to stream now: never what a stop string could still cut
    finish() -> str the rest: bytes still pending (rendered as ``decode`` renders them) and the
                    held-back text

The streamed pieces concatenate to ``tokenizer.decode(output ids)``, cut at the first stop
string (kept with ``include_stop_str_in_output``). Each token costs its own text plus the
longest stop string, so a request's text costs time linear in its length.

Held back: the longest end of the text that is the start of some stop string, e.g. with stop
``"the end"`` a text ending in ``"... the e"`` keeps ``"the e"`` until the next token decides.

Prefill -> decode hand-off: the state after a token (pending bytes, held-back text) depends only
on the tokens, so a decode engine continuing a request replays the prefill's tokens
(``replay=``) and drops the text they released, which the prefill already sent: no byte is
lost or sent twice, and a stop string that begins in the prefill's token is still found.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from pdserve.tokenizer import Tokenizer

# Tokens of left context when rendering the bytes still pending at the end of a stream.
_CONTEXT = 4
# An open UTF-8 sequence is at most 4 bytes and every token at least one byte: the bytes of
# tokens this far back are settled, whatever comes next.
_SETTLED = 4
# Open tokens past which no cut is searched for any more (each search decodes all of them).
_MAX_OPEN = 64


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (),
                 include_stop: bool = False, skip_special_tokens: bool = True,
                 replay: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._skip = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop
        self._ids: list[int] = []
        self._num_decoded = 0  # leading ids whose text the stream has produced
        self._held = ""  # decoded, not released: a stop string may start here
        self._ready: list[str] = []  # released, not taken yet
        self.stopped = False  # a stop string was found; nothing more is released
        for token in replay:
            self.append(token)
        self.take()  # released by whoever produced the replayed tokens

    def append(self, token: int) -> None:
        if self.stopped:
            return
        self._ids.append(token)
        self._step(len(self._ids) - 1)
        if not self.stopped and len(self._ids) - self._num_decoded > _SETTLED:
            self._release_settled()

    def _step(self, i: int) -> None:
        chunk = self._stream.step(self._tok.backend, self._ids[i])
        if chunk is not None:
            self._num_decoded = i + 1
            self._add(chunk)

    def _release_settled(self) -> None:
        """Release what the stream holds that no later token can complete (an invalid UTF-8
        sequence, e.g. a random model's stray continuation bytes: the stream would hold it,
        and all text after it, to the end of the answer), rendered as ``decode`` renders
        it; then restart the stream after it, with left context, on the tokens still open."""
        if len(self._ids) - self._num_decoded > _MAX_OPEN:
            return  # no cut found so far: hold, as the stream does, so the cost stays linear
        start = max(0, self._num_decoded - _CONTEXT)
        done = self._tok.decode(self._ids[start: self._num_decoded], self._skip)
        whole = self._tok.decode(self._ids[start:], self._skip)
        for k in range(len(self._ids) - _SETTLED, self._num_decoded, -1):
            # A cut between two characters: the text up to it and the text after it make the
            # whole (a cut inside a byte sequence renders it as two U+FFFD, not one).
            upto = self._tok.decode(self._ids[start:k], self._skip)
            if upto.startswith(done) and \
                    upto + self._tok.decode(self._ids[k:], self._skip) == whole:
                break
        else:
            return  # no such cut yet: keep holding (``finish`` renders the rest)
        self._stream = DecodeStream(ids=self._context(k), skip_special_tokens=self._skip)
        self._num_decoded = k
        self._add(upto[len(done):])
        for i in range(k, len(self._ids)):
            if self.stopped:
                return
            self._step(i)

    def take(self) -> str:
        out = "".join(self._ready)
        self._ready.clear()
        return out

    def finish(self) -> str:
        """Everything not taken yet; no more tokens will come."""
        if not self.stopped and self._num_decoded < len(self._ids):
            self._add(self._pending_text())
            self._num_decoded = len(self._ids)
        if not self.stopped:
            self._ready.append(self._held)
        self._held = ""
        return self.take()

    def _add(self, text: str) -> None:
        window = self._held + text
        hits = [(i, s) for s in self._stop if (i := window.find(s)) >= 0]
        if hits:
            i, s = min(hits)
            self._ready.append(window[: i + len(s) if self._include_stop else i])
            self._held, self.stopped = "", True
            return
        keep = self._stop_prefix_len(window)
        self._ready.append(window[: len(window) - keep])
        self._held = window[len(window) - keep:]

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest end of ``text`` that some stop string begins with."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _context(self, k: int) -> list[int]:
        """Left context for a stream restarted at ``k``: the most tokens (up to ``_CONTEXT``)
        whose text is complete (no U+FFFD at its end, which the stream would take for an open
        sequence) and stays the start of the text with the tokens after ``k``."""
        for c in range(min(_CONTEXT, k), 0, -1):
            ctx = self._tok.decode(self._ids[k - c:k], self._skip)
            if ctx and not ctx.endswith("\ufffd") and \
                    self._tok.decode(self._ids[k - c:], self._skip).startswith(ctx):
                return self._ids[k - c:k]
        return []

    def _pending_text(self) -> str:
        """The text of the ids the stream still holds (an unfinished UTF-8 sequence), as
        ``decode`` of the whole output renders it."""
        start = max(0, self._num_decoded - _CONTEXT)
        before = self._tok.decode(self._ids[start: self._num_decoded], self._skip)
        after = self._tok.decode(self._ids[start:], self._skip)
        if after.startswith(before):
            return after[len(before):]
        # A decoder that renders the context differently once more follows: whole texts.
        done = self._tok.decode(self._ids[: self._num_decoded], self._skip)
        return self._tok.decode(self._ids, self._skip)[len(done):]
