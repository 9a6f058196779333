"""The elementwise kernels' contracts on CPU: the fused-kernel inputs pdserve builds for
FlashInfer (its RoPE cos/sin table) and the torch kernels' residual stream."""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.models import kernels
from pdserve.models.kernels import TORCH_KERNELS, Kernels, flashinfer_kernels_reason
from pdserve.models.rope import RopeConfig, Rotary, apply_rope


@pytest.mark.parametrize("rope", [RopeConfig(), RopeConfig(theta=500000.0, rope_type="llama3",
                                                           factor=8.0),
                                  RopeConfig(rope_type="yarn", factor=4.0,
                                             original_max_position_embeddings=64)])
def test_cos_sin_cache_rotates_like_the_torch_rope(rope: RopeConfig) -> None:
    """FlashInfer's documented table: row p = [cos(p f) | sin(p f)] (neox halves)."""
    rotary = Rotary(rope, 16)
    cache = rotary.cos_sin_cache(300, torch.device("cpu"))
    positions = torch.tensor([0, 5, 63, 299])
    x = torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(0))
    cos, sin = cache[positions].chunk(2, dim=-1)
    expect = apply_rope(x, *rotary(positions, torch.float32))
    torch.testing.assert_close(apply_rope(x, cos[:, None, :], sin[:, None, :]), expect)


def test_add_rms_norm_returns_the_norm_and_the_new_stream() -> None:
    g = torch.Generator().manual_seed(1)
    x, residual, weight = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g), \
        torch.randn(32, generator=g)
    normed, stream = TORCH_KERNELS.add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(stream, x + residual)
    torch.testing.assert_close(normed, TORCH_KERNELS.rms_norm(x + residual, weight, 1e-6))


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm, written out."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (32, 512), (7, 576), (300, 2816)])
def test_rms_norm_is_bit_identical_to_hugging_faces(dtype: torch.dtype,
                                                    shape: tuple[int, int]) -> None:
    """float32 runs torch's fused ``F.rms_norm``; it must round exactly like the reference
    (fp32 greedy parity with transformers depends on it), as the half-precision path does."""
    g = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    weight = (torch.rand(shape[1], generator=g) + 0.5).to(dtype)
    assert torch.equal(TORCH_KERNELS.rms_norm(x, weight, 1e-5), _hf_rms_norm(x, weight, 1e-5))


def test_rope_on_q_and_k_together_equals_rope_on_each() -> None:
    g = torch.Generator().manual_seed(2)
    qk = torch.randn(6, 8 + 2, 16, generator=g)
    inputs = Rotary(RopeConfig(), 16)(torch.arange(6) * 5, torch.float32)
    q, k = TORCH_KERNELS.rope_qk(qk, 8, inputs)
    expect_q, expect_k = TORCH_KERNELS.rope(qk[:, :8], qk[:, 8:], inputs)
    assert torch.equal(q, expect_q) and torch.equal(k, expect_k)
    assert k.is_contiguous()  # backends scatter k into the cache


def test_fused_kernels_only_on_cuda_in_half_precision() -> None:
    cpu = torch.device("cpu")
    assert flashinfer_kernels_reason(cpu, torch.bfloat16) == "device cpu is not CUDA"
    assert flashinfer_kernels_reason(torch.device("cuda"), torch.float32) == (
        "dtype torch.float32 is not float16 or bfloat16")


class _WrongNorm(Kernels):
    name = "wrong"

    def __init__(self, *args: object) -> None:
        pass

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return x  # not normalised


def test_kernels_that_disagree_are_replaced_by_torch_saying_why(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    rotary = Rotary(RopeConfig(), 64)
    cpu = torch.device("cpu")
    kernels.self_test(TORCH_KERNELS, rotary, cpu, torch.bfloat16)  # the reference passes
    monkeypatch.setattr(kernels, "flashinfer_kernels_reason", lambda device, dtype: None)
    monkeypatch.setattr(kernels, "FlashInferKernels", _WrongNorm)
    with caplog.at_level(logging.INFO, logger="pdserve.models.kernels"):
        chosen = kernels.kernels_for(rotary, 128, cpu, torch.bfloat16)
    assert chosen is TORCH_KERNELS
    # (a CPU that emulates bfloat16 adds its own warning: test_cpu_decode.py)
    (record,) = [r for r in caplog.records if r.getMessage().startswith("elementwise")]
    assert record.getMessage() == "elementwise kernels: torch"
    assert record.fields["reason"].startswith("AssertionError: Tensor-likes are not close")  # type: ignore[attr-defined]
