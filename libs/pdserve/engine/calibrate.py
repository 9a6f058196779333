"""An engine measures its own capacity at start (``measure``; the engine services'
``--calibrate``): the numbers the P:D controller plans with, for exactly this model, dtype,
device, thread count and machine, so the controller need not start from someone else's bench.

    prefill   one request of ``prompt_len`` random tokens, alone in its step (its only
              token comes from the prefill): prompt tokens / step seconds, best of 2
    decode    for each batch b: b requests of ``DECODE_PROMPT`` tokens, prefilled first, then
              ``steps`` steps where every request decodes one token: median step seconds

The requests carry their own cache salt and run to completion; afterwards the prefix cache
and the counters ``Engine.stats`` reports are reset, so serving starts as from a fresh
engine. A batch the engine cannot hold (``max_num_seqs``, free KV blocks) is left out.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from pdserve.engine.engine import Engine
from pdserve.sampling_params import SamplingParams

DECODE_PROMPT = 16
SALT = "pdserve-calibration"


@dataclass(frozen=True)
class Measured:
    prefill_tokens_per_s: float
    decode_steps: tuple[tuple[int, float], ...]  # (batch, seconds per step), ascending


def measure(engine: Engine, prompt_len: int = 256, batches: tuple[int, ...] = (1, 4, 16, 32),
            steps: int = 4) -> Measured:
    """Run the measurement on ``engine`` (idle, just built); see the module docstring."""
    budget = engine.scheduler.max_prefill_tokens or engine.args.max_num_batched_tokens
    prompt_len = max(1, min(prompt_len, budget, engine.max_model_len - 1))
    g = torch.Generator().manual_seed(0)
    vocab = engine.config.vocab_size

    def prompt(n: int) -> list[int]:
        return torch.randint(2, vocab, (n,), generator=g).tolist()

    def timed_steps(params: SamplingParams, prompts: list[list[int]]) -> list[float]:
        for i, p in enumerate(prompts):
            engine.add_request(f"calibration-{time.monotonic_ns()}-{i}", p, params,
                               cache_salt=SALT)
        times = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        return times

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefill_s = min(timed_steps(one, [prompt(prompt_len)])[0] for _ in range(2))
    block = engine.args.block_size
    free = engine.kv.pool.num_free
    decode: list[tuple[int, float]] = []
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for b in batches:
        blocks = b * -(-(DECODE_PROMPT + steps + 1) // block)
        if b > engine.args.max_num_seqs or blocks > free:
            continue
        times = timed_steps(params, [prompt(DECODE_PROMPT) for _ in range(b)])
        # the first step prefills all b prompts (and samples their first tokens)
        decode.append((b, statistics.median(times[1:])))
    engine.reset_prefix_cache()
    engine.reset_counters()
    return Measured(prompt_len / prefill_s, tuple(decode))
