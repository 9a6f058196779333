"""When a request stops, checked after each appended token (first match wins)."""

from __future__ import annotations

from typing import Protocol

from pdserve.engine.request import Request


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def check_stop(req: Request, tokenizer: Decoder | None) -> str | None:
    """'stop' (EOS, a stop token id or a stop string), 'length' (max_tokens or context), or
    None. On a stop string, ``req.stop_text`` gets the output text cut exactly before it
    (or after it with include_stop_str_in_output)."""
    params = req.params
    last = req.token_ids[-1]
    if not params.ignore_eos and last in req.eos_token_ids:
        return "stop"
    if last in params.stop_token_ids:
        return "stop"
    if params.stop and tokenizer is not None:
        text = tokenizer.decode(req.output_token_ids)
        hits = [(i, s) for s in params.stop if (i := text.find(s)) >= 0]
        if hits:
            i, s = min(hits)
            req.stop_text = text[: i + len(s)] if params.include_stop_str_in_output else text[:i]
            return "stop"
    if req.num_tokens >= req.max_len:
        return "length"
    return None
