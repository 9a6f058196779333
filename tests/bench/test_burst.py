"""``pdserve bench burst``'s parts that need no stack: prompts, the table, the CLI."""

from __future__ import annotations

import pytest

from pdserve.cli import BENCHMARKS
from pdserve_bench.burst import BurstResult, burst_prompt, format_table, main
from services.router.model import load_model_spec


def test_prompts_are_distinct_and_need_eleven_blocks() -> None:
    tokenizer = load_model_spec("tiny").tokenizer
    assert tokenizer is not None
    assert burst_prompt(1, 8) != burst_prompt(2, 8)
    for i in (0, 63):  # ~160 tokens: 10 full blocks, 11 to start with the first token
        assert 10 * 16 <= len(tokenizer.encode(burst_prompt(i, 8))) < 11 * 16


def test_the_table_shows_outcomes_and_percentiles() -> None:
    row = BurstResult("small", 32, 64, {"200+no_capacity": 50, "200": 14}, 1.03, 2.21, 2.22,
                      2.23)
    header, line = format_table([row]).splitlines()
    assert header.split()[:4] == ["side", "blocks", "reqs", "outcomes"]
    assert line.split() == ["small", "32", "64", "200:14,200+no_capacity:50", "1.03s", "2.21s",
                            "2.22s", "2.23s"]


def test_it_is_a_pdserve_bench_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert BENCHMARKS["burst"] == "pdserve_bench.burst:main"
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert "--small-blocks" in capsys.readouterr().out
