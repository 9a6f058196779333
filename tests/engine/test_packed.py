"""Pre-packed CPU GEMM weights (models/packed.py): same results as ``F.linear``, any rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.models import load_model
from pdserve.models.layers import Linear
from pdserve.models.packed import pack, pack_kind


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_packed_linear_equals_f_linear(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=g).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype)
    packed = pack(weight)
    if packed is None:
        pytest.skip(f"no packed GEMM for {dtype} in this torch build")  # e.g. no MKL
    x = torch.randn(rows, 64, generator=g).to(dtype)
    # float32 (MKL) and bfloat16 (oneDNN) were bit-identical to F.linear when measured;
    # the bound allows only a summation-order difference.
    torch.testing.assert_close(packed.linear(x, bias), F.linear(x, weight, bias),
                               rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-2)


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
    # The parameters stay the plain [out, in] weights (reload and checks read them).
    assert all(m.weight.shape[0] == m.packed.weight.shape[0] for m in linears if m.packed)
