"""``pdserve sim``: fixed P:D ratios, colocated and the controller on a simulated cluster.

The per-instance costs come from a ``pdserve bench engine --json`` run (``--calibration``; by
default the 2-core measurement docs/benchmarks.md reports, shipped beside this module), fitted
by least squares into the controller's own capacity model. Prints a table, or JSON with
``--json``; ``--plot trace.png`` draws the controller's decision trace (ratio vs load).
``--goodput`` searches, per arrangement, the highest rate it serves at an SLO attainment goal
(DistServe's goodput; ``goodput.py``) instead of counting requests within the SLOs at --load.
``--validate RUN.json ...`` replays measured ``pdserve bench compare`` runs instead and prints
the simulated TTFT/ITL percentiles beside the measured ones (``validate.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdserve.controller.capacity import (
    CALIBRATION_FILE,
    CalibrationError,
    CapacityModel,
    from_bench_lines,
)
from pdserve.controller.optimizer import Slo
from pdserve_bench.sim import workload
from pdserve_bench.sim.control import TracePoint
from pdserve_bench.sim.evaluate import Evaluation, evaluate, shifting
from pdserve_bench.sim.goodput import Search, evaluate_goodput, format_goodput, scaled
from pdserve_bench.sim.state import SimConfig
from pdserve_bench.sim.validate import Replay, ValidationError, format_rows, validate

DEFAULT_CALIBRATION = Path(CALIBRATION_FILE)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--instances", type=int, nargs="+", default=[64], help="cluster sizes (8-512)")
    add("--calibration", type=Path, default=DEFAULT_CALIBRATION,
        help="`pdserve bench engine --json` output to fit the capacity model from")
    add("--prompt-len", type=int, default=128, help="the bench's --prompt-len")
    add("--max-batch", type=int, default=64, help="the engines' --max-num-seqs")
    add("--phase-s", type=float, default=120.0, help="seconds of each phase")
    add("--load", type=float, default=0.8,
        help="each phase's rate as a fraction of its best split's modelled capacity")
    add("--burst-cv", type=float, default=1.0, help="inter-arrival CV (1 Poisson, >1 bursty)")
    add("--seed", type=int, default=1)
    add("--ttft-slo", type=float, default=2.0, help="seconds")
    add("--tpot-slo", type=float, default=0.1, help="seconds")
    add("--link-gbps", type=float, default=10.0, help="KV link bandwidth, Gbit/s")
    add("--block-mib", type=float, default=1.0, help="KV bytes of one block (all layers), MiB")
    add("--switch-s", type=float, default=1.0, help="a flex role switch once drained")
    add("--interval-s", type=float, default=10.0, help="controller tick")
    add("--window-s", type=float, default=30.0, help="predictor window")
    add("--horizon-s", type=float, default=10.0, help="forecast horizon")
    add("--margin", type=float, default=0.1, help="hysteresis: the gain a switch needs")
    add("--min-dwell-s", type=float, default=30.0, help="least time between switches")
    add("--urgent-dwell-s", type=float, default=None,
        help="least time between switches while the plan cannot serve the forecast load "
             "(default: --min-dwell-s)")
    add("--stabilize-s", type=float, default=0.0,
        help="a new plan must be the best this long first while the plan in force keeps up "
             "(the router's --controller-stabilize)")
    add("--grid-steps", type=int, default=7, help="fixed ratios tried per cluster size")
    add("--json", action="store_true", help="one JSON object per cluster size")
    add("--plot", type=Path, default=None, help="PNG of the controller's decision trace")
    add("--validate", type=Path, nargs="+", default=[], metavar="RUN.json",
        help="replay these `pdserve bench compare` runs/<comparison>/<stack>.json files and "
             "compare simulated TTFT/ITL percentiles with the measured ones")
    add("--chunk-tokens", type=int, default=None,
        help="prompt tokens per prefill batch / colocated step (default 2048; with --validate "
             "512, the engines' --max-num-batched-tokens default)")
    add("--time-scale", type=float, default=1.0,
        help="multiply every calibrated cost (engines sharing cores run slower than the bench)")
    add("--ttft-offset-ms", type=float, default=0.0,
        help="--validate: a fixed latency added to every simulated TTFT (what the model leaves "
             "out: gateway, router, tokenization; read it off a low-rate run's ttft gap p50, "
             "or its ttft gap fit with --ttft-ms-per-token)")
    add("--ttft-ms-per-token", type=float, default=0.0,
        help="--validate: and this much per prompt token (the ttft gap fit's slope)")
    add("--handoff-ms", type=float, default=0.0,
        help="a prefilled request's fixed wait before its decode engine runs it (router call, "
             "kvd, import), besides the KV bytes over --link-gbps; read it off a low-rate "
             "disaggregated run's 'first gap +' row")
    add("--per-token-gaps", dest="chunked", action="store_false",
        help="--validate: one simulated gap per token, not grouped into the measured stream's "
             "chunks (what the run's ITL is made of)")
    add("--no-shared-cores", dest="shared_cores", action="store_false",
        help="--validate: ignore the stack's CPU pinning (engines never share a core)")
    add("--goodput", action="store_true",
        help="search each arrangement's goodput as DistServe defines it: the highest rate "
             "(a scale of every phase's --load 1 rate) with SLO attainment >= --goal")
    add("--goal", type=float, default=0.9, help="--goodput: the SLO attainment goal")
    add("--goal-over", choices=("phase", "run"), default="phase",
        help="--goodput: the goal holds in every phase, or over the whole run")
    add("--hindsight", action="store_true",
        help="--goodput: also search every fixed split on the whole workload")
    return p


def _check(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if min(a.instances) < 2:
        p.error("--instances: a disaggregated cluster needs at least 2 instances")
    if not a.calibration.is_file():
        p.error(f"--calibration {a.calibration}: no such file")
    positive = ("phase_s", "load", "burst_cv", "ttft_slo", "tpot_slo", "link_gbps", "block_mib",
                "interval_s", "window_s", "time_scale")
    bad = [f"--{k.replace('_', '-')}" for k in positive if getattr(a, k) <= 0]
    if bad:
        p.error(f"{', '.join(bad)} must be > 0")
    if a.urgent_dwell_s is not None and a.urgent_dwell_s < 0:
        p.error("--urgent-dwell-s must be >= 0")
    if a.stabilize_s < 0:
        p.error("--stabilize-s must be >= 0")
    if a.handoff_ms < 0:
        p.error("--handoff-ms must be >= 0")
    if a.chunk_tokens is not None and a.chunk_tokens < 1:
        p.error("--chunk-tokens must be >= 1")
    if not 0 < a.goal <= 1:
        p.error(f"--goal must be in (0, 1], got {a.goal}")


def format_table(e: Evaluation, phases: list[str]) -> str:
    head = (f"{'arrangement':<26} {'p':>4} {'d':>4} {'colo':>4} {'goodput':>8} "
            + " ".join(f"{n:>7}" for n in phases)
            + f" {'in SLO':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'sim s':>6}")
    lines = [head]
    for r in e.results:
        def ms(v: float | None) -> str:
            return f"{v * 1000:9.0f}" if v is not None else f"{'-':>9}"
        lines.append(f"{r.name:<26} {r.num_prefill:>4} {r.num_decode:>4} {r.num_colocated:>4} "
                     f"{r.goodput:>8.2f} " + " ".join(f"{g:>7.2f}" for g in r.phase_goodput)
                     + f" {r.attainment:>7.1%} {ms(r.ttft_p50_s)} {ms(r.ttft_p99_s)} "
                     f"{ms(r.tpot_p50_s)} {r.wall_s:>6.1f}")
    ratio = e.to_json()["controller_vs_phase1_fixed"]
    lines.append(f"controller / fixed best for phase 1: {ratio:.2f}x" if ratio else "")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    a = parser.parse_args(argv)
    _check(parser, a)
    try:
        model = from_bench_lines(a.calibration.read_text().splitlines(), a.prompt_len,
                                 a.max_batch)
    except (CalibrationError, json.JSONDecodeError) as exc:
        sys.stderr.write(f"pdserve sim: error: --calibration {a.calibration}: {exc}\n")
        return 2
    model = _scaled(model, a.time_scale)
    slo = Slo(a.ttft_slo, a.tpot_slo)
    chunk = a.chunk_tokens or (512 if a.validate else 2048)
    cfg = SimConfig(chunk_tokens=chunk, block_bytes=a.block_mib * (1 << 20),
                    link_bytes_per_s=a.link_gbps * 1.25e8, switch_s=a.switch_s,
                    handoff_s=a.handoff_ms / 1000)
    if a.validate:
        return _validate(a, model, cfg, slo)
    ctl = {"window_s": a.window_s, "horizon_s": a.horizon_s, "margin": a.margin,
           "min_dwell_s": a.min_dwell_s, "urgent_dwell_s": a.urgent_dwell_s,
           "stable_s": a.stabilize_s}
    if a.goodput:
        return _goodput(a, model, cfg, slo, ctl)
    for n in a.instances:
        phases = shifting(model, slo, n, cfg, a.phase_s, a.load)
        requests = workload.generate(phases, a.seed, a.burst_cv)
        e = evaluate(n, phases, requests, model, cfg, slo, ctl, a.grid_steps, a.interval_s)
        _print(a, e.to_json(), f"{n} instances, {len(requests)} requests, phases", phases,
               "; goodput req/s", format_table(e, [p.name for p in phases]))
        _plot(a, n, e.by_name("controller").trace, e.phases,
              f"P:D controller, {n} instances (simulated)")
    return 0


def _print(a: argparse.Namespace, doc: dict[str, Any], head: str,
           phases: list[workload.Phase], tail: str, table: str) -> None:
    """One cluster size's result: JSON with ``--json``, else a heading line and the table."""
    if a.json:
        print(json.dumps(doc))
        return
    print(f"{head} " + ", ".join(f"{p.name} {p.rate:.1f}/s" for p in phases)
          + f"; SLO TTFT {a.ttft_slo}s TPOT {a.tpot_slo}s{tail}")
    print(table)


def _plot(a: argparse.Namespace, n: int, trace: list[TracePoint], phases: list[workload.Phase],
          title: str) -> None:
    """``--plot``: the decision trace (one file per cluster size)."""
    if a.plot is None:
        return
    from pdserve_bench.sim.plot import trace_plot

    path = a.plot if len(a.instances) == 1 else a.plot.with_stem(f"{a.plot.stem}-{n}")
    trace_plot(path, trace, phases, title)
    print(f"decision trace: {path}", file=sys.stderr)


def _goodput(a: argparse.Namespace, model: CapacityModel, cfg: SimConfig, slo: Slo,
             ctl: dict[str, Any]) -> int:
    search = Search(a.goal, a.goal_over == "phase")
    for n in a.instances:
        phases = shifting(model, slo, n, cfg, a.phase_s, 1.0)
        e = evaluate_goodput(n, phases, model, cfg, slo, ctl, search, a.seed, a.burst_cv,
                             a.grid_steps, a.interval_s, a.hindsight)
        _print(a, e.to_json(), f"{n} instances; phases at scale 1", phases, "",
               format_goodput(e))
        top = e.by_name("controller")
        if top.result is not None:
            _plot(a, n, top.result.trace, scaled(phases, top.scale),
                  f"P:D controller, {n} instances, at its goodput (s = {top.scale:.2f})")
    return 0


def _scaled(m: CapacityModel, k: float) -> CapacityModel:
    return replace(m, prefill_overhead_s=m.prefill_overhead_s * k,
                   prefill_tokens_per_s=m.prefill_tokens_per_s / k,
                   decode_base_s=m.decode_base_s * k, decode_per_seq_s=m.decode_per_seq_s * k,
                   decode_points=tuple((b, t * k) for b, t in m.decode_points))


def _validate(a: argparse.Namespace, model: CapacityModel, cfg: SimConfig, slo: Slo) -> int:
    print(f"model: prefill {model.prefill_tokens_per_s:.0f} tok/s + "
          f"{model.prefill_overhead_s * 1000:.1f} ms/batch; decode step "
          f"{model.decode_base_s * 1000:.1f} ms + {model.decode_per_seq_s * 1000:.2f} ms/seq "
          f"(time scale {a.time_scale:g}); chunk {cfg.chunk_tokens} tokens"
          + (f"; steps interpolated between the {len(model.decode_points)} measured batches"
             if len(model.decode_points) >= 2 else ""))
    for path in a.validate:
        try:
            rows = validate(path, model, cfg, slo, Replay(
                a.shared_cores, a.ttft_offset_ms / 1000, a.ttft_ms_per_token / 1000,
                a.chunked))
        except ValidationError as exc:
            sys.stderr.write(f"pdserve sim: error: --validate {exc}\n")
            return 2
        if a.json:
            print(json.dumps({"run": str(path), "rows": rows}))
        else:
            print(format_rows(path.stem, rows))
    return 0
