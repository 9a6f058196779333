"""``pdserve bench kvquant`` and ``pdserve bench wirecodec`` on small inputs: the fields they
report are consistent, and bad arguments are named."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.models import load_model
from pdserve_bench import kvquant, wirecodec


def test_kvquant_on_the_tiny_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvquant.main(["--model", "tiny", "--new-tokens", "4", "--prompt-tokens", "16",
                         "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["kv_cache_dtype"] for r in rows] == ["auto", "fp8", "int8"]
    base, fp8, int8 = rows
    assert base["teacher_forced_agreement"] == 1.0 and base["perplexity_change_pct"] == 0.0
    cfg = load_model("tiny").config  # float32: 4 bytes a value; quantized: 1 + a 4-byte scale
    heads = cfg.num_layers * 2 * cfg.num_kv_heads
    want = (heads * cfg.head_dim * 4, heads * (cfg.head_dim + 4))
    assert (base["kv_bytes_per_token"], fp8["kv_bytes_per_token"]) == want
    assert int8["capacity_vs_baseline"] == round(want[0] / want[1], 3)
    assert 0.5 < fp8["teacher_forced_agreement"] <= 1.0 and fp8["num_greedy_tokens"] == 4


def test_kvquant_bad_arguments_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        kvquant.main(["--model", "/nonexistent/model", "--new-tokens", "2"])
    assert "--model '/nonexistent/model'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kvquant.main(["--model", "tiny", "--new-tokens", "0"])
    assert "--new-tokens and --chunk must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kvquant.main(["--kv-cache-dtypes", "fp4"])
    assert "invalid choice: 'fp4'" in capsys.readouterr().err


def test_wirecodec_measures_ratios_and_effective_rates() -> None:
    smooth = np.repeat(np.arange(4096, dtype=np.uint16), 64).tobytes()  # very compressible
    rows = {r.codec: r for r in wirecodec.measure(smooth, "bfloat16", 2, [1.0], repeats=1)}
    assert rows["none"].ratio == 1.0 and rows["none"].effective_gbs == {"1": 1.0}
    assert rows["lz4"].ratio > 10 and rows["lz4"].compress_gbs > 0
    assert set(rows) >= {"lz4", "zstd1", "zstd-1", "shuffle+lz4"}
