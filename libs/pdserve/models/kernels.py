"""The elementwise kernels of a decoder layer: plain torch everywhere, FlashInfer's fused ones
on CUDA in half precision, pdserve's C++ ones (``CpuKernels``) on an AVX2 or AVX-512 CPU in
bfloat16.

    norm      rms_norm(x)                      add_rms_norm(x, residual) -> (norm(x + r), x + r)
    mlp       silu_and_mul([gate | up])        -> silu(gate) * up
    rope      rope_inputs(positions) once per forward, then rope(q, k, inputs) or
              rope_qk([q | k], num_q_heads, inputs) per layer

The torch versions round like Hugging Face's (normalise in float32, cast, then the weight);
FlashInfer's fused add-RMSNorm and RoPE work in place and keep the sum in float32 until the
norm, which differs from the reference only in bfloat16's last bits. ``kernels_for`` picks
FlashInfer only where it runs (CUDA, float16/bfloat16, the package importable) and where its
modules build and agree with the torch ones on a small input; otherwise torch, with one log
line saying why.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.models.rope import Rotary, apply_rope

log = logging.getLogger(__name__)


class Kernels:
    """Plain torch (any device, any dtype)."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Hugging Face's order: normalise in float32, cast, then the weight. torch's fused
        # F.rms_norm gives the float32 part bit for bit (tests/models/test_kernels.py) in
        # one op instead of five; in float32 it takes the weight too.
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual)."""
        total = x + residual
        return self.rms_norm(total, weight, eps), total

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_inputs(self, rotary: Rotary, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        return rotary(positions, dtype)

    def rope(self, q: torch.Tensor, k: torch.Tensor, inputs: Any
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D] -> rotated (neox style)."""
        cos, sin = inputs
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def rope_qk(self, qk: torch.Tensor, num_q_heads: int, inputs: Any
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """qk [T, Hq + Hk, D], q's heads then k's (the fused projection's output) -> rotated
        (q, k): one pass over both, the same values as ``rope``. q comes back as a view."""
        cos, sin = inputs
        out = apply_rope(qk, cos, sin)
        return out[:, :num_q_heads], out[:, num_q_heads:].contiguous()


class FlashInferKernels(Kernels):
    """FlashInfer's fused RMSNorm, add-RMSNorm, SiLU-and-mul and in-place RoPE (CUDA)."""

    name = "flashinfer"

    def __init__(self, rotary: Rotary, max_positions: int, device: torch.device) -> None:
        self._norm = importlib.import_module("flashinfer.norm")
        self._act = importlib.import_module("flashinfer.activation")
        self._rope = importlib.import_module("flashinfer.rope")
        # [max_positions, rotary_dim] float32: cos in the first half, sin in the second.
        self.cos_sin_cache = rotary.cos_sin_cache(max_positions, device)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm.rmsnorm(x.contiguous(), weight, eps)  # type: ignore[no-any-return]

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.contiguous()
        self._norm.fused_add_rmsnorm(x, residual, weight, eps)  # residual += x; x = norm
        return x, residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._act.silu_and_mul(x.contiguous())  # type: ignore[no-any-return]

    def rope_inputs(self, rotary: Rotary, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        return positions

    def rope_qk(self, qk: torch.Tensor, num_q_heads: int, inputs: Any
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope(qk[:, :num_q_heads], qk[:, num_q_heads:], inputs)

    def rope(self, q: torch.Tensor, k: torch.Tensor, inputs: Any
             ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = q.contiguous(), k.contiguous()
        self._rope.apply_rope_with_cos_sin_cache_inplace(
            inputs, q.view(q.shape[0], -1), k.view(k.shape[0], -1), q.shape[-1],
            self.cos_sin_cache, is_neox=True)
        return q, k


class CpuKernels(Kernels):
    """pdserve's C++ bfloat16 RMSNorm (with the residual add), SiLU-and-mul and RoPE of q
    and k on the CPU (``attention/csrc/cpu_elementwise.cpp``): one pass each instead of torch's
    5-8 ops, the same roundings as the torch versions; float32 and other shapes go to those."""

    name = "cpu-native"

    def __init__(self, module: Any) -> None:
        self._ops = module

    @staticmethod
    def _fits(x: torch.Tensor) -> bool:
        return x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[-1] % 16 == 0

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self._fits(x) and weight.dtype == torch.bfloat16:
            return self._ops.rms_norm_bf16(x.contiguous(), weight, eps)  # type: ignore[no-any-return]
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fits(x) and residual.shape == x.shape and residual.dtype == x.dtype \
                and weight.dtype == torch.bfloat16:
            out, total = self._ops.add_rms_norm_bf16(x.contiguous(), residual.contiguous(),
                                                     weight, eps)
            return out, total
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if self._fits(x) and x.shape[-1] % 32 == 0:
            return self._ops.silu_and_mul_bf16(x.contiguous())  # type: ignore[no-any-return]
        return super().silu_and_mul(x)

    def rope_qk(self, qk: torch.Tensor, num_q_heads: int, inputs: Any
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass writing q and k (both contiguous) instead of torch's seven ops and k's
        copy; each product, difference and sum rounded to bfloat16 as torch's ops round."""
        cos, sin = inputs
        tokens, _, head_dim = qk.shape
        if qk.dtype == cos.dtype == sin.dtype == torch.bfloat16 and head_dim % 32 == 0 \
                and qk.stride(2) == 1 and qk.stride(1) == head_dim \
                and cos.shape[-1] * 2 == head_dim:
            q, k = self._ops.rope_qk_bf16(qk, cos.reshape(tokens, -1), sin.reshape(tokens, -1),
                                          num_q_heads)
            return q, k
        return super().rope_qk(qk, num_q_heads, inputs)


TORCH_KERNELS = Kernels()


def flashinfer_kernels_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why FlashInfer's fused kernels are not used here (None: they are)."""
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} is not float16 or bfloat16"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed"
    return None


def self_test(kernels: Kernels, rotary: Rotary, device: torch.device,
              dtype: torch.dtype) -> None:
    """Run every kernel once against the torch ones (FlashInfer compiles each on first use:
    a module that cannot be built fails here, at start, not in the first request)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(4, 2 * rotary.inv_freq.numel() * 2, generator=g, device=device).to(dtype)
    weight = torch.ones(x.shape[-1], device=device, dtype=dtype)
    positions = torch.arange(4, device=device)
    q, k = x.view(4, 2, -1).clone(), x.view(4, 2, -1).clone()
    pairs = [(kernels.rms_norm(x.clone(), weight, 1e-6), TORCH_KERNELS.rms_norm(x, weight, 1e-6)),
             (kernels.add_rms_norm(x.clone(), x.clone(), weight, 1e-6)[0],
              TORCH_KERNELS.add_rms_norm(x, x, weight, 1e-6)[0]),
             (kernels.silu_and_mul(x.clone()), TORCH_KERNELS.silu_and_mul(x)),
             (kernels.rope(q.clone(), k.clone(), kernels.rope_inputs(rotary, positions, dtype))[0],
              TORCH_KERNELS.rope(q, k, TORCH_KERNELS.rope_inputs(rotary, positions, dtype))[0])]
    for got, expect in pairs:
        torch.testing.assert_close(got.float(), expect.float(), atol=0.05, rtol=0.05)


def warn_slow_bf16() -> None:
    """One warning where bfloat16 matrix products are emulated: an x86 CPU with neither
    AVX-512-BF16 nor AMX runs them 3-8x slower than float32's (measured: 3.4x on an Intel
    Xeon with AVX-512F only, 5.1-7.6x on an AMD EPYC with AVX2 only; docs/benchmarks.md), so a
    bfloat16 engine there is the slow choice."""
    from pdserve.attention import cpu_decode

    flags = cpu_decode.cpu_flags()
    if flags and not flags & {"avx512_bf16", "amx_bf16"}:
        log.warning("bfloat16 on a CPU without AVX-512-BF16 or AMX: its matrix products run "
                    "3-8x slower than float32's here; --dtype float32 serves faster",
                    extra={"fields": {"cpu_has": sorted(flags & {"avx2", "avx512f"})}})


def kernels_for(rotary: Rotary, max_positions: int, device: torch.device,
                dtype: torch.dtype, native: str = "off") -> Kernels:
    """FlashInfer's kernels where they run and pass ``self_test``; on the CPU in bfloat16,
    pdserve's C++ ones under ``native`` ("auto" | "on" | "off", ``attention/cpu_decode.py``);
    else torch's, saying why."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        warn_slow_bf16()
    if device.type == "cpu" and dtype == torch.bfloat16 and native != "off":
        from pdserve.attention import cpu_decode

        module = cpu_decode.module(native)  # "on" raises where it cannot run
        if module is not None:
            return CpuKernels(module)
    reason = flashinfer_kernels_reason(device, dtype)
    if reason is None:
        try:
            kernels = FlashInferKernels(rotary, max_positions, device)
            self_test(kernels, rotary, device, dtype)
            return kernels
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot build: run torch's
            reason = f"{type(exc).__name__}: {str(exc)[:300]}"
    log.info("elementwise kernels: torch", extra={"fields": {"reason": reason}})
    return TORCH_KERNELS
