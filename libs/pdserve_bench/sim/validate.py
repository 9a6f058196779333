"""``pdserve sim --validate RUN.json``: the simulator against a measured real-stack run.

RUN.json is one stack's file from ``pdserve bench compare`` (``runs/<comparison>/<stack>.json``:
the stack's ``pdserve up`` arguments and every request it measured). Each rate's requests are
replayed through the simulator as they were sent (arrival offset, prompt and answer tokens) on
the arrangement those arguments start — ``--colocated --decode N``, ``--prefill P --decode D``,
and with ``--controller in-place`` the simulated controller at the router's settings
(``--router-arg=--controller-interval=…`` etc.) — and the simulated TTFT and inter-token
latency percentiles are printed beside the measured ones, with the relative error.

Simulated ITL: the gaps between a request's simulated tokens grouped into the chunks its real
stream sent (``chunks.py``; ``--per-token-gaps``: each decode step's duration, once per
sequence in it); a request's first gap after its first token includes the stall until its
first decode step ends (hand-off, KV transfer, queue).
Engines pinned to one CPU set (``--prefill-cpus``/``--decode-cpus``) share it: while k of them
compute, each runs at 1/k of its speed (``sharing.py``; ``--no-shared-cores`` turns it off).
Not modelled: the gateway and router hops, tokenization, streaming, and the other processes on
the cores (kvd, router, gateway; ``--time-scale`` stretches every modelled cost by one factor).
``--ttft-offset-ms`` (+ ``--ttft-ms-per-token`` × prompt tokens) adds what the model leaves out
of every TTFT; each row's ``ttft gap`` (measured − simulated TTFT, request by request, before
the offset: its p50, and its Theil-Sen line over the prompt length) on a low-rate run is
the value to pass — measured on one run, then checked on the others. Likewise ``--handoff-ms``
(a prefilled request's fixed wait before its decode engine runs it) from the ``first gap +``
row of a disaggregated stack: per request, its first decode gap less the median of its later
ones, p50 (a colocated stack's is the control: it has no hand-off).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.controller.capacity import CapacityModel
from pdserve.controller.optimizer import Plan, Slo
from pdserve_bench.sim.chunks import chunk_gaps, chunk_sizes
from pdserve_bench.sim.cluster import Sim
from pdserve_bench.sim.control import SimController
from pdserve_bench.sim.evaluate import optimizer_cluster
from pdserve_bench.sim.state import SimConfig
from pdserve_bench.sim.workload import SimRequest

# The router's controller defaults (services/router/config.py), overridden by --router-arg.
ROUTER_DEFAULTS = {"interval": 10.0, "window": 30.0, "dwell": 30.0, "margin": 0.1,
                   "stabilize": 0.0}


class ValidationError(ValueError):
    """RUN.json is not a ``pdserve bench compare`` stack file the simulator can replay."""


@dataclass(frozen=True)
class Arrangement:
    plan: Plan
    controller: dict[str, float] | None  # the router's controller settings, when it runs one
    cores: list[str] | None = None  # per engine, its CPU set (``--prefill-cpus`` etc.)


def _flag(args: list[str], name: str, default: int) -> int:
    return int(args[args.index(name) + 1]) if name in args else default


def _cpu_sets(args: list[str], name: str, count: int) -> list[str] | None:
    """The CPU set of each of ``count`` engines, cycled as ``pdserve up`` does; None when
    ``name`` is not given (the engines float over every core)."""
    spec = args[args.index(name) + 1] if name in args else ""
    sets = [s for s in spec.split(";") if s]
    return [sets[i % len(sets)] for i in range(count)] if sets else None


def _cores(args: list[str], plan: Plan) -> list[str] | None:
    """Per engine (prefill first), the CPU set it is pinned to, when every engine is."""
    prefill = _cpu_sets(args, "--prefill-cpus", plan.num_prefill) if plan.num_prefill else []
    decode = _cpu_sets(args, "--decode-cpus", plan.num_decode + plan.num_colocated)
    return None if prefill is None or decode is None else prefill + decode


def arrangement(args: list[str]) -> Arrangement:
    """The engines a ``pdserve up`` argument list starts (later flags win, as in argparse)."""
    args = list(args)
    decode = _flag(args, "--decode", 1)
    if "--colocated" in args:
        plan = Plan(0, 0, decode)
        return Arrangement(plan, None, _cores(args, plan))
    plan = Plan(_flag(args, "--prefill", 1), decode)
    if "--controller" not in args:
        return Arrangement(plan, None, _cores(args, plan))
    settings = dict(ROUTER_DEFAULTS)
    for a in args:
        if a.startswith("--router-arg=--controller-"):
            key, _, value = a.removeprefix("--router-arg=--controller-").partition("=")
            if key in settings:
                settings[key] = float(value)
    return Arrangement(plan, settings, _cores(args, plan))


def load_runs(path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    try:
        doc = json.loads(path.read_text())
        runs = list(doc["runs"])
        for run in runs:
            float(run["rate"]), list(run["requests"])
        return [str(a) for a in doc["args"]], runs
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValidationError(f"{path}: not a `pdserve bench compare` runs/<comparison>/"
                              f"<stack>.json file ({exc})") from None


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _weighted_pct(pairs: list[tuple[float, int]], q: float) -> float:
    pairs = sorted(p for p in pairs if p[1] > 0)
    if not pairs:
        return float("nan")
    weights = np.cumsum([n for _, n in pairs])
    i = int(np.searchsorted(weights, q / 100 * weights[-1]))
    return pairs[min(i, len(pairs) - 1)][0]


@dataclass(frozen=True)
class Replay:
    """How a run is replayed: engines sharing their CPU sets, what the model leaves out of a
    TTFT (``ttft_fixed_s`` + ``ttft_per_token_s`` × prompt tokens), and simulated tokens
    grouped into the measured stream's chunks (``chunks.py``) or one gap per token."""

    shared_cores: bool = True
    ttft_fixed_s: float = 0.0
    ttft_per_token_s: float = 0.0
    chunked: bool = True

    def ttft_offset(self, input_len: int) -> float:
        return self.ttft_fixed_s + self.ttft_per_token_s * input_len


def _first_gap_excess(requests: list[dict[str, Any]]) -> float:
    """p50 over requests of (first decode gap − the median of its later gaps)."""
    excess = [r["itls_s"][0] - float(np.median(r["itls_s"][1:]))
              for r in requests if len(r["itls_s"]) >= 3]
    return _pct(excess, 50)


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Theil-Sen (intercept, slope): the median of the pairwise slopes, so one stalled request
    does not tilt it (least squares did); NaN when the x values do not vary."""
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points)
              for x2, y2 in points[i + 1:] if x2 != x1]
    if not slopes:
        return float("nan"), float("nan")
    slope = float(np.median(slopes))
    return float(np.median([y - slope * x for x, y in points])), slope


def simulate(run: dict[str, Any], arr: Arrangement, model: CapacityModel, cfg: SimConfig,
             slo: Slo, replay: Replay = Replay()) -> dict[str, float]:
    ok = sorted((r for r in run["requests"]
                 if r.get("error") is None and r.get("ttft_s") is not None),
                key=lambda r: r["start_s"])
    requests = [SimRequest(i, float(r["start_s"]), max(1, int(r["tokens_in"])),
                           max(1, int(r["tokens_out"]))) for i, r in enumerate(ok)]
    plan = arr.plan
    roles = ["colocated"] * plan.num_colocated or \
        ["prefill"] * plan.num_prefill + ["decode"] * plan.num_decode
    ctl, tick = None, 10.0
    if arr.controller is not None:
        c = arr.controller
        ctl = SimController(model, slo, optimizer_cluster(len(roles), cfg), plan, c["window"],
                            c["interval"], c["margin"], c["dwell"], stable_s=c["stabilize"])
        tick = c["interval"]
    sim = Sim(model, cfg, roles, ctl.tick if ctl else None, tick,
              arr.cores if replay.shared_cores else None)
    sim.itl, sim.token_times = [], {}
    if ctl is not None:
        sim.on_arrival = ctl.observe
    end = max((r.t for r in requests), default=0.0)
    done = sim.run(requests, until=end + 600.0)
    measured_itl = [g for r in ok for g in r["itls_s"]]
    sim_ttft = [r.t_first - r.r.t + replay.ttft_offset(r.r.input_len) for r in done]
    sim_itl = sim.itl if not replay.chunked else [
        (g, 1) for r in done for g in chunk_gaps(
            sim.token_times.get(r.r.rid, [r.t_first]),
            chunk_sizes(ok[r.r.rid]["itls_s"], r.r.output_len - 1))]
    # measured - simulated TTFT, request by request, before the offset: what a low-rate run
    # says the model leaves out (the values to pass as --ttft-offset-ms, --ttft-ms-per-token)
    gaps = [(r.r.input_len, ok[r.r.rid]["ttft_s"] - (r.t_first - r.r.t)) for r in done]
    gap_fixed_s, gap_per_token_s = _line(gaps)
    return {
        "rate": float(run["rate"]), "requests": len(requests), "simulated": len(done),
        "switches": len({(p.num_prefill, p.num_decode) for p in ctl.trace}) - 1 if ctl else 0,
        "ttft_p50_ms": 1000 * _pct([r["ttft_s"] for r in ok], 50),
        "sim_ttft_p50_ms": 1000 * _pct(sim_ttft, 50),
        "ttft_p90_ms": 1000 * _pct([r["ttft_s"] for r in ok], 90),
        "sim_ttft_p90_ms": 1000 * _pct(sim_ttft, 90),
        "ttft_p99_ms": 1000 * _pct([r["ttft_s"] for r in ok], 99),
        "sim_ttft_p99_ms": 1000 * _pct(sim_ttft, 99),
        "ttft_gap_p50_ms": 1000 * _pct([g for _, g in gaps], 50),
        "ttft_gap_fixed_ms": 1000 * gap_fixed_s, "ttft_gap_ms_per_token": 1000 * gap_per_token_s,
        "first_gap_excess_p50_ms": 1000 * _first_gap_excess(ok),
        "itl_p50_ms": 1000 * _pct(measured_itl, 50),
        "sim_itl_p50_ms": 1000 * _weighted_pct(sim_itl, 50),
        "itl_p90_ms": 1000 * _pct(measured_itl, 90),
        "sim_itl_p90_ms": 1000 * _weighted_pct(sim_itl, 90),
        "itl_p99_ms": 1000 * _pct(measured_itl, 99),
        "sim_itl_p99_ms": 1000 * _weighted_pct(sim_itl, 99),
    }


METRICS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms")


def format_rows(name: str, rows: list[dict[str, float]]) -> str:
    out = [f"{'stack':<20} {'rate':>5} {'metric':<12} {'measured':>9} {'simulated':>9} "
           f"{'error':>7}"]
    for row in rows:
        out.append(f"{name:<20} {row['rate']:>5g} {'ttft gap p50':<12} "
                   f"{row['ttft_gap_p50_ms']:>9.1f} (measured - simulated, per request, "
                   "before --ttft-offset-ms)")
        out.append(f"{name:<20} {row['rate']:>5g} {'ttft gap fit':<12} "
                   f"{row['ttft_gap_fixed_ms']:>9.1f} ms + {row['ttft_gap_ms_per_token']:.3f} "
                   "ms/prompt token (Theil-Sen, the same gaps)")
        out.append(f"{name:<20} {row['rate']:>5g} {'first gap +':<12} "
                   f"{row['first_gap_excess_p50_ms']:>9.1f} (measured first decode gap - "
                   "its request's later median, p50; --handoff-ms)")
        for m in METRICS:
            real, sim = row[m], row[f"sim_{m}"]
            err = (sim - real) / real if real else float("nan")
            out.append(f"{name:<20} {row['rate']:>5g} {m:<12} {real:>9.1f} {sim:>9.1f} "
                       f"{err:>+7.0%}")
    return "\n".join(out)


def validate(path: Path, model: CapacityModel, cfg: SimConfig, slo: Slo,
             replay: Replay = Replay()) -> list[dict[str, float]]:
    args, runs = load_runs(path)
    arr = arrangement(args)
    return [simulate(run, arr, model, cfg, slo, replay) for run in runs]
