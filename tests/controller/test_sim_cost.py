"""The simulator's step cost (a step costs its rows), the measured stream's chunks, the KV
hand-off and the TTFT gap fit of ``pdserve sim --validate``: tables with exact values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.controller.capacity import CapacityModel
from pdserve.controller.optimizer import Plan, Slo
from pdserve_bench.sim import cli, steps
from pdserve_bench.sim.chunks import chunk_gaps, chunk_sizes
from pdserve_bench.sim.cluster import Sim
from pdserve_bench.sim.cost import step_cost
from pdserve_bench.sim.state import SimConfig
from pdserve_bench.sim.validate import Arrangement, Replay, _line, simulate
from pdserve_bench.sim.workload import SimRequest

# prefill 1000 tokens/s, no batch overhead; decode steps measured at 1, 4 and 32 sequences
MODEL = CapacityModel(0.0, 1000.0, 0.010, 0.001, max_batch=64,
                      decode_points=((1, 0.020), (4, 0.030), (32, 0.050)))


@pytest.mark.parametrize(("num_decodes", "prompt", "seconds", "old_additive"), [
    (4, 0, 0.030, 0.030),      # decode only: the measured step
    (0, 30, 0.048571, 0.040),  # a short prompt alone costs a step of 30 rows
    (4, 28, 0.050, 0.058),     # 32 rows: the largest measured step
    (1, 45, 0.050, 0.065),     # 46 rows: the decode curve capped at 32 still beats 46 ms
    (4, 448, 0.452, 0.478),    # a long chunk: its rows at the prefill rate, decodes ride
    (10, 100, 0.110, 0.134286),  # past the largest measured batch: never the fitted line
])
def test_a_step_costs_its_rows(num_decodes: int, prompt: int, seconds: float,
                               old_additive: float) -> None:
    assert step_cost(MODEL, num_decodes, prompt) == pytest.approx(seconds, abs=1e-6)
    if prompt:  # the replaced model (decode step + prompt / rate) differs in every such row
        old = MODEL.step_time(num_decodes) + prompt / MODEL.prefill_tokens_per_s
        assert old == pytest.approx(old_additive, abs=1e-6)
        assert old != pytest.approx(seconds, abs=1e-6)


def test_without_measured_points_the_cap_is_max_batch() -> None:
    line = CapacityModel(0.005, 1000.0, 0.010, 0.001, max_batch=4)
    assert step_cost(line, 0, 2) == pytest.approx(0.012)  # step_time(2) > 5 ms + 2 ms
    assert step_cost(line, 2, 100) == pytest.approx(0.107)  # prefill_time(102)


def test_the_simulated_engines_step_at_that_cost() -> None:
    cfg = SimConfig(chunk_tokens=512, link_bytes_per_s=1e12)
    # a prefill instance: a 30-token prompt takes a 30-row step (48.6 ms), not 30 ms
    sim = Sim(MODEL, cfg, ["prefill", "decode"])
    [req] = sim.run([SimRequest(0, 0.0, 30, 1)], until=10.0)
    assert req.t_first == pytest.approx(0.048571, abs=1e-6)
    # colocated: 4 one-token prompts at 0: the first alone (a 1-row step, 20 ms), the other
    # three beside it (4 rows, 30 ms), then 4 decodes (30 ms steps); a 448-token prompt at
    # 0.505 s joins the step that starts at 0.53 s, which costs 452 ms (the additive: 478)
    sim = Sim(MODEL, cfg, ["colocated"])
    reqs = [SimRequest(i, 0.0, 1, 1000) for i in range(4)] + [SimRequest(4, 0.505, 448, 1)]
    [req] = sim.run(reqs, until=0.99)
    assert req.r.rid == 4 and req.t_first == pytest.approx(0.020 + 17 * 0.030 + 0.452)


@pytest.mark.parametrize(("gaps", "num_tokens", "sizes"), [
    ([], 5, []),                        # the whole answer came with the first token
    ([0.02, 0.02], 2, [1, 1]),          # nothing held back
    ([0.02, 0.10, 0.02], 7, [1, 5, 1]),  # one chunk held 5 tokens
    ([0.02, 0.03], 4, [2, 2]),          # shares 1.6, 2.4: the largest remainder rounds up
    ([0.02, 0.02, 0.02], 2, [1, 1, 1]),  # never below one token a chunk
    ([0.001, 0.001, 0.1], 4, [1, 1, 2]),  # shares 0.04, 0.04, 3.92: trimmed to the total
])
def test_chunk_sizes(gaps: list[float], num_tokens: int, sizes: list[int]) -> None:
    assert chunk_sizes(gaps, num_tokens) == sizes


def test_chunk_gaps_group_token_times() -> None:
    times = [0.0, 0.1, 0.2, 0.3, 0.4]
    assert chunk_gaps(times, [1, 3]) == pytest.approx([0.1, 0.3])
    assert chunk_gaps(times, [2, 5]) == pytest.approx([0.2])  # the simulation ended first


def _run(tmp_path: Path, itls: list[float], tokens_out: int) -> dict:
    results = [{"start_s": 0.0, "ttft_s": 0.2, "itls_s": itls, "tokens_in": 100,
                "tokens_out": tokens_out, "error": None}]
    return {"rate": 1.0, "requests": results}


# 1000 prompt tokens/s + 5 ms a batch; decode steps 10 ms + 1 ms per sequence; 1 kB blocks
LINE = CapacityModel(0.005, 1000.0, 0.010, 0.001, max_batch=4)
CFG = SimConfig(chunk_tokens=256, block_size=16, block_bytes=1000.0, link_bytes_per_s=1e6)


def test_validate_groups_tokens_into_the_measured_chunks(tmp_path: Path) -> None:
    run = _run(tmp_path, [0.02, 0.06], 5)  # 4 decode tokens in 2 chunks: 1, then 3
    arr = Arrangement(Plan(1, 1), None)
    # prefill 105 ms; KV 7 blocks = 7 ms; steps of one sequence 11 ms: tokens at 0.105,
    # 0.123, 0.134, 0.145, 0.156
    chunked = simulate(run, arr, LINE, CFG, Slo(1.0, 0.1))
    assert chunked["sim_itl_p99_ms"] == pytest.approx(33.0)  # 3 steps in one chunk
    per_token = simulate(run, arr, LINE, CFG, Slo(1.0, 0.1), Replay(chunked=False))
    assert per_token["sim_itl_p99_ms"] == pytest.approx(18.0)  # the KV + first step
    handed = simulate(run, arr, LINE, SimConfig(chunk_tokens=256, block_size=16,
                                                block_bytes=1000.0, link_bytes_per_s=1e6,
                                                handoff_s=0.030), Slo(1.0, 0.1))
    assert handed["sim_itl_p50_ms"] == pytest.approx(33.0)  # the first gap: 30 + 7 + 11 ms
    assert handed["sim_itl_p99_ms"] == pytest.approx(48.0)


def test_first_gap_excess_and_ttft_gap_fit(tmp_path: Path) -> None:
    row = simulate(_run(tmp_path, [0.05, 0.02, 0.02], 4), Arrangement(Plan(1, 1), None), LINE,
                   CFG, Slo(1.0, 0.1))
    assert row["first_gap_excess_p50_ms"] == pytest.approx(30.0)
    # Theil-Sen: one outlier in five does not tilt the line (least squares would)
    assert _line([(1, 1), (2, 2), (3, 3), (4, 4), (5, 100)]) == pytest.approx((0.0, 1.0))
    assert _line([(1, 1), (1, 2)]) != _line([(1, 1), (1, 2)])  # NaN: no spread in x


def test_handoff_must_not_be_negative(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"args": [], "runs": [_run(tmp_path, [0.02], 2)]}))
    with pytest.raises(SystemExit):
        cli.main(["--validate", str(path), "--handoff-ms", "-1"])
    assert "--handoff-ms must be >= 0" in capsys.readouterr().err
    assert cli.main(["--validate", str(path), "--handoff-ms", "30"]) == 0
    out = capsys.readouterr().out
    assert "first gap +" in out and "ttft gap fit" in out


def test_the_step_benchmark_refuses_a_prompt_past_one_chunk(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        steps.main(["--batches", "8", "--prompts", "510"])  # 518 rows > the 512 chunk
    assert "--prompts: 1..512 - max(--batches) tokens (one chunk)" in capsys.readouterr().err
