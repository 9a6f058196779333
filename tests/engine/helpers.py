"""Shared helpers for engine tests: a tiny model loaded once, and a run-to-completion loop."""

from __future__ import annotations

import functools

import torch

from pdserve.engine.config import EngineArgs
from pdserve.engine.engine import Engine
from pdserve.models import LoadedModel, load_model
from pdserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@functools.cache
def tiny() -> LoadedModel:
    return load_model("tiny", dtype="float32")


def make_engine(**kwargs: object) -> Engine:
    return Engine(tiny(), EngineArgs(**kwargs))  # type: ignore[arg-type]


def random_prompts(lens: list[int], seed: int = 0, prefix: list[int] | None = None
                   ) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = tiny().config.vocab_size
    return [(prefix or []) + torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]


def run_all(engine: Engine, prompts: list[list[int]],
            params: SamplingParams | list[SamplingParams] = GREEDY,
            priorities: list[int] | None = None, check_every_step: bool = True
            ) -> tuple[list[list[int]], dict[int, str], list[str]]:
    """Run prompts to completion; returns (tokens per prompt, finish reasons, finish order)."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    base = len(engine.requests) + engine.stats().num_prefill_tokens  # unique-ish ids
    ids = [f"q{base}-{i}" for i in range(len(prompts))]
    for i, (rid, p) in enumerate(zip(ids, prompts, strict=True)):
        engine.add_request(rid, p, plist[i], priority=priorities[i] if priorities else 0)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    reasons: dict[str, str] = {}
    order: list[str] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason or ""
                order.append(out.request_id)
        if check_every_step:
            engine.check_integrity()
    return [tokens[r] for r in ids], {ids.index(r): v for r, v in reasons.items()}, \
        [str(ids.index(r)) for r in order]
