"""Quantized KV cache dtypes: fp8 (e4m3) and int8, with one float32 scale per token per head.

    --kv-cache-dtype   stored values        scale                       bytes per element
    auto               the model's dtype    none                        2 (bf16) / 4 (fp32)
    fp8                float8_e4m3fn        amax(|x| over head_dim)/448  1 + 4 / head_dim
    int8               int8 (round, ±127)   amax(|x| over head_dim)/127  1 + 4 / head_dim

Why per token (and head) and not per block: a block is written a token at a time during decode,
and a per-block scale would force re-quantizing the block's earlier tokens whenever a new one
has a larger magnitude; a token's own scale is fixed when it is written. The scales live next
to the values in the paged cache (``PagedKVCache.scales``) and travel with them in the wire
block (values, then scales). ``x ≈ dequantize(*quantize(x))`` within half a quantization step
of each head's largest magnitude (int8) or 2^-4 relative (fp8's 3 mantissa bits).

FlashInfer's fp8 kernels take only one scalar scale per tensor (``k_scale``/``v_scale``), so a
cache read by FlashInfer keeps every scale at 1.0 (``unit``): tokens are cast to e4m3 as they
are, clamped to ±448, and blocks imported from a scaled writer are re-quantized to unit scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "int8")
SCALE_DTYPE = torch.float32
_TINY = 1e-12  # an all-zero head gets this scale, not 0 (no division by zero)


@dataclass(frozen=True)
class KVQuant:
    """One quantized KV dtype: its name (as in fingerprints and layouts), storage dtype and
    largest representable magnitude."""

    name: str
    storage: torch.dtype
    qmax: float

    def quantize(self, x: torch.Tensor, unit: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [..., head_dim] -> (values [..., head_dim] of ``storage``, scales [...])."""
        xf = x.float()
        if unit:
            scale = torch.ones(xf.shape[:-1], dtype=SCALE_DTYPE, device=x.device)
            return self._cast(xf), scale
        scale = (xf.abs().amax(-1) / self.qmax).clamp_min(_TINY)
        return self._cast(xf / scale.unsqueeze(-1)), scale

    def _cast(self, xf: torch.Tensor) -> torch.Tensor:
        xf = xf.clamp(-self.qmax, self.qmax)
        if self.storage == torch.int8:
            xf = xf.round()
        return xf.to(self.storage)

    @staticmethod
    def dequantize(values: torch.Tensor, scales: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
        """values [..., head_dim] and scales [...] -> [..., head_dim] in ``dtype``."""
        return (values.float() * scales.unsqueeze(-1)).to(dtype)


QUANTS = {
    "fp8": KVQuant("float8_e4m3fn", torch.float8_e4m3fn, 448.0),
    "int8": KVQuant("int8", torch.int8, 127.0),
}
BY_STORAGE_NAME = {q.name: q for q in QUANTS.values()}


def kv_quant(kv_cache_dtype: str) -> KVQuant | None:
    """The quantization ``--kv-cache-dtype`` names (None for "auto"); ValueError naming the
    setting otherwise."""
    if kv_cache_dtype == "auto":
        return None
    quant = QUANTS.get(kv_cache_dtype)
    if quant is None:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                         f"got {kv_cache_dtype!r}")
    return quant


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    quant: KVQuant | None) -> int:
    """KV bytes one token takes in the cache (values and, when quantized, scales)."""
    per_head = head_dim * torch.empty((), dtype=dtype).element_size() if quant is None else (
        head_dim * torch.empty((), dtype=quant.storage).element_size()
        + torch.empty((), dtype=SCALE_DTYPE).element_size())
    return num_layers * 2 * num_kv_heads * per_head
