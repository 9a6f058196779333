"""The shipped bench configs for the issue's exact form (2 flex engines under the in-place
controller vs 2 colocated vs fixed 1P+1D) load, and compare the stacks they say they do."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve_bench.configs import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "bench" / "configs"


@pytest.mark.parametrize("workload", ["mixed", "shifting"])
def test_2flex_config_compares_the_controller_with_colocated_and_1p1d(workload: str) -> None:
    cfg = load_config(CONFIGS / f"controller-2flex-{workload}.toml")
    pairs = {(c.baseline, c.candidate) for c in cfg.comparisons}
    assert pairs == {("colocated", "flex2_controller"), ("disaggregated", "flex2_controller")}
    assert {c.workload.name for c in cfg.comparisons} == {workload}
    args = cfg.stacks["flex2_controller"].args
    assert args[args.index("--controller") + 1] == "in-place"
    assert tuple(args[args.index("--prefill"):][:4]) == ("--prefill", "1", "--decode", "1")
    assert "--router-arg=--controller-stabilize=3" in args
    assert "--router-arg=--controller-prefer=split" in args  # explicit, not the default's
    assert cfg.run.rates == (1.5, 3.0)
    assert not any("--controller-colocated" in a for a in args)  # colocated allowed (default)


@pytest.mark.parametrize("workload", ["mixed", "shifting"])
def test_50m_2flex_config_also_compares_the_controller_with_a_fixed_chunk(workload: str) -> None:
    cfg = load_config(CONFIGS / f"controller-2flex-50m-{workload}.toml")
    pairs = {(c.baseline, c.candidate) for c in cfg.comparisons}
    assert pairs == {("colocated", "flex2_controller_50m"),
                     ("disaggregated", "flex2_controller_50m"),
                     ("colocated_chunk176", "flex2_controller_50m"),
                     ("colocated", "flex2_controller_50m_1core")} | (
        {("colocated", "flex2_controller_50m_split")} if workload == "shifting" else set())
    assert {c.workload.name for c in cfg.comparisons} == {workload}
    assert cfg.run.stack_args == ("--model", "bench-50m")
    assert (cfg.run.slo_ttft_ms, cfg.run.slo_tpot_ms) == (2000, 100)
    args = cfg.stacks["flex2_controller_50m"].args
    assert args[args.index("--slo-ttft-ms") + 1] == "2000"  # the router plans for the bench's
    assert "--router-arg=--controller-prefer=goodput" in args
    assert "--engine-arg=--max-num-batched-tokens=176" in cfg.stacks["colocated_chunk176"].args
    if workload == "shifting":  # the same controller, preferring the split while it keeps up
        split = cfg.stacks["flex2_controller_50m_split"].args
        assert [a.replace("=split", "=goodput") for a in split] == list(args)


def test_the_1core_stack_starts_its_controller_from_a_shipped_calibration() -> None:
    from pdserve.controller.capacity import starting_model

    cfg = load_config(CONFIGS / "controller-2flex-50m-mixed.toml")
    args = cfg.stacks["flex2_controller_50m_1core"].args
    (flag,) = [a for a in args if "--controller-calibration=" in a]
    path = CONFIGS.parents[1] / flag.split("=", 2)[2]
    assert starting_model(str(path)).prefill_tokens_per_s > 0  # loads, fits
    base = cfg.stacks["flex2_controller_50m"].args
    assert [a for a in args if a != flag] == list(base)  # nothing else differs
