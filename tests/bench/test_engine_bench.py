"""``pdserve bench engine``'s parts that need no full run: the GEMM ceiling, the table, CLI."""

from __future__ import annotations

import pytest

from pdserve.cli import BENCHMARKS
from pdserve.models import load_model
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
    assert {"avx512_bf16", "amx", "torch_threads", "load_average"} <= set(hw)
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
