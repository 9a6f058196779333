"""``pdserve sim --validate``: the arrangement read from a stack's ``pdserve up`` arguments,
the simulated inter-token gaps on an exact tiny case, the side-by-side rows, the user errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.controller.capacity import CapacityModel
from pdserve.controller.optimizer import Plan, Slo
from pdserve_bench.sim import cli
from pdserve_bench.sim.cluster import Sim
from pdserve_bench.sim.state import SimConfig
from pdserve_bench.sim.validate import Arrangement, Replay, arrangement, simulate
from pdserve_bench.sim.workload import SimRequest

# 1000 prompt tokens/s + 5 ms a batch; decode steps 10 ms + 1 ms per sequence
MODEL = CapacityModel(0.005, 1000.0, 0.010, 0.001, max_batch=4)
CFG = SimConfig(chunk_tokens=256, block_size=16, block_bytes=1000.0, link_bytes_per_s=1e6)


@pytest.mark.parametrize(("args", "plan", "controller", "cores"), [
    (["--model", "m", "--colocated", "--decode", "3"], Plan(0, 0, 3), None, None),
    (["--colocated", "--decode", "3", "--decode-cpus", "0;1"], Plan(0, 0, 3), None,
     ["0", "1", "0"]),
    (["--prefill", "2", "--decode", "1"], Plan(2, 1), None, None),
    (["--prefill", "2", "--decode", "1", "--prefill-cpus", "0"], Plan(2, 1), None, None),
    ([], Plan(1, 1), None, None),
    (["--prefill", "2", "--decode", "1", "--prefill-cpus", "0;1", "--decode-cpus", "0",
      "--controller", "in-place", "--router-arg=--controller-interval=1",
      "--router-arg=--controller-dwell=4"], Plan(2, 1),
     {"interval": 1.0, "window": 30.0, "dwell": 4.0, "margin": 0.1, "stabilize": 0.0},
     ["0", "1", "0"]),
    (["--prefill", "2", "--decode", "1", "--controller", "in-place",
      "--router-arg=--controller-stabilize=3"], Plan(2, 1),
     {"interval": 10.0, "window": 30.0, "dwell": 30.0, "margin": 0.1, "stabilize": 3.0}, None),
])
def test_the_arrangement_is_what_the_up_arguments_start(args: list[str], plan: Plan,
                                                        controller: dict | None,
                                                        cores: list[str] | None) -> None:
    # CPU sets only when every engine is pinned (cycled as `pdserve up` cycles them)
    assert arrangement(args) == Arrangement(plan, controller, cores)


def test_engines_pinned_to_one_core_share_it() -> None:
    two = [SimRequest(0, 0.0, 100, 1), SimRequest(1, 0.0, 100, 1)]
    alone = Sim(MODEL, CFG, ["colocated", "colocated"], cores=["0", "1"]).run(two, 10.0)
    assert [r.t_first for r in alone] == pytest.approx([0.105, 0.105])  # 5 ms + 100 tokens
    shared = Sim(MODEL, CFG, ["colocated", "colocated"], cores=["0", "0"]).run(two, 10.0)
    assert [r.t_first for r in shared] == pytest.approx([0.210, 0.210])  # each at half speed
    # B starts 50 ms into A's 105 ms: A has 55 ms left, done at half speed by 0.16 s; B has
    # done 55 of its 105 ms by then, and finishes the last 50 alone at 0.21 s
    staggered = [SimRequest(0, 0.0, 100, 1), SimRequest(1, 0.05, 100, 1)]
    done = Sim(MODEL, CFG, ["colocated", "colocated"], cores=["0", "0"]).run(staggered, 10.0)
    assert sorted(r.t_first for r in done) == pytest.approx([0.160, 0.210])
    with pytest.raises(ValueError, match="cores: 1 given for 2 instances"):
        Sim(MODEL, CFG, ["colocated", "colocated"], cores=["0"])


def test_inter_token_gaps_include_the_first_decode_stall() -> None:
    sim = Sim(MODEL, CFG, ["prefill", "decode"])
    sim.itl = []
    [req] = sim.run([SimRequest(0, 0.0, 100, 3)], until=10.0)
    # prefill 0.105 s; KV 7 blocks x 1000 B / 1 MB/s = 7 ms; steps of 1 sequence: 11 ms
    assert req.t_first == pytest.approx(0.105)
    gaps = sorted((round(g, 6), n) for g, n in sim.itl if n)
    assert gaps == [(0.011, 1), (0.018, 1)]  # the second token: KV + one step after the first


def _run_file(tmp_path: Path, args: list[str]) -> Path:
    results = [{"start_s": 0.5 * i, "ttft_s": 0.2, "itls_s": [0.02, 0.02], "tokens_in": 100,
                "tokens_out": 3, "error": None} for i in range(4)]
    path = tmp_path / "stack.json"
    path.write_text(json.dumps({"stack": "s", "args": args,
                                "runs": [{"rate": 2.0, "requests": results}]}))
    return path


def test_validate_rows_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _run_file(tmp_path, ["--prefill", "1", "--decode", "1"])
    row = simulate(json.loads(path.read_text())["runs"][0], Arrangement(Plan(1, 1), None), MODEL,
                   CFG, Slo(1.0, 0.1))
    assert (row["requests"], row["simulated"]) == (4, 4)
    assert row["ttft_p50_ms"] == pytest.approx(200) and row["itl_p99_ms"] == pytest.approx(20)
    assert row["sim_ttft_p50_ms"] == pytest.approx(105, rel=0.01)  # nothing queues at 2 req/s
    assert row["ttft_gap_p50_ms"] == pytest.approx(95, rel=0.01)  # measured 200 - simulated 105
    shifted = simulate(json.loads(path.read_text())["runs"][0], Arrangement(Plan(1, 1), None),
                       MODEL, CFG, Slo(1.0, 0.1), Replay(ttft_fixed_s=0.045,
                                                        ttft_per_token_s=0.0005))
    assert shifted["sim_ttft_p50_ms"] == pytest.approx(200, rel=0.01)  # 45 ms + 100 x 0.5 ms
    assert shifted["ttft_gap_p50_ms"] == row["ttft_gap_p50_ms"]  # read before the offset
    assert cli.main(["--validate", str(path), "--json", "--time-scale", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("model: ") and "(time scale 2)" in out[0]
    assert json.loads(out[1])["rows"][0]["requests"] == 4
    assert cli.main(["--validate", str(path), "--ttft-offset-ms", "95"]) == 0
    out = capsys.readouterr().out
    assert "ttft_p99_ms" in out and "ttft gap p50" in out


def test_validate_names_a_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    for text in ("{}", '{"args": [], "runs": [{"rate": 1}]}', "[1"):
        bad.write_text(text)
        assert cli.main(["--validate", str(bad)]) == 2
        assert "not a `pdserve bench compare` runs/<comparison>/<stack>.json file" in \
            capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--validate", str(bad), "--time-scale", "0"])
    assert "--time-scale must be > 0" in capsys.readouterr().err
