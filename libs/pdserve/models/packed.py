"""Pre-packed CPU GEMM weights: each ``Linear`` weight reordered once, at load, into the
blocked layout the CPU GEMM library wants, so no step pays the reorder.

    float32    MKL's packed sgemm (``torch.ops.mkl._mkl_linear``): bit-identical to
               ``F.linear`` on the plain weight; the packed path runs only when a call has
               exactly ``PACK_BATCH_SIZE`` rows, any other count runs ``F.linear`` on the
               plain weight, so that weight stays
    bfloat16   oneDNN's prepacked linear (``torch.ops.mkldnn._linear_pointwise``): AMX tiles
               or AVX-512-BF16 where the CPU has them, bit-identical to ``F.linear``, any
               rows; it never reads the plain weight, so ``release_plain`` lets the loader
               free it

(measured with torch 2.13 on a 2-core AVX-512/AMX machine; ``pdserve bench engine`` reports
the GEMM ceiling with these weights.) Where neither op exists (no MKL / oneDNN build, other
dtypes, other devices, bfloat16 on a CPU without AVX-512) ``pack`` returns None and the layer
keeps ``F.linear``.

Memory: torch sizes MKL's packed buffer in float32 elements from a byte count, so the packed
copy of a float32 weight takes 1.6-4.5x the weight's own bytes (``nbytes``); engines short of
memory load with ``packed_weights=False`` (``--packed-weights off``).
"""

from __future__ import annotations

import math

import torch

PACK_BATCH_SIZE = 32  # the decode batch the packing is tuned for


class PackedWeight:
    """``x @ W^T (+ b)`` through a pre-packed copy of ``W`` [out, in]."""

    def __init__(self, weight: torch.Tensor, kind: str) -> None:
        self.kind = kind
        self.shape = tuple(weight.shape)
        # MKL falls back to F.linear on the plain weight for other row counts; oneDNN never
        # reads it, so it is not kept here.
        self.weight: torch.Tensor | None = weight if kind == "mkl" else None
        if kind == "mkl":
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_BATCH_SIZE)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_SIZE)

    @property
    def release_plain(self) -> bool:
        """Whether the layer's plain weight may be dropped (nothing here reads it)."""
        return self.weight is None

    @property
    def nbytes(self) -> int:
        """Bytes torch allocated for the packed copy (the plain weight not counted)."""
        return math.prod(self.packed.shape) * self.packed.element_size()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kind == "mkl":
            return torch.ops.mkl._mkl_linear(  # type: ignore[no-any-return]
                x, self.packed, self.weight, bias, PACK_BATCH_SIZE)
        return torch.ops.mkldnn._linear_pointwise(  # type: ignore[no-any-return]
            x, self.packed, bias, "none", [], "")


FLOAT32_GEMMS = ("mkl", "onednn")


def pack_kind(weight: torch.Tensor, float32_gemm: str = "mkl") -> str | None:
    """Which packed GEMM serves this weight here (None: plain ``F.linear``). ``float32_gemm``
    "onednn" packs float32 weights for oneDNN instead of MKL: not bit-identical to
    ``F.linear`` (different summation order), but 1.2-1.5x faster on an AMD EPYC, where MKL
    does not run its AVX-512 code (docs/benchmarks.md)."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if weight.dtype == torch.float32 and float32_gemm == "onednn" \
            and torch.backends.mkldnn.is_available():
        return "onednn"
    if weight.dtype == torch.float32 and torch.backends.mkl.is_available():
        return "mkl"
    if weight.dtype == torch.bfloat16 and onednn_bf16_supported():
        return "onednn"
    return None


def onednn_bf16_supported() -> bool:
    """Whether oneDNN runs bfloat16 GEMMs on this CPU: it needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and refuses to pack a weight elsewhere (an AVX2-only CPU)."""
    return bool(torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def column_major_pays(dtype: torch.dtype) -> bool:
    """Whether a plain (unpacked) weight of ``dtype`` is better stored column-major (the
    loader's ``_pack_linears``): float32 always (MKL takes either layout; 1.3-1.9x faster on
    AVX-512, the same within 7% on an AVX2-only EPYC), bfloat16 and float16 only where oneDNN
    runs them. On a CPU where it does not (AVX2 only) torch's fallback GEMM for a transposed
    half-precision weight ran 9-11x slower than for a row-major one (32 rows, bench-50m's four
    shapes: bfloat16 302.6 ms against 33.6; float16 297.2 against 28.0; docs/benchmarks.md)."""
    return dtype == torch.float32 or onednn_bf16_supported()


def pack(weight: torch.Tensor, float32_gemm: str = "mkl") -> PackedWeight | None:
    """A packed copy of ``weight`` [out, in], or None where no packed GEMM applies."""
    kind = pack_kind(weight, float32_gemm)
    if kind is None:
        return None
    weight = weight.detach().contiguous()
    packed = PackedWeight(weight, kind)
    probe = torch.ones(2, weight.shape[1], dtype=weight.dtype)
    expect = torch.nn.functional.linear(probe, weight)
    if not torch.allclose(packed.linear(probe, None).float(), expect.float(),
                          rtol=1e-2, atol=1e-3):
        return None  # a build whose packed op disagrees: keep the plain GEMM
    return packed
