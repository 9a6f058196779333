"""``pdserve sim --goodput``: the bisection on a known boundary, the two readings of the
attainment goal, the controller against the phase-1 split on a small cluster, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.controller.capacity import CapacityModel
from pdserve.controller.optimizer import Slo
from pdserve_bench.sim import cli
from pdserve_bench.sim.evaluate import Result, shifting
from pdserve_bench.sim.goodput import Search, evaluate_goodput, max_scale, mean_rate, passes
from pdserve_bench.sim.state import SimConfig
from pdserve_bench.sim.workload import Phase

PHASES = [Phase("a", 10, 2.0, 100, 10), Phase("b", 10, 1.0, 100, 10)]


def _result(attainment: float, by_phase: list[float]) -> Result:
    return Result("x", 1, 1, 0, 0.0, attainment, 0, None, None, None, None, 0.0,
                  phase_attainment=by_phase)


def _boundary(at: float, calls: list[float]):
    """A runner whose phase b fails above scale ``at`` (read from phase a's rate)."""
    def runner(phases: list[Phase]) -> Result:
        s = phases[0].rate / PHASES[0].rate
        calls.append(s)
        return _result(0.95, [1.0, 1.0 if s <= at else 0.5])
    return runner


def test_bisection_finds_the_boundary_within_tol() -> None:
    calls: list[float] = []
    s, r, runs = max_scale(_boundary(0.7, calls), PHASES, Search(tol=0.01))
    assert 0.7 / 1.01 <= s <= 0.7 and r is not None and runs == len(calls)
    assert calls[:2] == [0.05, 4.0]  # the bracket first
    assert max_scale(_boundary(0.01, []), PHASES, Search())[0] == 0.0  # not even lo passes
    assert max_scale(_boundary(9.0, []), PHASES, Search())[0] == 4.0  # hi passes


def test_the_goal_in_every_phase_or_over_the_run() -> None:
    r = _result(0.92, [1.0, 0.6])  # one phase fails, the run as a whole passes
    assert passes(r, Search(0.9, per_phase=False))
    assert not passes(r, Search(0.9, per_phase=True))
    assert mean_rate(PHASES) == pytest.approx(1.5)


def test_controller_serves_more_than_the_phase1_split() -> None:
    model = CapacityModel(0.002, 2000.0, 0.010, 0.0008, max_batch=64)
    slo, cfg = Slo(2.0, 0.1), SimConfig()
    chat, _, long = shifting(model, slo, 8, cfg, phase_s=60, load_factor=1.0)
    e = evaluate_goodput(8, [chat, long], model, cfg, slo, {"min_dwell_s": 20.0},
                         Search(tol=0.05), seed=2, grid_steps=3)
    fixed, ctl = e.by_name("fixed, best for phase 1"), e.by_name("controller")
    assert e.phase1_best.plan == fixed.plan == ctl.plan  # the controller starts there
    ratio = e.ratio()
    assert ratio is not None and ratio > 1.2
    assert ctl.result is not None and min(ctl.result.phase_attainment) >= 0.9
    assert e.to_json()["controller_vs_phase1_fixed"] == ratio


def test_cli_goodput_json_plot_and_user_errors(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    assert cli.main(["--goodput", "--instances", "4", "--phase-s", "15", "--grid-steps", "2",
                     "--goal-over", "run", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["goal"] == 0.9 and out["per_phase"] is False
    assert [p["name"] for p in out["points"]] == ["fixed, best for phase 1", "colocated",
                                                  "controller"]
    assert all(p["goodput"] == pytest.approx(p["scale"] * sum(q["rate"] for q in out["phases"])
                                             / 3) for p in out["points"])
    plot = tmp_path / "trace.png"
    assert cli.main(["--goodput", "--instances", "4", "--phase-s", "15", "--grid-steps", "2",
                     "--plot", str(plot)]) == 0
    out, err = capsys.readouterr()
    assert "controller / fixed best for phase 1:" in out
    assert f"decision trace: {plot}" in err and plot.read_bytes()[:4] == b"\x89PNG"
    for goal in ("0", "1.5"):
        with pytest.raises(SystemExit):
            cli.main(["--goodput", "--goal", goal])
        assert f"--goal must be in (0, 1], got {float(goal)}" in capsys.readouterr().err
