"""Logits processing before sampling, batched: grammar masks, logit_bias, penalties.

    LogitsState(params, prompt, num_prior_output, guide)   per request, made by add_request
      .accept(token)                                        after each sampled token
    process_logits(logits [B, V], reqs) -> logits           one set of ops per kind per step

In this order, for the rows that use each (vLLM's order and definitions, OpenAI's for the two
output penalties):

    1. grammar   tokens the request's grammar does not allow next -> -inf  (one bitmask
                 [B', V/32] filled by llguidance on the CPU, unpacked on the device)
    2. bias      logit[t] += logit_bias[t]                               (one index_put)
    3. repetition  t in prompt or output: logit / r if logit > 0 else logit * r
    4. frequency   logit -= frequency_penalty * count(t in output)
    5. presence    logit -= presence_penalty * (count(t in output) > 0)

Output counts are rebuilt every step from the token lists with one scatter_add over the
penalized rows (vLLM v1 does the same), so no per-request device state has to follow
preemption or the prefill -> decode hand-off. "Output" means the request's own tokens: on a
decode engine that continues a prefilled request, the last ``num_prior_output`` prompt tokens
(the prefill's first token) are output, as they were on the prefill engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from pdserve.engine.guided import Guide, apply_bitmask, bitmask_width
from pdserve.sampling_params import SamplingParams


class Request(Protocol):
    """What processing reads of ``pdserve.engine.request.Request`` (which holds the state)."""

    params: SamplingParams
    token_ids: list[int]
    logits_state: LogitsState | None


class LogitsState:
    """What one request's logits processing needs across steps."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int], num_prior_output: int,
                 guide: Guide | None) -> None:
        self.params = params
        self.guide = guide
        self.num_prompt = len(prompt) - num_prior_output  # the rest of token_ids is output
        # Repetition counts the prompt as a set: its distinct ids, computed once.
        self.prompt_ids = (sorted(set(prompt[: self.num_prompt]))
                           if params.repetition_penalty != 1.0 else [])

    @property
    def is_active(self) -> bool:
        p = self.params
        return self.guide is not None or bool(p.logit_bias) or p.has_penalties

    @property
    def is_done(self) -> bool:
        """The grammar allows nothing more: the request ends here."""
        return self.guide is not None and self.guide.is_done

    def accept(self, token: int) -> None:
        if self.guide is not None:
            self.guide.accept(token)


def needs_processing(params: SamplingParams) -> bool:
    return params.structured is not None or bool(params.logit_bias) or params.has_penalties


def process_logits(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """``logits`` [B, V] (float32, one row per request, changed in place) after 1-5 above."""
    states = [r.logits_state for r in reqs]
    if all(s is None or not s.is_active for s in states):
        return logits
    guided = [i for i, s in enumerate(states) if s is not None and s.guide is not None]
    if guided:
        _mask(logits, guided, reqs)
    biased = [i for i, s in enumerate(states) if s is not None and s.params.logit_bias]
    if biased:
        _bias(logits, biased, reqs)
    penalized = [i for i, s in enumerate(states) if s is not None and s.params.has_penalties]
    if penalized:
        _penalize(logits, penalized, reqs)
    return logits


def _mask(logits: torch.Tensor, rows: list[int], reqs: Sequence[Request]) -> None:
    bitmask = torch.empty((len(rows), bitmask_width(logits.shape[-1])), dtype=torch.int32)
    for k, i in enumerate(rows):
        state = reqs[i].logits_state
        assert state is not None and state.guide is not None
        state.guide.fill(bitmask[k])
    apply_bitmask(logits, torch.tensor(rows, device=logits.device), bitmask)


def _bias(logits: torch.Tensor, rows: list[int], reqs: Sequence[Request]) -> None:
    row_ids, token_ids, values = [], [], []
    for i in rows:
        for token, bias in reqs[i].params.logit_bias:  # type: ignore[misc]
            row_ids.append(i)
            token_ids.append(token)
            values.append(bias)
    dev = logits.device
    logits.index_put_((torch.tensor(row_ids, device=dev), torch.tensor(token_ids, device=dev)),
                      torch.tensor(values, device=dev, dtype=logits.dtype), accumulate=True)


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long,
                        device=device).reshape(len(rows), width)


def _penalize(logits: torch.Tensor, rows: list[int], reqs: Sequence[Request]) -> None:
    dev, vocab = logits.device, logits.shape[-1]
    states = [reqs[i].logits_state for i in rows]
    outputs = [reqs[i].token_ids[s.num_prompt:] for i, s in zip(rows, states, strict=True)
               if s is not None]
    # One extra column takes the padding and is dropped.
    counts = torch.zeros((len(rows), vocab + 1), device=dev, dtype=logits.dtype)
    ids = _padded(outputs, vocab, dev)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))
    counts = counts[:, :vocab]
    index = torch.tensor(rows, device=dev)
    sub = logits[index]
    params = [r.params for r in (reqs[i] for i in rows)]
    rep = torch.tensor([p.repetition_penalty for p in params], device=dev,
                       dtype=logits.dtype)[:, None]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = torch.zeros((len(rows), vocab + 1), device=dev, dtype=torch.bool)
        prompt_ids = _padded([s.prompt_ids for s in states if s is not None], vocab, dev)
        seen.scatter_(1, prompt_ids, True)
        seen = seen[:, :vocab] | (counts > 0)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev, dtype=logits.dtype)
    pres = torch.tensor([p.presence_penalty for p in params], device=dev, dtype=logits.dtype)
    sub = sub - freq[:, None] * counts - pres[:, None] * (counts > 0).to(logits.dtype)
    logits[index] = sub
