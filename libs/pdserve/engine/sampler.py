"""Batched sampling: one set of tensor ops for the whole batch.

Per-row parameters become tensors (temperature, top-k, top-p, min-p). Top-k and top-p need
the logits in descending order: one sort of the batch, only when some row sets either; without
them (temperature and min-p alone) the batch is sampled in vocabulary order, with no sort.
Sampling uses the exponential race (argmax p / E, E ~ Exp(1)),
which equals a categorical draw and lets seeded rows use their own generator for E while the
rest share one, so a seeded request's samples do not depend on its batch neighbours.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.logits_process import process_logits
from pdserve.engine.request import Logprob, Request

# What a logprob of -inf (a token the grammar forbids) is reported as: JSON has no -inf.
MIN_LOGPROB = -9999.0


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Logprob | None]


# rows [T, V] -> the index of each row's largest value, torch.argmax's answer (ties: the first;
# NaN counts as the largest).
Argmax = Callable[[torch.Tensor], torch.Tensor]


def torch_argmax(rows: torch.Tensor) -> torch.Tensor:
    return rows.argmax(-1)


class Sampler:
    """``argmax``: the greedy pick and the race's winner (``attention/cpu_decode.argmax``, the
    native kernel, on CPU engines)."""

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu",
                 argmax: Argmax = torch_argmax) -> None:
        self.argmax = argmax
        self.generator = torch.Generator(device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        logits = process_logits(logits.float(), reqs)  # grammar, logit_bias, penalties
        params = [r.params for r in reqs]
        greedy = self.argmax(logits)
        tokens = greedy if all(p.is_greedy for p in params) else self._sample(logits, reqs, greedy)
        return SamplerOutput(tokens.tolist(), self._logprobs(logits, tokens, reqs))

    def _sample(self, logits: torch.Tensor, reqs: list[Request],
                greedy: torch.Tensor) -> torch.Tensor:
        dev = logits.device
        params = [r.params for r in reqs]
        vocab = logits.shape[-1]
        is_greedy = torch.tensor([p.is_greedy for p in params], device=dev)
        temp = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                            device=dev)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        min_p = torch.tensor([p.min_p for p in params], device=dev)

        scaled = logits / temp[:, None]
        race = torch.empty_like(scaled).exponential_(generator=self.generator)
        for i, r in enumerate(reqs):
            if r.generator is not None:
                race[i].exponential_(generator=r.generator)
        if all(p.top_k <= 0 and p.top_p >= 1.0 for p in params):
            probs = scaled.softmax(-1)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True)[0],
                                      0.0)
            return torch.where(is_greedy, greedy, self.argmax(probs / race))
        sorted_logits, order = scaled.sort(-1, descending=True)
        rank = torch.arange(vocab, device=dev)[None, :]
        drop = rank >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(-1)
        # Nucleus: drop a token once the mass strictly before it already reaches top_p
        # (the first token always survives).
        drop |= (probs.cumsum(-1) - probs) >= top_p[:, None]
        drop |= probs < (min_p[:, None] * probs[:, :1])
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(-1)
        picked = order.gather(1, self.argmax(probs / race)[:, None]).squeeze(1)
        return torch.where(is_greedy, greedy, picked)

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor,
                  reqs: list[Request]) -> list[Logprob | None]:
        wanted = [r.params.logprobs for r in reqs]
        if all(n is None for n in wanted):
            return [None] * len(reqs)
        logprobs = logits.log_softmax(-1).clamp(min=MIN_LOGPROB)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        max_n = max(n or 0 for n in wanted)
        top_vals, top_ids = logprobs.topk(max_n, -1) if max_n else (logprobs[:, :0],) * 2
        vals, ids = top_vals.tolist(), top_ids.tolist()
        out: list[Logprob | None] = []
        for i, n in enumerate(wanted):
            out.append(None if n is None else
                       Logprob(chosen[i], list(zip(ids[i][:n], vals[i][:n], strict=True))))
        return out
