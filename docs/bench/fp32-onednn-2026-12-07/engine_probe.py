"""float32 decode with MKL's packed sgemm (pdserve's default) against oneDNN's prepacked
linear, same engine code otherwise (measured 2026-12-07, not taken): bench-50m, 32 sequences
of 128 random prompt tokens, 32 greedy tokens each, one torch thread. Each side's tokens are
compared with transformers' greedy ``generate`` on the same weights, and the decode step is
timed with the two engines in turns (best of 3 rounds). oneDNN is selected with
``EngineArgs.float32_gemm`` (the first run, on bench-50m, patched ``packed.pack_kind`` before
that option existed: the same packing).

    .venv/bin/python docs/bench/fp32-onednn-2026-12-07/engine_probe.py [MODEL_DIR]

With a Hugging Face directory (e.g. SmolLM2-135M-Instruct) that model is used instead.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import replace

import torch
import transformers

from pdserve.engine.config import EngineArgs
from pdserve.engine.engine import Engine
from pdserve.models import save_builtin
from pdserve.sampling_params import SamplingParams

N, PROMPT, NEW = 32, 128, 32


def run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    """Greedy tokens per prompt, and the mean decode step (s) after every first token."""
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    engine.reset_prefix_cache()
    ids = [f"r{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    t_first, steps = 0.0, 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if t_first:
            steps += 1
        elif all(tokens.values()):
            t_first = time.perf_counter()
    return [tokens[r] for r in ids], (time.perf_counter() - t_first) / max(steps, 1)


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        if len(sys.argv) > 1:
            tmp = sys.argv[1]
        else:
            save_builtin("bench-50m", tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        args = EngineArgs(dtype="float32", max_num_seqs=N, num_blocks=N * 14 + 16,
                          max_num_batched_tokens=2048)
        mkl = Engine.from_model(tmp, args)
        onednn = Engine.from_model(tmp, replace(args, float32_gemm="onednn"))
    g = torch.Generator().manual_seed(N)
    prompts = torch.randint(2, mkl.config.vocab_size, (N, PROMPT), generator=g).tolist()
    with torch.inference_mode():
        out = hf.generate(torch.tensor(prompts), max_new_tokens=NEW, do_sample=False,
                          min_new_tokens=NEW, pad_token_id=0)
    reference = out[:, PROMPT:].tolist()
    best = {"mkl": float("inf"), "onednn": float("inf")}
    for _ in range(3):
        for name, engine in (("mkl", mkl), ("onednn", onednn)):
            tokens, step = run(engine, prompts)
            best[name] = min(best[name], step)
            same = sum(a == b for t, r in zip(tokens, reference, strict=True)
                       for a, b in zip(t, r, strict=True))
            whole = sum(t == r for t, r in zip(tokens, reference, strict=True))
            print(f"{name:6s} step {step * 1e3:6.1f} ms; tokens equal to transformers "
                  f"{same}/{N * NEW}, sequences {whole}/{N}", flush=True)
    print(f"best step: mkl {best['mkl'] * 1e3:.1f} ms, onednn {best['onednn'] * 1e3:.1f} ms "
          f"({best['mkl'] / best['onednn']:.2f}x)")


if __name__ == "__main__":
    main()
