"""``pdserve bench engine``: pdserve's engine vs transformers ``generate``, same weights, one run.

The ``bench-50m`` built-in (or ``--model``: another built-in, or a Hugging Face directory such
as a local SmolLM2) is saved as a Hugging Face directory; both sides load it in float32
(or ``--dtype``) and get the same random prompts (128 tokens, 128 new tokens, greedy, EOS
ignored) at each concurrency. Prefill tokens/s = prompt tokens / time to every first token;
decode tokens/s = the remaining tokens / the remaining time.

Each repeat runs transformers, pdserve and the GEMM ceiling (``gemm_ceiling.py``: the model's
own projections alone, at the same rows, dtype and threads) back to back in this process;
the best run of each counts, and the per-repeat ratios are reported as ranges (the machine
may be shared). ``gemm_fraction`` = ceiling GEMM time / pdserve decode step time. The
``*_cpu`` fields repeat both ratios in this process's CPU time, which a loaded machine's
descheduling does not inflate (exact with ``--threads 1``). ``--packed-weights off`` runs
pdserve on plain weights (``weight_mb`` says what the weights take).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pdserve.attention import cpu_decode
from pdserve.engine.config import EngineArgs
from pdserve.engine.engine import Engine
from pdserve.models import save_builtin
from pdserve.models.builtin import BUILTIN_MODELS
from pdserve.models.loader import weight_bytes
from pdserve.models.packed import FLOAT32_GEMMS
from pdserve.sampling_params import SamplingParams
from pdserve_bench.gemm_ceiling import cpu_features, gemm_step_seconds


@dataclass(frozen=True)
class Result:
    num_seqs: int
    pdserve_decode_tps: float
    hf_decode_tps: float
    pdserve_prefill_tps: float
    hf_prefill_tps: float
    dtype: str = "float32"
    decode_step_ms: float = 0.0        # pdserve, best run
    gemm_step_ms: float = 0.0          # the ceiling, best run
    gemm_fraction: float = 0.0         # gemm_step_ms / decode_step_ms
    decode_ratio_range: tuple[float, float] = (0.0, 0.0)   # pdserve / hf, per repeat
    gemm_fraction_range: tuple[float, float] = (0.0, 0.0)  # per repeat
    packed_weights: bool = True
    weight_mb: float = 0.0             # pdserve's weights in memory, packed copies included
    # The same two ratios in CPU time of this process (best runs): what a loaded machine's
    # descheduling leaves out; meaningful with --threads 1 (idle OpenMP threads spin).
    decode_cpu_ratio: float = 0.0      # hf decode CPU s / pdserve decode CPU s
    gemm_fraction_cpu: float = 0.0     # ceiling CPU s / pdserve decode CPU s per step
    # What the run measured, so a controller calibration (--controller-calibration) can
    # say which model, prompt length and torch threads its numbers are for.
    model: str = "bench-50m"
    prompt_len: int = 0
    threads: int = 0
    # What pdserve's side ran (--native-kernels): "native-<instruction set>" (attention/
    # cpu_decode.py: "native-avx512bf16", bfloat16 scores with vdpbf16ps; "native-avx512";
    # "native-avx2") or "sdpa" for decode attention; the elementwise kernels' name
    # (models/kernels.py).
    decode_attention: str = ""
    elementwise: str = ""
    float32_gemm: str = "mkl"  # --float32-gemm: whose packed GEMM pdserve's float32 side ran


def _prompts(num_seqs: int, prompt_len: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(num_seqs)
    return torch.randint(2, vocab, (num_seqs, prompt_len), generator=g).tolist()


def run_pdserve(engine: Engine, prompts: list[list[int]], new_tokens: int
                ) -> tuple[float, float, float]:
    """(prefill seconds, decode seconds, decode CPU seconds) for one batch run to completion."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.reset_prefix_cache()  # every run computes its prompts
    for i, p in enumerate(prompts):
        engine.add_request(f"b{len(p)}-{i}-{time.monotonic_ns()}", p, params)
    started: set[str] = set()
    t0 = time.perf_counter()
    t_first, cpu_first = t0, time.process_time()
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and out.request_id not in started:
                started.add(out.request_id)
                if len(started) == len(prompts):
                    t_first, cpu_first = time.perf_counter(), time.process_time()
    return t_first - t0, time.perf_counter() - t_first, time.process_time() - cpu_first


class _FirstTokenClock:
    """A generate() streamer that notes when the first new tokens arrive (its second put;
    the first put is the prompt)."""

    def __init__(self) -> None:
        self.num_puts = 0
        self.t_first = self.cpu_first = 0.0

    def put(self, value: torch.Tensor) -> None:
        self.num_puts += 1
        if self.num_puts == 2:
            self.t_first, self.cpu_first = time.perf_counter(), time.process_time()

    def end(self) -> None:
        pass


@torch.inference_mode()
def run_hf(model: Any, prompts: list[list[int]], new_tokens: int
           ) -> tuple[float, float, float]:
    """(prefill seconds, decode seconds, decode CPU seconds) of one generate call."""
    ids = torch.tensor(prompts)
    clock = _FirstTokenClock()
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                   eos_token_id=None, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   streamer=clock)
    return (clock.t_first - t0, time.perf_counter() - clock.t_first,
            time.process_time() - clock.cpu_first)


def bench(concurrencies: list[int], prompt_len: int, new_tokens: int,
          repeats: int = 1, dtype: str = "float32", packed: bool = True,
          model: str = "bench-50m", native: str = "auto",
          float32_gemm: str = "mkl") -> list[Result]:
    """Each side runs ``repeats`` times per concurrency, alternating; the best run counts
    (shared machines are noisy; the best run is the least disturbed one). ``model``: a
    built-in name (saved as a Hugging Face directory first) or a Hugging Face directory."""
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        path = model if Path(model).is_dir() else tmp
        if path == tmp:
            save_builtin(model, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype)).eval()
        max_seqs = max(concurrencies)
        context = prompt_len + new_tokens
        engine = Engine.from_model(path, EngineArgs(
            dtype=dtype, max_num_seqs=max_seqs,
            num_blocks=max_seqs * (-(-context // 16) + 4) + 16,
            max_num_batched_tokens=max(2048, prompt_len * 8), packed_weights=packed,
            native_kernels=native, float32_gemm=float32_gemm))
    vocab = engine.config.vocab_size
    warm = _prompts(2, 16, vocab)
    run_pdserve(engine, warm, 4)
    run_hf(hf, warm, 4)
    weight_mb = weight_bytes(engine.runner.model) / 2**20
    attention = "native" if getattr(engine.runner.backend, "native", None) else "sdpa"
    if attention == "native":  # with which instructions
        attention += "-" + cpu_decode.isa(cpu_decode.module(native), getattr(torch, dtype))
    return [replace(_one_concurrency(engine, hf, n, prompt_len, new_tokens, repeats, dtype),
                    packed_weights=packed, weight_mb=round(weight_mb, 1), model=model,
                    prompt_len=prompt_len, threads=torch.get_num_threads(),
                    decode_attention=attention, elementwise=engine.kernels,
                    float32_gemm=float32_gemm)
            for n in concurrencies]


def _one_concurrency(engine: Engine, hf: Any, n: int, prompt_len: int, new_tokens: int,
                     repeats: int, dtype: str) -> Result:
    prompts = _prompts(n, prompt_len, engine.config.vocab_size)
    steps = new_tokens - 1
    hf_runs, pd_runs, gemm, gemm_cpu = [], [], [], []
    for _ in range(repeats):
        hf_runs.append(run_hf(hf, prompts, new_tokens))
        pd_runs.append(run_pdserve(engine, prompts, new_tokens))
        gemm.append(gemm_step_seconds(engine.runner.model, n))  # type: ignore[arg-type]
        gemm_cpu.append(gemm_step_seconds(engine.runner.model, n,  # type: ignore[arg-type]
                                          clock=time.process_time))
    ratios = [h[1] / p[1] for h, p in zip(hf_runs, pd_runs, strict=True)]
    fractions = [g * steps / p[1] for g, p in zip(gemm, pd_runs, strict=True)]
    hf_pre, hf_dec = min(r[0] for r in hf_runs), min(r[1] for r in hf_runs)
    pd_pre, pd_dec = min(r[0] for r in pd_runs), min(r[1] for r in pd_runs)
    pd_cpu, hf_cpu = min(r[2] for r in pd_runs), min(r[2] for r in hf_runs)
    return Result(n, n * steps / pd_dec, n * steps / hf_dec, n * prompt_len / pd_pre,
                  n * prompt_len / hf_pre, dtype, 1e3 * pd_dec / steps, 1e3 * min(gemm),
                  min(gemm) * steps / pd_dec, (min(ratios), max(ratios)),
                  (min(fractions), max(fractions)), decode_cpu_ratio=hf_cpu / pd_cpu,
                  gemm_fraction_cpu=min(gemm_cpu) * steps / pd_cpu)


def format_table(results: list[Result]) -> str:
    lines = [f"{'dtype':>8} {'seqs':>5} {'phase':>8} {'pdserve tok/s':>14} {'hf tok/s':>10} "
             f"{'ratio':>6} {'ratio range':>12} {'step ms':>8} {'gemm ms':>8} {'of ceiling':>11} "
             f"{'cpu ratio':>9} {'cpu of ceiling':>14}"]
    for r in results:
        pre = r.pdserve_prefill_tps / r.hf_prefill_tps
        lines.append(f"{r.dtype:>8} {r.num_seqs:>5} {'prefill':>8} {r.pdserve_prefill_tps:>14.1f} "
                     f"{r.hf_prefill_tps:>10.1f} {pre:>6.2f}")
        lo, hi = r.decode_ratio_range
        flo, fhi = r.gemm_fraction_range
        lines.append(f"{r.dtype:>8} {r.num_seqs:>5} {'decode':>8} {r.pdserve_decode_tps:>14.1f} "
                     f"{r.hf_decode_tps:>10.1f} {r.pdserve_decode_tps / r.hf_decode_tps:>6.2f} "
                     f"{f'{lo:.2f}-{hi:.2f}':>12} {r.decode_step_ms:>8.2f} {r.gemm_step_ms:>8.2f} "
                     f"{f'{r.gemm_fraction:.0%} ({flo:.0%}-{fhi:.0%})':>11} "
                     f"{r.decode_cpu_ratio:>9.2f} {r.gemm_fraction_cpu:>14.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench engine", description=__doc__)
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per dtype and concurrency")
    parser.add_argument("--quick", action="store_true", help="16 new tokens (smoke run)")
    parser.add_argument("--model", default="bench-50m",
                        help="built-in model name or Hugging Face directory (both sides load "
                             "the same weights)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", nargs="+", default=["float32"],
                        choices=["float32", "bfloat16"],
                        help="weights and KV dtype, both sides; several give one row set each")
    parser.add_argument("--repeats", type=int, default=1, help="best of N runs per side")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--packed-weights", choices=["on", "off"], default="on",
                        help="pdserve's pre-packed CPU GEMM weights (models/packed.py)")
    parser.add_argument("--native-kernels", choices=["auto", "on", "off"], default="auto",
                        help="pdserve's C++ CPU kernels: decode attention, and RMSNorm and "
                             "SiLU-and-mul in bfloat16 (attention/cpu_decode.py)")
    parser.add_argument("--float32-gemm", choices=list(FLOAT32_GEMMS), default="mkl",
                        help="whose packed GEMM serves pdserve's float32 weights: mkl (bit-"
                             "identical to transformers' F.linear) or onednn (models/packed.py)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    new_tokens = 16 if args.quick else args.new_tokens
    if args.prompt_len < 1 or new_tokens < 2 or min(args.concurrency) < 1 or args.repeats < 1:
        parser.error("--prompt-len, --concurrency, --repeats must be >= 1, --new-tokens >= 2")
    hardware = cpu_features()
    if not Path(args.model).is_dir() and args.model not in BUILTIN_MODELS:
        parser.error(f"--model {args.model!r}: neither a directory nor a built-in model "
                     f"({', '.join(BUILTIN_MODELS)})")
    results = [r for dtype in args.dtype
               for r in bench(args.concurrency, args.prompt_len, new_tokens, args.repeats, dtype,
                              args.packed_weights == "on", args.model, args.native_kernels,
                              args.float32_gemm)]
    hardware["load_average_after"] = round(os.getloadavg()[0], 2)
    if args.json:
        for r in results:
            print(json.dumps(asdict(r) | {"hardware": hardware}))
    else:
        print(f"{args.model}, {torch.get_num_threads()} threads, prompt {args.prompt_len} tokens, "
              f"{new_tokens} new tokens, best of {args.repeats}, packed weights "
              f"{args.packed_weights} (float32 on {args.float32_gemm}), "
              f"weights MB {({r.dtype: r.weight_mb for r in results})}, "
              f"decode attention {({r.dtype: r.decode_attention for r in results})}, "
              f"elementwise {({r.dtype: r.elementwise for r in results})}")
        print("hardware: " + ", ".join(f"{k}={v}" for k, v in hardware.items()))
        print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
