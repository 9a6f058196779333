"""Prompt logprobs: how the model scores each prompt token, as OpenAI's ``echo`` reports it.

A request with ``prompt_logprobs`` = n gets, for every prompt token after the first, its
logprob under the model given the tokens before it, and the top n alternatives: the raw
model's distribution (log-softmax of the logits; no penalties, no temperature). The hidden
state at position p predicts token p + 1, so a prefill chunk covering positions [s, s + k)
yields the entries of tokens s + 1 .. s + k (within the prompt). Entry i is token i + 1's; a
recomputed chunk (after preemption) overwrites from its start. Such requests take no prefix
hits (``scheduler.PrefillAdder``): a cached block has no hidden states to score.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.engine.request import Logprob

if TYPE_CHECKING:
    from pdserve.engine.scheduler import ScheduledBatch
    from pdserve.models.base import CausalLM

# Rows of logits materialized at once ([rows, vocab] float32).
_SLICE = 256


def record_prompt_logprobs(model: CausalLM, hidden: torch.Tensor, batch: ScheduledBatch) -> None:
    """Score the prompt tokens this step's chunks predict, into ``req.prompt_logprobs``."""
    offset = 0
    for req, num_new in zip(batch.reqs, batch.num_new_tokens, strict=True):
        n = req.params.prompt_logprobs
        start = req.num_computed_tokens
        end = min(start + num_new, req.num_prompt_tokens - 1)  # last prompt position predicts
        if n is not None and start < end:                     # the first output token
            del req.prompt_logprobs[start:]
            targets = req.prompt_token_ids[start + 1: end + 1]
            for lo in range(0, end - start, _SLICE):
                rows = hidden[offset + lo: offset + min(lo + _SLICE, end - start)]
                req.prompt_logprobs.extend(
                    _score(model, rows, targets[lo: lo + _SLICE], n))
        offset += num_new


def _score(model: CausalLM, rows: torch.Tensor, targets: list[int], n: int) -> list[Logprob]:
    logprobs = model.compute_logits(rows).float().log_softmax(-1)
    index = torch.tensor(targets, device=logprobs.device)[:, None]
    chosen = logprobs.gather(1, index).squeeze(1).tolist()
    if n:
        vals, ids = logprobs.topk(n, -1)
        top = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(),
                                                            strict=True)]
    else:
        top = [[] for _ in targets]
    return [Logprob(c, t) for c, t in zip(chosen, top, strict=True)]
