"""``pdserve bench engine``'s parts that need no full run: the GEMM ceiling, the table, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.attention import cpu_decode
from pdserve.cli import BENCHMARKS
from pdserve.controller.capacity import starting_model
from pdserve.models import load_model, save_builtin
from pdserve_bench.engine import Result, format_table, main
from pdserve_bench.gemm_ceiling import cpu_features, decode_gemms, gemm_step_seconds


def test_the_ceiling_runs_every_projection_of_a_decode_step() -> None:
    lm = load_model("tiny", dtype="float32")
    mods = decode_gemms(lm.model)  # type: ignore[arg-type]
    assert len(mods) == 4 * lm.config.num_layers  # qkv, o, gate/up, down per layer
    assert mods[0] is lm.model.layers[0].self_attn.qkv_proj  # type: ignore[union-attr]
    assert gemm_step_seconds(lm.model, 4, iters=2) > 0  # type: ignore[arg-type]


def test_hardware_names_the_gemm_features() -> None:
    hw = cpu_features()
    assert {"avx2", "avx512_bf16", "amx", "torch_threads", "load_average"} <= set(hw)
    assert "link" not in hw


def test_the_table_shows_the_ceiling_fraction_and_ranges() -> None:
    row = Result(32, 1000.0, 500.0, 2000.0, 1000.0, "bfloat16", 32.0, 24.0, 0.75,
                 (1.9, 2.1), (0.7, 0.8), decode_cpu_ratio=2.5, gemm_fraction_cpu=0.85)
    header, prefill, decode = format_table([row]).splitlines()
    assert header.split()[-6:] == ["ceiling", "cpu", "ratio", "cpu", "of", "ceiling"]
    assert prefill.split() == ["bfloat16", "32", "prefill", "2000.0", "1000.0", "2.00"]
    assert decode.split() == ["bfloat16", "32", "decode", "1000.0", "500.0", "2.00",
                              "1.90-2.10", "32.00", "24.00", "75%", "(70%-80%)", "2.50", "85%"]


def test_it_is_a_pdserve_bench_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert BENCHMARKS["engine"] == "pdserve_bench.engine:main"
    with pytest.raises(SystemExit):
        main(["--threads", "0"])
    assert "--threads must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--dtype", "float16"])
    assert "invalid choice: 'float16'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--packed-weights", "maybe"])
    assert "--packed-weights: invalid choice: 'maybe'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--native-kernels", "fast"])
    assert "--native-kernels: invalid choice: 'fast'" in capsys.readouterr().err


def test_an_unknown_model_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--model", "no-such-model"])
    assert ("--model 'no-such-model': neither a directory nor a built-in model"
            in capsys.readouterr().err)


def test_its_json_is_a_controller_calibration(capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    """A run on another model (a Hugging Face directory here) names the model, prompt length
    and threads in each row, and the router's --controller-calibration takes it as it is."""
    save_builtin("tiny", tmp_path / "tiny")
    assert main(["--model", str(tmp_path / "tiny"), "--concurrency", "1", "8", "--quick",
                 "--prompt-len", "64", "--threads", "1", "--json"]) in (0, None)
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in lines]
    assert [(r["model"], r["prompt_len"], r["threads"], r["num_seqs"]) for r in rows] == [
        (str(tmp_path / "tiny"), 64, 1, 1), (str(tmp_path / "tiny"), 64, 1, 8)]
    path = tmp_path / "calibration.jsonl"
    path.write_text("\n".join(lines))
    model = starting_model(str(path))
    assert [b for b, _ in model.decode_points] == [1, 8]
    assert [t for _, t in model.decode_points] == pytest.approx(
        [r["num_seqs"] / r["pdserve_decode_tps"] for r in rows])
    assert model.prefill_tokens_per_s > 0
    # What ran is in every row: the native decode attention where this CPU runs it (tiny:
    # head_dim 32) with the instruction set it ran, float32's elementwise kernels are torch's.
    expect = "sdpa" if cpu_decode.missing_cpu_flags() else \
        "native-" + cpu_decode.isa(cpu_decode.module("on"), torch.float32)
    assert {(r["decode_attention"], r["elementwise"]) for r in rows} == {(expect, "torch")}
