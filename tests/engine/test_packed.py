"""Pre-packed CPU GEMM weights (models/packed.py): same results as ``F.linear``, any rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.config import EngineArgs
from pdserve.engine.engine import Engine
from pdserve.engine.setup import packed_gemms
from pdserve.models import load_model
from pdserve.models.decoder import DecoderLM
from pdserve.models.layers import Linear
from pdserve.models.loader import weight_bytes
from pdserve.models.packed import PACK_BATCH_SIZE, pack, pack_kind
from services.decode.config import DecodeConfig
from tests.engine.helpers import random_prompts, run_all

NEEDS_MKL = pytest.mark.skipif(pack_kind(torch.zeros(2, 2)) is None,
                               reason="this torch build has no MKL packed sgemm")
NEEDS_ONEDNN = pytest.mark.skipif(pack_kind(torch.zeros(2, 2, dtype=torch.bfloat16)) is None,
                                  reason="no oneDNN bfloat16 linear here (not in this torch, "
                                         "or a CPU without AVX-512)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_packed_linear_equals_f_linear(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=g).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype)
    packed = pack(weight)
    if packed is None:
        pytest.skip(f"no packed GEMM for {dtype} here")  # no MKL, or bf16 without AVX-512
    x = torch.randn(rows, 64, generator=g).to(dtype)
    # float32 (MKL) and bfloat16 (oneDNN) were bit-identical to F.linear when measured;
    # the bound allows only a summation-order difference.
    torch.testing.assert_close(packed.linear(x, bias), F.linear(x, weight, bias),
                               rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-2)


def test_bf16_without_onednn_support_keeps_the_plain_gemm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An AVX2-only CPU: oneDNN refuses to pack bfloat16 weights, so they stay plain."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    weight = torch.randn(8, 4).to(torch.bfloat16)
    assert pack_kind(weight) is None
    assert pack(weight) is None


@pytest.mark.parametrize("onednn_bf16", [True, False])
def test_plain_weights_are_column_major_only_where_that_pays(
        monkeypatch: pytest.MonkeyPatch, onednn_bf16: bool) -> None:
    """Unpacked weights: float32 column-major everywhere; bfloat16 column-major only where
    oneDNN runs it (on an AVX2-only CPU torch's GEMM for a transposed bfloat16 weight ran
    9x slower), so there it keeps the row-major layout transformers uses."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn_bf16)
    for dtype, column_major in (("float32", True), ("bfloat16", onednn_bf16)):
        lm = load_model("tiny", dtype=dtype, packed_weights=False)
        weights = [m.weight for m in lm.model.modules() if isinstance(m, Linear)]
        assert weights
        for w in weights:
            assert w.t().is_contiguous() == column_major, (dtype, w.stride())
            assert w.is_contiguous() != column_major


def test_what_is_not_packed() -> None:
    assert pack_kind(torch.zeros(4, 4, dtype=torch.float16)) is None
    assert pack_kind(torch.zeros(4)) is None
    assert pack(torch.zeros(4, 4, dtype=torch.float16)) is None


def test_loaded_cpu_model_uses_packed_weights_and_plain_parameters() -> None:
    lm = load_model("tiny", dtype="float32")
    linears = [m for m in lm.model.modules() if isinstance(m, Linear)]
    assert linears
    expect = pack_kind(linears[0].weight)
    assert all((m.packed is not None) == (expect is not None) for m in linears)
    # float32 (MKL) keeps the plain [out, in] weight: its op runs F.linear on it whenever a
    # call's row count is not the packed one.
    assert all(m.packed.weight is not None and m.packed.weight.data_ptr() == m.weight.data_ptr()
               for m in linears if m.packed)


@NEEDS_MKL
def test_packed_weights_off_keeps_only_the_plain_weights() -> None:
    on, off = (load_model("bench-50m", dtype="float32", packed_weights=p) for p in (True, False))
    assert isinstance(off.model, DecoderLM) and off.model.lm_head_packed is None
    assert all(m.packed is None for m in off.model.modules() if isinstance(m, Linear))
    plain = sum(p.numel() * 4 for p in off.model.parameters())
    assert weight_bytes(off.model) == plain
    # MKL's packed copies sit beside the plain weights: more than twice the memory.
    assert weight_bytes(on.model) > 2 * plain


@NEEDS_ONEDNN
def test_bfloat16_packing_frees_the_plain_weights() -> None:
    lm = load_model("bench-50m", dtype="bfloat16")
    assert isinstance(lm.model, DecoderLM) and lm.model.lm_head_packed is not None
    linears = [m for m in lm.model.modules() if isinstance(m, Linear)]
    assert all(m.packed is not None and m.weight.device.type == "meta" for m in linears)
    assert lm.model.lm_head is not None and lm.model.lm_head.device.type == "meta"
    plain = load_model("bench-50m", dtype="bfloat16", packed_weights=False)
    # One copy of each weight either way (the packed one instead of the plain one).
    assert weight_bytes(lm.model) <= 1.05 * weight_bytes(plain.model)


@NEEDS_MKL
def test_greedy_output_is_the_same_with_and_without_packing() -> None:
    """float32, a decode batch of exactly the packed row count (the only one MKL packs)."""
    prompts = random_prompts([5 + i % 7 for i in range(PACK_BATCH_SIZE)], seed=3)
    outputs = []
    for packed in (True, False):
        engine = Engine(load_model("tiny", dtype="float32", packed_weights=packed),
                        EngineArgs(max_num_seqs=PACK_BATCH_SIZE, packed_weights=packed))
        outputs.append(run_all(engine, prompts, check_every_step=False)[0])
    assert outputs[0] == outputs[1]


def test_the_packed_weights_flag_and_its_env_twin_reach_the_engine() -> None:
    cfg = DecodeConfig.from_argv(["--role", "colocated", "--packed-weights", "off"], environ={})
    assert cfg.engine_args().packed_weights is False
    cfg = DecodeConfig.from_argv(["--role", "colocated"],
                                 environ={"PDSERVE_DECODE_PACKED_WEIGHTS": "off"})
    assert cfg.engine_args().packed_weights is False
    assert DecodeConfig(role="colocated").engine_args().packed_weights is True


def test_a_bad_packed_weights_value_is_refused_naming_the_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        DecodeConfig.from_argv(["--role", "colocated", "--packed-weights", "maybe"], environ={})
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("pdserve decode: error: --packed-weights: invalid value "
                                       "'maybe' (accepted: true, false, 1, 0, yes, no, on, off)\n")
    with pytest.raises(ValueError, match="packed_weights must be a bool, got 'off'"):
        EngineArgs(packed_weights="off")  # type: ignore[arg-type]


NEEDS_ONEDNN_FP32 = pytest.mark.skipif(
    pack_kind(torch.zeros(2, 2), "onednn") != "onednn", reason="no oneDNN in this torch")


@NEEDS_ONEDNN_FP32
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_float32_on_onednn_is_f_linear_up_to_summation_order(rows: int) -> None:
    """--float32-gemm onednn: any rows, within float32 rounding of F.linear (not bit-equal:
    another summation order), and the plain weight is not kept beside the packed one."""
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    packed = pack(weight, "onednn")
    assert packed is not None and packed.kind == "onednn" and packed.release_plain
    x = torch.randn(rows, 64, generator=g)
    torch.testing.assert_close(packed.linear(x, bias), F.linear(x, weight, bias),
                               rtol=1e-5, atol=1e-4)
    assert pack_kind(weight) == pack_kind(weight, "mkl")  # the default is unchanged


@NEEDS_ONEDNN_FP32
def test_an_engine_on_onednn_float32_weights_decodes_the_same_greedy_tokens() -> None:
    """The tiny seeded model, a decode batch of the packed row count: the same tokens as the
    default (MKL) engine; its packed weights are the only copy."""
    prompts = random_prompts([5 + i % 7 for i in range(PACK_BATCH_SIZE)], seed=3)
    outputs = []
    for gemm in ("mkl", "onednn"):
        args = EngineArgs(max_num_seqs=PACK_BATCH_SIZE, dtype="float32", float32_gemm=gemm)
        engine = Engine.from_model("tiny", args)
        linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
        assert {m.packed.kind for m in linears if m.packed} == {gemm}
        assert packed_gemms(engine.runner.model) == gemm  # what the engine's start-up logs
        assert all((m.weight.device.type == "meta") == (gemm == "onednn") for m in linears)
        outputs.append(run_all(engine, prompts, check_every_step=False)[0])
    assert outputs[0] == outputs[1]


def test_the_float32_gemm_flag_reaches_the_engine_and_a_bad_one_is_named(
        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = DecodeConfig.from_argv(["--role", "colocated", "--float32-gemm", "onednn"],
                                 environ={})
    assert cfg.engine_args().float32_gemm == "onednn"
    assert DecodeConfig(role="colocated").engine_args().float32_gemm == "mkl"
    with pytest.raises(SystemExit) as exit_info:
        DecodeConfig.from_argv(["--role", "colocated", "--float32-gemm", "blas"], environ={})
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("pdserve decode: error: --float32-gemm: invalid value "
                                       "'blas' (accepted: mkl, onednn)\n")
    with pytest.raises(ValueError, match=r"float32_gemm must be one of \('mkl', 'onednn'\), "
                                         r"got 'blas'"):
        EngineArgs(float32_gemm="blas")
