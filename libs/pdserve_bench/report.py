"""``report.json``, ``report.md`` and the PNG plots of ``pdserve bench compare``.

A comparison's target is judged at one rate: the highest rate at which the baseline still
meets the TTFT objective (at least ``slo_attainment`` of its requests under ``slo_ttft_ms``),
because beyond it the baseline is overloaded and any ratio says more about queues than about
the design. If the baseline meets it at no rate, the lowest rate is used and the report says so.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdserve_bench.configs import Comparison, RunConfig
from pdserve_bench.plots import cdf_plot, latency_vs_rate
from pdserve_bench.runner import RunResult, write_json

TABLE_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms",
              "throughput_rps", "goodput_rps", "errors", "prefix_hit_rate")


@dataclass(frozen=True)
class SideResult:
    """One configuration's runs (one per rate) within a comparison."""

    stack: str
    description: str
    args: tuple[str, ...]
    runs: tuple[RunResult, ...]
    profile: str = ""  # summary of the profiles the stack left, if any


@dataclass(frozen=True)
class ComparisonResult:
    comparison: Comparison
    baseline: SideResult
    candidate: SideResult


@dataclass(frozen=True)
class Verdict:
    rate: float
    rate_reason: str
    baseline_value: float | None
    candidate_value: float | None
    reduction: float | None  # 1 - candidate / baseline
    met: bool | None  # None: a side has no value (every request failed)

    def sentence(self, cmp: Comparison) -> str:
        target = f"target >= {cmp.min_reduction:.0%} lower"
        if self.met is None or self.reduction is None:
            return f"**NOT MEASURED** at {self.rate:g} req/s: a side has no {cmp.metric} ({target})"
        b, c = self.baseline_value, self.candidate_value
        ratio = (b / c) if b and c else math.inf
        change = (f"{self.reduction:.1%} lower" if self.reduction >= 0
                  else f"{-self.reduction:.1%} higher")
        head = (f"{cmp.candidate} {cmp.metric} = {c:.1f} ms vs {cmp.baseline} {b:.1f} ms at "
                f"{self.rate:g} req/s: {change} ({ratio:.2f}x lower), {target}")
        if self.met:
            return f"**MET** — {head}."
        short = 100 * (cmp.min_reduction - self.reduction)
        return f"**MISSED** by {short:.1f} percentage points — {head}."


def ttft_attainment(run: RunResult, slo_ttft_ms: float) -> float:
    """Share of all requests (failed ones count as misses) with TTFT within the objective."""
    if not run.results:
        return 0.0
    good = sum(r.is_ok and r.ttft_s is not None and r.ttft_s * 1000.0 <= slo_ttft_ms
               for r in run.results)
    return good / len(run.results)


def judge(result: ComparisonResult, run: RunConfig) -> Verdict:
    cmp = result.comparison
    base = {r.rate: r for r in result.baseline.runs}
    cand = {r.rate: r for r in result.candidate.runs}
    rates = sorted(set(base) & set(cand))
    if not rates:
        raise ValueError(f"comparison {cmp.name!r}: the two sides share no rate")
    meeting = [r for r in rates if ttft_attainment(base[r], run.slo_ttft_ms) >= run.slo_attainment]
    slo = f"{run.slo_attainment:.0%} of requests with TTFT <= {run.slo_ttft_ms:g} ms"
    if meeting:
        rate = meeting[-1]
        reason = f"highest rate where {cmp.baseline} meets the TTFT SLO ({slo})"
    else:
        rate = rates[0]
        reason = f"lowest rate: {cmp.baseline} meets the TTFT SLO ({slo}) at no rate"
    b = base[rate].summary.flat().get(cmp.metric)
    c = cand[rate].summary.flat().get(cmp.metric)
    if b is None or c is None or b <= 0:
        return Verdict(rate, reason, b, c, None, None)
    reduction = 1.0 - float(c) / float(b)
    return Verdict(rate, reason, float(b), float(c), reduction, reduction >= cmp.min_reduction)


def _rate_json(rate: float) -> float | str:
    return rate if math.isfinite(rate) else "inf"


def _side_json(side: SideResult, rate: float) -> dict[str, Any]:
    at = next(r for r in side.runs if r.rate == rate)
    return {"description": side.description, "args": list(side.args),
            "at_verdict_rate": at.summary.flat(),
            "rates": [{"rate": _rate_json(r.rate), **r.summary.flat()} for r in side.runs]}


def report_json(results: list[ComparisonResult], run: RunConfig, command: str) -> dict[str, Any]:
    out: dict[str, Any] = {"command": command, "run": asdict(run), "comparisons": []}
    out["run"]["rates"] = [_rate_json(r) for r in run.rates]
    for res in results:
        cmp, v = res.comparison, judge(res, run)
        out["comparisons"].append({
            "name": cmp.name, "workload": cmp.workload.name, "metric": cmp.metric,
            "min_reduction": cmp.min_reduction, "baseline": cmp.baseline,
            "candidate": cmp.candidate,
            "verdict": {**asdict(v), "rate": _rate_json(v.rate), "text": v.sentence(cmp)},
            "configurations": {side.stack: _side_json(side, v.rate)
                               for side in (res.baseline, res.candidate)}})
    return out


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def _table(res: ComparisonResult) -> list[str]:
    keys = [k for k in TABLE_KEYS if k != "prefix_hit_rate" or any(
        "prefix_hit_rate" in r.summary.extra for s in (res.baseline, res.candidate)
        for r in s.runs)]
    lines = ["| configuration | rate (req/s) | " + " | ".join(keys) + " |",
             "|---|---:|" + "---:|" * len(keys)]
    for side in (res.baseline, res.candidate):
        for r in side.runs:
            flat = r.summary.flat()
            lines.append(f"| {side.stack} | {r.rate:g} | "
                         + " | ".join(_cell(flat.get(k)) for k in keys) + " |")
    return lines


def _plots(res: ComparisonResult, verdict: Verdict, out_dir: Path) -> list[Path]:
    name, sides = res.comparison.name, (res.baseline, res.candidate)
    at = {s.stack: next(r for r in s.runs if r.rate == verdict.rate) for s in sides}
    itl = {k: [x * 1000 for q in r.results if q.is_ok for x in q.itls_s] for k, r in at.items()}
    ttft = {k: [q.ttft_s * 1000 for q in r.results if q.is_ok and q.ttft_s is not None]
            for k, r in at.items()}
    per_rate = {m: {s.stack: [(r.rate, r.summary.flat().get(m)) for r in s.runs
                              if math.isfinite(r.rate)] for s in sides}
                for m in ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms")}
    suffix = f"{res.comparison.workload.name} @ {verdict.rate:g} req/s"
    return [
        cdf_plot(out_dir / "plots" / f"{name}_itl_cdf.png", f"ITL CDF, {suffix}", "ITL (ms)", itl),
        cdf_plot(out_dir / "plots" / f"{name}_ttft_cdf.png", f"TTFT CDF, {suffix}", "TTFT (ms)",
                 ttft),
        latency_vs_rate(out_dir / "plots" / f"{name}_latency_vs_rate.png",
                        f"{name}: latency vs request rate", per_rate),
    ]


def report_markdown(results: list[ComparisonResult], run: RunConfig, command: str,
                    out_dir: Path) -> str:
    lines = ["# pdserve serving benchmark", "", f"Command: `{command}`", "",
             f"Seed {run.seed}, {run.num_requests} requests per rate, rates "
             f"{', '.join(f'{r:g}' for r in run.rates)} req/s, API `{run.api}`, SLOs: TTFT <= "
             f"{run.slo_ttft_ms:g} ms, TPOT <= {run.slo_tpot_ms:g} ms (goodput = req/s meeting "
             "both). Latencies in ms."]
    for res in results:
        cmp, verdict = res.comparison, judge(res, run)
        lines += ["", f"## {cmp.name}: {cmp.candidate} vs {cmp.baseline} ({cmp.workload.name})",
                  "", *(f"- {s.stack}: {s.description} — `{_command(run, s)}`"
                        for s in (res.baseline, res.candidate)), "",
                  f"Target: {cmp.metric} of {cmp.candidate} at least {cmp.min_reduction:.0%} "
                  f"lower, judged at the {verdict.rate_reason}.", "",
                  verdict.sentence(cmp), "", *_table(res), ""]
        for path in _plots(res, verdict, out_dir):
            lines.append(f"![{path.stem}]({path.relative_to(out_dir).as_posix()})")
        slower = _slower(res, verdict)
        if slower is not None and slower.profile:
            lines += ["", f"Profile of the slower side ({slower.stack}):", "", "```",
                      slower.profile.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def _command(run: RunConfig, side: SideResult) -> str:
    return shlex.join([*run.launcher, *side.args, *run.stack_args])


def _slower(res: ComparisonResult, verdict: Verdict) -> SideResult | None:
    if verdict.baseline_value is None or verdict.candidate_value is None:
        return res.candidate if res.candidate.profile else res.baseline
    if verdict.candidate_value >= verdict.baseline_value:
        return res.candidate
    return res.baseline


def write_report(results: list[ComparisonResult], run: RunConfig, command: str,
                 out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "report.json", out_dir / "report.md"
    write_json(json_path, report_json(results, run, command))
    md_path.write_text(report_markdown(results, run, command, out_dir), encoding="utf-8")
    return json_path, md_path
