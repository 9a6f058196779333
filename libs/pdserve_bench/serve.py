"""``pdserve bench serve``: open-loop load against an OpenAI-compatible server or the router.

    pdserve bench serve --base-url http://127.0.0.1:8000/v1 --workload mixed --rates 1,2,4 \\
        --num-requests 100 --slo-ttft-ms 2000 --slo-tpot-ms 200 --out serve.json
    pdserve bench serve --router 127.0.0.1:50051 --workload multiturn --rate 2 --duration 60

Prints one table per rate and writes every request's timings to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from pdserve_bench.client import APIS
from pdserve_bench.runner import (
    LoadSettings,
    RunResult,
    Target,
    run_load,
    settings_json,
    write_json,
)
from pdserve_bench.stats import format_table
from pdserve_bench.workload import WORKLOADS, CountTokens, PromptMaker, WorkloadSpec


def _positive(kind: type[float] | type[int]) -> Callable[[str], float | int]:
    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value

    return parse


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"every rate must be > 0 (inf = burst), got {text!r}")
    return rates


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="OpenAI-compatible base URL, e.g. http://host:8000/v1")
    where.add_argument("--router", help="pdserve router gRPC address host:port")
    p.add_argument("--api", choices=APIS, default="chat", help="HTTP endpoint (default chat)")
    p.add_argument("--model", help="model name (default: the server's first listed model)")
    p.add_argument("--api-key", help="bearer token for the HTTP server")
    p.add_argument("--workload", choices=WORKLOADS, default="mixed")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=_positive(float), help="requests/s (Poisson; inf = burst)")
    rate.add_argument("--rates", type=_rates, help="a sweep, e.g. 1,2,4")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--num-requests", type=_positive(int), help="requests per rate (100)")
    size.add_argument("--duration", type=_positive(float), help="seconds of arrivals per rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=_positive(float), default=120.0, help="seconds")
    p.add_argument("--slo-ttft-ms", type=_positive(float), help="TTFT objective for goodput")
    p.add_argument("--slo-tpot-ms", type=_positive(float), help="TPOT objective for goodput")
    p.add_argument("--warmup", type=int, default=0, help="requests sent (unmeasured) first")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos (for servers that reject unknown fields)")
    p.add_argument("--continuous-usage", action="store_true",
                   help="ask for per-chunk usage (vLLM stream_options.continuous_usage_stats)")
    p.add_argument("--tokenizer-model",
                   help="built-in model name (tiny, bench-50m) or HF directory: exact prompt "
                        "token counts; default ~1 token per word")
    p.add_argument("--tokens-per-word", type=_positive(float), default=1.0)
    p.add_argument("--block-size", type=_positive(int), default=16,
                   help="the server's KV block size (for the multiturn reuse oracle)")
    p.add_argument("--out", type=Path, help="write every request's timings here (JSON)")
    p.add_argument("--no-progress", action="store_true")
    return p


def token_counter(model: str) -> CountTokens:
    """Prompt token counts as the served model's tokenizer sees them."""
    from pdserve.tokenizer import Tokenizer

    if Path(model).is_dir():
        tokenizer = Tokenizer.from_dir(model)
    else:
        from pdserve.models import BUILTIN_MODELS, builtin_tokenizer

        if model.split("@")[0] not in BUILTIN_MODELS:
            raise ValueError(f"--tokenizer-model must be a directory or one of "
                             f"{', '.join(BUILTIN_MODELS)}, got {model!r}")
        tokenizer = builtin_tokenizer()
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def print_runs(runs: list[RunResult], workload: str) -> None:
    for run in runs:
        print(format_table(run.summary, f"== {workload} @ {run.rate:g} req/s"), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.warmup < 0:
        parser.error("argument --warmup: must be >= 0")
    try:
        target = Target(base_url=ns.base_url or "", router=ns.router or "", api=ns.api,
                        model=ns.model, ignore_eos=not ns.no_ignore_eos,
                        temperature=ns.temperature, continuous_usage=ns.continuous_usage,
                        api_key=ns.api_key)
        load = LoadSettings(
            workload=WorkloadSpec(ns.workload), rates=ns.rates or (ns.rate or 1.0,),
            seed=ns.seed, num_requests=None if ns.duration else (ns.num_requests or 100),
            duration_s=ns.duration, request_timeout_s=ns.request_timeout,
            slo_ttft_ms=ns.slo_ttft_ms, slo_tpot_ms=ns.slo_tpot_ms, warmup_requests=ns.warmup,
            progress=not ns.no_progress, block_size=ns.block_size)
        counter = token_counter(ns.tokenizer_model) if ns.tokenizer_model else None
    except ValueError as e:
        parser.error(str(e))
    maker = PromptMaker(counter, ns.tokens_per_word)
    try:
        runs = run_load(target, load, maker)
    except RuntimeError as e:  # setup failures (model listing); request failures are counted
        print(f"pdserve bench serve: error: {e}", file=sys.stderr)
        return 1
    print_runs(runs, ns.workload)
    if ns.out:
        write_json(ns.out, {"settings": settings_json(target, load),
                            "runs": [run.to_json() for run in runs]})
        print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

