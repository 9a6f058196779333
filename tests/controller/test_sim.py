"""``pdserve sim``: the workload generator, the event loop's exact timings on tiny cases,
role switches losing no request, the controller against a mismatched fixed split, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.controller.capacity import CapacityModel
from pdserve.controller.optimizer import Plan, Slo
from pdserve_bench.sim import cli
from pdserve_bench.sim.cluster import Sim
from pdserve_bench.sim.control import apply
from pdserve_bench.sim.evaluate import evaluate, grid, shifting
from pdserve_bench.sim.state import SimConfig
from pdserve_bench.sim.workload import Phase, SimRequest, generate

# 1000 prompt tokens/s + 5 ms a batch; decode steps 10 ms + 1 ms per sequence
MODEL = CapacityModel(0.005, 1000.0, 0.010, 0.001, max_batch=4)
CFG = SimConfig(chunk_tokens=256, block_size=16, block_bytes=1000.0, link_bytes_per_s=1e6,
                switch_s=0.5)


def test_workload_is_seeded_and_keeps_its_rates() -> None:
    phases = [Phase("a", 200, 5.0, 100, 10), Phase("b", 200, 1.0, 1000, 50)]
    reqs = generate(phases, seed=3)
    assert reqs == generate(phases, seed=3) and reqs != generate(phases, seed=4)
    first = [r for r in reqs if r.t < 200]
    assert len(first) == pytest.approx(1000, rel=0.1)
    assert len(reqs) - len(first) == pytest.approx(200, rel=0.2)
    assert all(50 <= r.input_len <= 150 for r in first)
    bursty = generate([Phase("a", 400, 5.0, 100, 10)], seed=3, burst_cv=3.0)
    gaps = np.diff([r.t for r in bursty])
    assert np.std(gaps) / np.mean(gaps) > 2  # clumps and lulls, same mean rate
    with pytest.raises(ValueError, match="burst_cv must be > 0"):
        generate(phases, 1, burst_cv=0)
    with pytest.raises(ValueError, match="phase a: rate and duration must be > 0"):
        generate([Phase("a", 10, 0.0, 1, 1)], 1)


def test_one_request_disaggregated_exact_timing() -> None:
    sim = Sim(MODEL, CFG, ["prefill", "decode"])
    [req] = sim.run([SimRequest(0, 1.0, 40, 5)], until=100)
    assert req.t_first == pytest.approx(1.0 + 0.005 + 0.040)  # prefill_time(40)
    # 3 blocks · 1000 B / 1 MB/s = 3 ms transfer, then 4 steps of a batch of one (11 ms)
    assert req.t_done == pytest.approx(req.t_first + 0.003 + 4 * 0.011)


def test_decode_batches_and_caps_at_max_batch() -> None:
    reqs = [SimRequest(i, 0.0, 10, 3) for i in range(6)]  # 6 at once, max_batch 4
    cfg = SimConfig(chunk_tokens=10_000, link_bytes_per_s=1e12)  # a transfer of ~1 µs
    sim = Sim(MODEL, cfg, ["prefill", "decode"])
    done = sim.run(reqs, until=100)
    assert len(done) == 6
    # the first arrival starts a batch alone (15 ms); the other five form the next (55 ms)
    assert [r.t_first for r in done[:1]] == pytest.approx([0.015])
    assert all(r.t_first == pytest.approx(0.070) for r in done[1:])
    # the first decodes alone (2 steps of 11 ms, done at 37 ms). Of the five, the first KV to
    # land starts a step alone (11 ms); three join at the next step boundary, the fifth waits
    # for room: steps of 14 ms, 14 ms (the fifth joins as the first leaves), then 11 ms
    assert [r.t_done for r in done] == pytest.approx([0.037, 0.095, 0.109, 0.109, 0.109, 0.120],
                                                     abs=1e-5)
    assert done[-1].t_admit == pytest.approx(0.095, abs=1e-5)


def test_a_prompt_goes_to_the_idle_prefill_not_the_busy_one() -> None:
    # the first prompt's batch holds instance 0 for 0.505 s; with nothing queued on either,
    # the second must still go to instance 1 (the router counts in-flight prefills)
    sim = Sim(MODEL, CFG, ["prefill", "prefill", "decode"])
    done = sim.run([SimRequest(0, 0.0, 500, 2), SimRequest(1, 0.1, 500, 2)], until=100)
    assert sorted(r.t_first for r in done) == pytest.approx([0.505, 0.605])


def test_colocated_prompt_rides_in_a_step() -> None:
    sim = Sim(MODEL, CFG, ["colocated"])
    [req] = sim.run([SimRequest(0, 0.0, 100, 3)], until=100)
    # the step's 100 rows cost prefill_time(100) (5 ms + 100 tokens), more than the decode
    # curve's step of 4 (the largest batch), 14 ms
    assert req.t_first == pytest.approx(0.105)
    assert req.t_done == pytest.approx(req.t_first + 2 * 0.011)


def test_switching_roles_drains_first_and_loses_nothing() -> None:
    reqs = generate([Phase("a", 20, 20.0, 100, 20)], seed=1)
    sim = Sim(MODEL, CFG, ["prefill", "prefill", "decode", "decode"])
    switched = []

    def flip(s: Sim, now: float) -> None:
        if 5 <= now < 6:
            apply(s, Plan(1, 3))
            switched.append([i.planned_role for i in s.insts])

    sim.on_tick, sim.tick_s = flip, 1.0
    sim.push(0.0, 5, None)  # the first tick
    done = sim.run(reqs, until=200)
    assert len(done) == len(reqs)  # every request finished, none dropped by the switch
    assert sorted(switched[0]) == ["decode", "decode", "decode", "prefill"]
    assert sorted(i.role for i in sim.insts) == ["decode", "decode", "decode", "prefill"]


def test_grid() -> None:
    assert grid(5) == [1, 2, 3, 4]
    assert grid(64) == [8, 16, 24, 32, 40, 48, 56]


def test_controller_beats_the_fixed_split_tuned_for_the_first_phase() -> None:
    model = CapacityModel(0.002, 2000.0, 0.010, 0.0008, max_batch=64)
    slo, cfg = Slo(2.0, 0.1), SimConfig()
    chat, _, long = shifting(model, slo, 8, cfg, phase_s=60, load_factor=0.8)
    reqs = generate([chat, long], seed=2)
    e = evaluate(8, [chat, long], reqs, model, cfg, slo, {"min_dwell_s": 20.0})
    fixed, ctl = e.by_name("fixed, best for phase 1"), e.by_name("controller")
    assert ctl.goodput > 1.1 * fixed.goodput
    # long answers: the chat split runs out of decode batch room; the controller moved
    # instances to decode
    assert ctl.phase_goodput[1] > 1.3 * fixed.phase_goodput[1]
    assert ctl.trace[-1].num_decode > fixed.num_decode


def test_cli_json_and_user_errors(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    assert cli.main(["--instances", "4", "--phase-s", "15", "--grid-steps", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_instances"] == 4 and [p["name"] for p in out["phases"]] == \
        ["chat", "rag", "long"]
    assert {r["name"] for r in out["results"]} >= {"fixed, best for phase 1", "colocated",
                                                   "controller"}
    with pytest.raises(SystemExit):
        cli.main(["--instances", "1"])
    assert "needs at least 2 instances" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--stabilize-s", "-1"])
    assert "--stabilize-s must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--tpot-slo", "0", "--load", "-1"])
    assert "--load, --tpot-slo must be > 0" in capsys.readouterr().err
    bad = tmp_path / "bench.jsonl"
    bad.write_text('{"num_seqs": 1, "pdserve_decode_tps": 90, "pdserve_prefill_tps": 900}\n')
    assert cli.main(["--calibration", str(bad)]) == 2
    assert "need points at two or more distinct sizes" in capsys.readouterr().err
