"""``bench compare``: config files, the stack subprocess contract, reports from synthetic
results, and a whole comparison against fake stacks (real HTTP servers started as launchers)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from pdserve_bench.compare import main, summarize_cprofile, summarize_pyspy
from pdserve_bench.configs import ConfigError, RunConfig, load_config
from pdserve_bench.report import (
    ComparisonResult,
    SideResult,
    judge,
    write_report,
)
from pdserve_bench.runner import RunResult
from pdserve_bench.stack import StackError, StackProcess
from pdserve_bench.stats import RequestResult, summarize

FAKE = str(Path(__file__).with_name("fake_openai.py"))


def _write_configs(root: Path, run_extra: str = "", stacks: dict[str, str] | None = None) -> Path:
    stacks = stacks or {"slow": '["--itl-ms", "6"]', "fast": '["--itl-ms", "1"]'}
    for name, args in stacks.items():
        (root / f"{name}.toml").write_text(f'description = "{name} fake"\nargs = {args}\n')
    cfg = root / "default.toml"
    cfg.write_text(f"""
[run]
launcher = ["{{python}}", "{FAKE}", "up"]
rates = [50, 100]
num_requests = 6
warmup_requests = 1
slo_ttft_ms = 1000
slo_tpot_ms = 100
ready_timeout_s = 30
request_timeout_s = 20
{run_extra}
[[comparison]]
name = "speed"
workload = "chat"
baseline = "slow"
candidate = "fast"
metric = "itl_p50_ms"
min_reduction = 0.5

[workloads.chat]
chat_input = [4, 8]
chat_output = [6, 10]
""")
    return cfg


def test_compare_end_to_end_with_fake_stacks(tmp_path: Path) -> None:
    cfg = _write_configs(tmp_path)
    out = tmp_path / "results"
    assert main(["--config", str(cfg), "--out-dir", str(out), "--no-progress"]) == 0
    report = json.loads((out / "report.json").read_text())
    (cmp,) = report["comparisons"]
    assert cmp["name"] == "speed" and set(cmp["configurations"]) == {"slow", "fast"}
    for conf in cmp["configurations"].values():
        at = conf["at_verdict_rate"]
        for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms",
                    "throughput_rps", "goodput_rps", "errors"):
            assert at[key] is not None, key
        assert at["errors"] == 0 and "prefix_hit_rate" not in at  # no router line printed
        assert [r["rate"] for r in conf["rates"]] == [50, 100]
    assert cmp["verdict"]["rate"] in (50, 100) and cmp["verdict"]["met"] in (True, False)
    md = (out / "report.md").read_text()
    assert "## speed: fast vs slow (chat)" in md and ("**MET**" in md or "**MISSED**" in md)
    for png in ("speed_itl_cdf", "speed_ttft_cdf", "speed_latency_vs_rate"):
        assert (out / "plots" / f"{png}.png").read_bytes()[:4] == b"\x89PNG"
        assert f"plots/{png}.png" in md
    runs = json.loads((out / "runs" / "speed" / "fast.json").read_text())
    assert len(runs["runs"][0]["requests"]) == 6
    assert "pdserve ready:" in (out / "logs" / "speed-fast.log").read_text()


def test_launcher_that_dies_gives_its_stderr_tail(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _write_configs(tmp_path, stacks={"slow": '["--fail"]', "fast": "[]"})
    assert main(["--config", str(cfg), "--out-dir", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert "exited with code 3 before it was ready" in err and "scripted failure" in err


def test_launcher_that_never_gets_ready_times_out(tmp_path: Path) -> None:
    stack = StackProcess("sleepy", [sys.executable, "-c", "import time; time.sleep(60)"],
                         env={}, log_path=tmp_path / "log", ready_timeout_s=0.5)
    with pytest.raises(StackError, match=r"no 'pdserve ready:' line within 0.5 s"):
        stack.start()
    assert stack.proc is None  # stopped, not leaked


def test_stack_reads_ready_and_router_lines_and_stops(tmp_path: Path) -> None:
    script = ("import signal, sys, time\n"
              "print('pdserve router: 127.0.0.1:5555')\n"
              "print('pdserve ready: http://127.0.0.1:1234/v1/', flush=True)\n"
              "signal.signal(signal.SIGINT, lambda *a: sys.exit(0))\n"
              "time.sleep(60)\n")
    stack = StackProcess("s", [sys.executable, "-c", script], env={},
                         log_path=tmp_path / "log", ready_timeout_s=20)
    with stack as info:
        assert (info.base_url, info.router) == ("http://127.0.0.1:1234/v1", "127.0.0.1:5555")
    assert stack.proc is None


@pytest.mark.parametrize(("run_extra", "message"), [
    ("colour = 1", r"\[run\]: unknown field\(s\) \['colour'\]"),
    ("slo_attainment = 2.0", "slo_attainment must be in"),
    ("launcher = []", "launcher must be a non-empty list"),
])
def test_bad_run_fields_are_named(tmp_path: Path, run_extra: str, message: str) -> None:
    cfg = _write_configs(tmp_path)
    text = cfg.read_text().replace('launcher = ["{python}"', 'xlauncher = ["{python}"') \
        if "launcher" in run_extra else cfg.read_text()
    cfg.write_text(text.replace("[run]\n", f"[run]\n{run_extra}\n", 1).replace("xlauncher", "#"))
    with pytest.raises(ConfigError, match=message):
        load_config(cfg)


def test_bad_comparison_and_stack_files_are_named(tmp_path: Path) -> None:
    cfg = _write_configs(tmp_path)
    text = cfg.read_text()
    cfg.write_text(text.replace('metric = "itl_p50_ms"', 'metric = "itl_p42"'))
    with pytest.raises(ConfigError, match=r"comparison 'speed': metric must be one of"):
        load_config(cfg)
    cfg.write_text(text.replace('candidate = "fast"', 'candidate = "nowhere"'))
    with pytest.raises(ConfigError, match=r"nowhere.toml: no such configuration file"):
        load_config(cfg)
    cfg.write_text(text.replace("chat_input = [4, 8]", "chat_input = [0, 8]"))
    with pytest.raises(ConfigError, match=r"\[workloads.chat\]: .*1 <= lo <= hi"):
        load_config(cfg)
    cfg.write_text(text)
    (tmp_path / "fast.toml").write_text('args = "--colocated"\n')
    with pytest.raises(ConfigError, match=r"fast.toml: 'args' must be a list of strings"):
        load_config(cfg)
    with pytest.raises(ConfigError, match=r"--only: no comparison named \['x'\]"):
        load_config(cfg, ("x",))
    with pytest.raises(ConfigError, match="rates must be > 0"):
        RunConfig(rates=(0.0,))


def test_shipped_default_config_loads() -> None:
    cfg = load_config(Path(__file__).resolve().parents[2] / "bench/configs/default.toml")
    assert {c.name for c in cfg.comparisons} == {"disaggregation", "routing"}
    quick = load_config(cfg.path.with_name("quick.toml"))
    assert quick.stacks.keys() == cfg.stacks.keys() and quick.run.stack_args[0] == "--model"
    assert set(cfg.stacks) == {"colocated", "disaggregated", "round_robin", "cache_aware"}


def _synthetic_run(rate: float, ttft_ms: float, itl_ms: float, n: int = 20) -> RunResult:
    results = tuple(
        RequestResult(conversation=i, turn=0, kind="chat", start_s=i * 0.1, e2e_s=1.0,
                      ttft_s=ttft_ms / 1000, tpot_s=itl_ms / 1000,
                      itls_s=(itl_ms / 1000,) * 9, tokens_in=10, tokens_out=10)
        for i in range(n))
    return RunResult(rate, results, summarize(results, slo_ttft_ms=1000, slo_tpot_ms=500))


def _pair(base_itl: tuple[float, float], cand_itl: tuple[float, float],
          base_ttft: tuple[float, float]) -> ComparisonResult:
    cfg = load_config(Path(__file__).resolve().parents[2] / "bench/configs/default.toml",
                      ("disaggregation",))
    base = SideResult("colocated", "b", ("--colocated",), tuple(
        _synthetic_run(r, t, i) for r, t, i in zip((1.0, 2.0), base_ttft, base_itl,
                                                    strict=True)), "profile: slow frames\n")
    cand = SideResult("disaggregated", "c", ("--prefill", "1"), tuple(
        _synthetic_run(r, 100, i) for r, i in zip((1.0, 2.0), cand_itl, strict=True)))
    return ComparisonResult(cfg.comparisons[0], base, cand)


def test_report_from_a_synthetic_pair(tmp_path: Path) -> None:
    run = RunConfig(rates=(1.0, 2.0), slo_ttft_ms=1000)
    # baseline meets the TTFT SLO at both rates -> judged at 2 req/s: 40 vs 100 ms = 60% lower
    met = _pair(base_itl=(50, 100), cand_itl=(40, 40), base_ttft=(200, 900))
    v = judge(met, run)
    assert (v.rate, v.met) == (2.0, True) and v.reduction == pytest.approx(0.6)
    # baseline misses at 2 req/s -> judged at 1 req/s: 40 vs 50 ms = 20% lower, missed by 30%
    missed = _pair(base_itl=(50, 100), cand_itl=(40, 40), base_ttft=(200, 1500))
    v = judge(missed, run)
    assert (v.rate, v.met) == (1.0, False) and v.reduction == pytest.approx(0.2)
    assert "**MISSED** by 30.0 percentage points" in v.sentence(missed.comparison)
    json_path, md_path = write_report([missed], run, "pdserve bench compare", tmp_path)
    data = json.loads(json_path.read_text())
    conf = data["comparisons"][0]["configurations"]
    assert conf["colocated"]["at_verdict_rate"]["itl_p99_ms"] == pytest.approx(50.0)
    assert conf["disaggregated"]["at_verdict_rate"]["itl_p99_ms"] == pytest.approx(40.0)
    assert data["comparisons"][0]["verdict"]["met"] is False
    md = md_path.read_text()
    assert "| colocated | 2 |" in md and "Profile of the slower side (colocated)" in md
    assert "slow frames" in md
    for png in ("disaggregation_itl_cdf", "disaggregation_ttft_cdf",
                "disaggregation_latency_vs_rate"):
        assert (tmp_path / "plots" / f"{png}.png").stat().st_size > 1000


def test_profile_summaries(tmp_path: Path) -> None:
    import cProfile

    prof = cProfile.Profile()
    prof.runcall(sorted, range(1000))
    prof.dump_stats(tmp_path / "router.prof")
    text = summarize_cprofile(tmp_path)
    assert "cProfile: 1 file(s)" in text and "sorted" in text
    assert summarize_cprofile(tmp_path / "none") == ""
    raw = tmp_path / "spy.txt"
    raw.write_text("main;step;matmul 30\nmain;step;attention 10\nmain;recv 60\n")
    spy = summarize_pyspy(raw)
    assert "100 samples" in spy and spy.index("recv") < spy.index("matmul")


def test_a_stack_shared_by_two_comparisons_runs_once(tmp_path: Path) -> None:
    cfg = _write_configs(tmp_path, stacks={"slow": '["--itl-ms", "6"]', "fast": '["--itl-ms", "1"]',
                                           "mid": '["--itl-ms", "3"]'})
    cfg.write_text(cfg.read_text() + """
[[comparison]]
name = "speed-mid"
workload = "chat"
baseline = "mid"
candidate = "fast"
metric = "itl_p50_ms"
min_reduction = 0.0
""")
    out = tmp_path / "results"
    assert main(["--config", str(cfg), "--out-dir", str(out), "--no-progress"]) == 0
    assert sorted(p.name for p in (out / "logs").iterdir()) == [
        "speed-fast.log", "speed-mid-mid.log", "speed-slow.log"]  # fast ran once, not twice
    a, b = json.loads((out / "report.json").read_text())["comparisons"]
    assert a["configurations"]["fast"] == b["configurations"]["fast"]


def test_shipped_controller_shifting_config_loads() -> None:
    cfg = load_config(Path(__file__).resolve().parents[2] /
                      "bench/configs/controller-shifting.toml")
    assert {c.workload.name for c in cfg.comparisons} == {"shifting"}
    assert set(cfg.stacks) >= {"colocated3", "fixed_2p1d", "flex3_controller"}
    assert "--controller" in cfg.stacks["flex3_controller"].args


def test_rates_and_num_requests_from_the_command_line(tmp_path: Path) -> None:
    cfg = _write_configs(tmp_path)
    out = tmp_path / "results"
    assert main(["--config", str(cfg), "--out-dir", str(out), "--no-progress",
                 "--rates", "80", "--num-requests", "4"]) == 0
    report = json.loads((out / "report.json").read_text())
    for conf in report["comparisons"][0]["configurations"].values():
        assert [r["rate"] for r in conf["rates"]] == [80]
    runs = json.loads((out / "runs" / "speed" / "fast.json").read_text())
    assert [len(r["requests"]) for r in runs["runs"]] == [4]


@pytest.mark.parametrize(("flags", "message"), [
    (["--rates", "0"], r"--rates/--num-requests: rates must be > 0 requests/s, got \[0.0\]"),
    (["--num-requests", "0"], "--rates/--num-requests: num_requests must be >= 1, got 0"),
])
def test_bad_overrides_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 flags: list[str], message: str) -> None:
    cfg = _write_configs(tmp_path)
    assert main(["--config", str(cfg), "--out-dir", str(tmp_path / "r"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve bench compare: error: ")
    assert re.search(message, err), err
    assert not (tmp_path / "r").exists()  # nothing started, nothing written
