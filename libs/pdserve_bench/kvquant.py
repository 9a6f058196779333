"""``pdserve bench kvquant``: what a quantized KV cache costs in quality and gains in capacity.

One model (``--model``; default SmolLM2-135M-Instruct in ``/work/models/smollm2`` or
``~/.cache/pdserve/smollm2``, where tests/e2e/real_model.py builds it) is loaded once; for
each ``--kv-cache-dtype`` an engine over those weights

- scores the held-out text (``heldout.py``) teacher-forced (``prompt_logprobs``, chunked
  prefill, so later chunks attend over cached, quantized K/V): perplexity, and how often its
  top-1 choice equals the unquantized cache's at the same position;
- generates ``--new-tokens`` greedy tokens from the text's first ``--prompt-tokens`` tokens:
  the share of positions equal to the unquantized cache's, the first that differs, and how
  close a call the baseline's choice was there (top-1 minus top-2 logprob): after a first
  difference the two continuations are different texts, so that share mostly says where;
- reports KV bytes per token (values and scales) and tokens per GiB of cache.

The first dtype listed is the baseline (default ``auto``: the model's own dtype).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pdserve.attention.kv_quant import KV_CACHE_DTYPES, bytes_per_token, kv_quant
from pdserve.engine.config import EngineArgs
from pdserve.engine.engine import Engine
from pdserve.models import LoadedModel, load_model
from pdserve.sampling_params import SamplingParams
from pdserve_bench.heldout import TEXT

DEFAULT_MODELS = ("/work/models/smollm2", str(Path.home() / ".cache/pdserve/smollm2"))
GIB = 1 << 30


@dataclass(frozen=True)
class Run:
    """One dtype's raw outputs."""

    top1: list[int]
    logprobs: list[float]
    greedy: list[int]
    margins: list[float]  # top-1 minus top-2 logprob at each greedy step
    decode_tps: float


@dataclass(frozen=True)
class Result:
    kv_cache_dtype: str
    kv_bytes_per_token: int
    tokens_per_gib: int
    capacity_vs_baseline: float
    perplexity: float
    perplexity_change_pct: float
    teacher_forced_agreement: float
    greedy_agreement: float
    first_divergence: int | None
    baseline_margin_there: float | None  # the baseline's top-1 - top-2 logprob at it (nats)
    num_scored_tokens: int
    num_greedy_tokens: int
    decode_tps: float


def default_model() -> str:
    for path in DEFAULT_MODELS:
        if (Path(path) / "model.safetensors").is_file():
            return path
    return DEFAULT_MODELS[0]


def _run_until_done(engine: Engine) -> dict[str, list]:
    """Per request: [tokens, prompt logprobs, top-1 minus top-2 logprob per token]."""
    out: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            got = out.setdefault(o.request_id, [[], None, []])
            got[0] += o.new_token_ids
            if o.prompt_logprobs is not None:
                got[1] = o.prompt_logprobs
            for lp in o.logprobs or []:
                got[2].append(lp.top[0][1] - lp.top[1][1])
    return out


def run_one(lm: LoadedModel, kv_cache_dtype: str, text_ids: list[int], prompt_tokens: int,
            new_tokens: int, chunk: int) -> Run:
    engine = Engine(lm, EngineArgs(kv_cache_dtype=kv_cache_dtype, num_blocks=256,
                                   max_num_batched_tokens=chunk, max_num_seqs=4))
    engine.add_request("score", text_ids, SamplingParams(max_tokens=1, temperature=0.0,
                                                         prompt_logprobs=1))
    scored = _run_until_done(engine)["score"][1]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=2)
    engine.add_request("greedy", text_ids[:prompt_tokens], params)
    t0 = time.perf_counter()
    greedy, _, margins = _run_until_done(engine)["greedy"]
    elapsed = time.perf_counter() - t0
    engine.check_integrity()
    return Run([lp.top[0][0] for lp in scored], [lp.logprob for lp in scored], greedy,
               margins, len(greedy) / elapsed)


def _agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / max(1, len(a))


def compare(lm: LoadedModel, dtypes: list[str], runs: list[Run]) -> list[Result]:
    cfg = lm.config
    base = runs[0]
    base_ppl = math.exp(-sum(base.logprobs) / len(base.logprobs))
    base_bytes = bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                                 kv_quant(dtypes[0]))
    out = []
    for name, run in zip(dtypes, runs, strict=True):
        per_token = bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                                    kv_quant(name))
        ppl = math.exp(-sum(run.logprobs) / len(run.logprobs))
        diverged = [i for i, (x, y) in enumerate(zip(base.greedy, run.greedy, strict=True))
                    if x != y]
        margin = round(base.margins[diverged[0]], 4) if diverged else None
        out.append(Result(
            name, per_token, GIB // per_token, round(base_bytes / per_token, 3), round(ppl, 4),
            round(100 * (ppl / base_ppl - 1), 3), round(_agreement(base.top1, run.top1), 4),
            round(_agreement(base.greedy, run.greedy), 4), diverged[0] if diverged else None,
            margin, len(run.logprobs), len(run.greedy), round(run.decode_tps, 1)))
    return out


def format_table(model: str, dtype: str, results: list[Result]) -> str:
    lines = [f"model {model} (weights {dtype}), {torch.get_num_threads()} threads; baseline "
             f"KV cache: {results[0].kv_cache_dtype}",
             f"{'kv dtype':>9} {'B/token':>8} {'tok/GiB':>8} {'x cap':>6} {'ppl':>8} "
             f"{'dppl %':>7} {'tf agree':>8} {'greedy':>7} {'1st diff':>8} {'margin':>7} "
             f"{'dec tok/s':>9}"]
    for r in results:
        first = "-" if r.first_divergence is None else str(r.first_divergence)
        margin = "-" if r.baseline_margin_there is None else f"{r.baseline_margin_there:.3f}"
        lines.append(f"{r.kv_cache_dtype:>9} {r.kv_bytes_per_token:>8} {r.tokens_per_gib:>8} "
                     f"{r.capacity_vs_baseline:>6.2f} {r.perplexity:>8.3f} "
                     f"{r.perplexity_change_pct:>7.2f} {r.teacher_forced_agreement:>8.3f} "
                     f"{r.greedy_agreement:>7.3f} {first:>8} {margin:>7} {r.decode_tps:>9.1f}")
    n = results[0]
    lines.append(f"({n.num_scored_tokens} held-out tokens scored teacher-forced; "
                 f"{n.num_greedy_tokens} greedy tokens compared position by position; margin: "
                 "the baseline's top-1 minus top-2 logprob where greedy first differs)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench kvquant", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=default_model(),
                        help="Hugging Face directory or built-in name")
    parser.add_argument("--dtype", default="auto", help="weights dtype (auto: checkpoint's)")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=list(KV_CACHE_DTYPES),
                        choices=KV_CACHE_DTYPES, help="the first is the baseline")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=128, help="prefill chunk (tokens)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (more spin against each other on a busy machine)")
    parser.add_argument("--json", action="store_true", help="one JSON object per dtype")
    args = parser.parse_args(argv)
    if min(args.prompt_tokens, args.new_tokens, args.chunk) < 1:
        parser.error("--prompt-tokens, --new-tokens and --chunk must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(max(1, args.threads))
    try:
        lm = load_model(args.model, dtype=args.dtype)
    except (OSError, ValueError) as exc:
        parser.error(f"--model {args.model!r}: {exc}")
    if lm.tokenizer is None:
        parser.error(f"--model {args.model!r} has no tokenizer to encode the held-out text")
    text_ids = list(lm.tokenizer.encode(TEXT))
    runs = [run_one(lm, d, text_ids, args.prompt_tokens, args.new_tokens, args.chunk)
            for d in args.kv_cache_dtypes]
    results = compare(lm, args.kv_cache_dtypes, runs)
    for r in results:
        print(json.dumps({"bench": "kvquant", "model": args.model, **asdict(r)}))
    if not args.json:
        print(format_table(args.model, str(lm.config.dtype).removeprefix("torch."), results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
