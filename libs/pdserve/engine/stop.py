"""When a request stops, checked after each appended token (first match wins)."""

from __future__ import annotations

from pdserve.engine.request import Request


def check_stop(req: Request) -> str | None:
    """'stop' (EOS, a stop token id, a stop string its detokenizer found, or its grammar
    complete), 'length' (max_tokens or the context), or None."""
    params = req.params
    last = req.token_ids[-1]
    if not params.ignore_eos and last in req.eos_token_ids:
        return "stop"
    if last in params.stop_token_ids:
        return "stop"
    if req.detok is not None and req.detok.stopped:
        return "stop"
    if req.logits_state is not None and req.logits_state.is_done:
        return "stop"  # the grammar is complete
    if req.num_tokens >= req.max_len:
        return "length"
    return None
