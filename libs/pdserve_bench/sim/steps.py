"""What one colocated engine step costs, measured on the engine library: the evidence for the
simulator's colocated step model (``python -m pdserve_bench.sim.steps``; a benchmark, not a
test).

An engine with the engine service's settings (``max_num_batched_tokens`` 512, the chunk of
chunked prefill) runs ``b`` decoding sequences; then a prompt of ``P`` tokens joins. Per
(b, P), the median over repeats of:

    decode   a steady decode step of b (the decode mirror appends: what `bench engine` times)
    mixed    the step that computes the prompt together with the b decodes (every decode in
             it waits for the whole step: one inter-token gap)
    join     the next step: b + 1 decodes, the batch changed, so the mirror is refilled
    leave    the step after the prompt's request (max_tokens 2) finished: b decodes, refilled
    steady   a steady decode step of b + 1 (for ``join``'s comparison)

and, for the simulator's additive model, ``prefill`` (the prompt alone, b = 0) so that
``decode(b) + prefill(P)`` can be set beside ``mixed(b, P)``. One JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from pdserve.engine.config import EngineArgs
from pdserve.engine.engine import Engine
from pdserve.models.builtin import save_builtin
from pdserve.sampling_params import SamplingParams

CHUNK = 512  # services/engine/config.py: max_num_batched_tokens


class Bench:
    def __init__(self, engine: Engine, seed: int = 0) -> None:
        self.engine, self.num_added = engine, 0
        self.gen = torch.Generator().manual_seed(seed)

    def add(self, prompt_len: int, max_tokens: int) -> None:
        self.num_added += 1
        prompt = torch.randint(2, self.engine.config.vocab_size, (prompt_len,),
                               generator=self.gen).tolist()
        self.engine.add_request(f"s{self.num_added}", prompt, SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    def step(self) -> float:
        t0 = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - t0

    def clear(self) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
        while self.engine.has_unfinished():
            self.engine.step()

    def one(self, num_decodes: int, prompt_len: int) -> dict[str, float]:
        """One repeat of (b, P): the step times in seconds."""
        for _ in range(num_decodes):
            self.add(32, 10_000)
        for _ in range(24):  # the prompts, then steady decoding (contexts ~56 tokens)
            self.step()
        decode = statistics.median(self.step() for _ in range(6)) if num_decodes else 0.0
        self.add(prompt_len, 2)
        times = {"decode": decode, "mixed": self.step(), "join": self.step()}
        if num_decodes:
            times["leave"] = self.step()
            self.add(1, 10_000)  # back to b + 1 for a steady step of that batch
            self.step(), self.step()
            times["steady"] = statistics.median(self.step() for _ in range(4))
        self.clear()
        return times


def decode_only(bench: Bench, batches: list[int], repeats: int) -> list[dict[str, float]]:
    """A steady decode step of each batch size (to set a prompt of P tokens beside P rows)."""
    return [{"num_decodes": b, "prompt_len": 0,
             "decode_ms": 1e3 * _median(bench, b, 1, "decode", repeats)} for b in batches]


def measure(bench: Bench, batches: list[int], prompts: list[int], repeats: int
            ) -> list[dict[str, float]]:
    rows = []
    prefill = {p: _median(bench, 0, p, "mixed", repeats) for p in prompts}
    for b in batches:
        for p in prompts:
            runs = [bench.one(b, p) for _ in range(repeats)]
            row = {"num_decodes": b, "prompt_len": p, "prefill_ms": 1e3 * prefill[p]}
            for key in runs[0]:
                row[f"{key}_ms"] = 1e3 * statistics.median(r[key] for r in runs)
            row["additive_ms"] = row["decode_ms"] + row["prefill_ms"]
            rows.append(row)
    return rows


def _median(bench: Bench, num_decodes: int, prompt_len: int, key: str, repeats: int) -> float:
    """The median over ``repeats`` of one step time of (b, P)."""
    return statistics.median(bench.one(num_decodes, prompt_len)[key] for _ in range(repeats))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve_bench.sim.steps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    p.add_argument("--prompts", type=int, nargs="+", default=[32, 128, 448])
    p.add_argument("--decode-batches", type=int, nargs="*", default=[16, 32],
                   help="also a steady decode step alone at these batch sizes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    if max(a.prompts) + max(a.batches) > CHUNK or min(a.prompts) < 1 or a.repeats < 1:
        p.error(f"--prompts: 1..{CHUNK} - max(--batches) tokens (one chunk); --repeats >= 1")
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        save_builtin("bench-50m", tmp)
        engine = Engine.from_model(tmp, EngineArgs(
            dtype="float32", max_num_seqs=64, max_num_batched_tokens=CHUNK, num_blocks=4096))
    bench = Bench(engine)
    bench.one(1, 16)  # warm up
    rows = decode_only(bench, a.decode_batches, a.repeats)
    for row in rows + measure(bench, a.batches, a.prompts, a.repeats):
        print(json.dumps({k: round(v, 2) for k, v in row.items()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
