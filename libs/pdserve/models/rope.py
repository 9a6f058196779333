"""Rotary position embeddings: parameters from config.json, frequencies, and application.

Both config dialects are read: the old ``rope_theta`` + ``rope_scaling`` pair and the
``rope_parameters`` dict that transformers >= 5 writes with ``save_pretrained``. Frequencies
follow transformers' rope init functions (default, linear, llama3, yarn) so logits match it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn
    attention_factor: float | None = None  # yarn; None = derived from factor (and mscale)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported (one of {ROPE_TYPES})")
        if self.theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.theta}")
        if self.factor <= 0:
            raise ValueError(f"rope factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("rope high_freq_factor must be > low_freq_factor for llama3")

    @property
    def attention_scaling(self) -> float:
        """Factor applied to cos and sin (YaRN's attention temperature; 1 otherwise)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return get_mscale(self.factor, self.mscale) / get_mscale(self.factor,
                                                                     self.mscale_all_dim)
        return get_mscale(self.factor)

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """[head_dim // 2] float32 inverse frequencies."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            return self._llama3(inv_freq)
        if self.rope_type == "yarn":
            return self._yarn(head_dim)
        return inv_freq

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        # Long wavelengths are divided by `factor`, short ones kept, the band between blended.
        old_len = self.original_max_position_embeddings
        low_wavelen = old_len / self.low_freq_factor
        high_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)

    def _yarn(self, dim: int) -> torch.Tensor:
        # Dimensions rotating fast enough keep their frequency (extrapolate), slow ones are
        # divided by `factor` (interpolate), with a linear ramp between the two bounds.
        def correction_dim(rotations: float) -> float:
            ratio = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return dim * math.log(ratio) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        pos_freqs = self.theta ** (torch.arange(0, dim, 2).float() / dim)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low),
                           0, 1)
        extrapolation = 1 - ramp
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + (
            1.0 / pos_freqs
        ) * extrapolation


def parse_rope(cfg: Mapping[str, Any], default_theta: float = 10000.0) -> RopeConfig:
    """Read either dialect: ``rope_parameters`` (new) or ``rope_theta`` + ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or {})
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
        if cfg.get("rope_theta") is not None:
            params["rope_theta"] = cfg["rope_theta"]
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta", default_theta))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported (one of {ROPE_TYPES})")
    original = params.get("original_max_position_embeddings")
    if original is None:
        original = cfg.get("max_position_embeddings")
    factor = params.get("factor")
    if factor is None and rope_type == "yarn" and original and cfg.get("max_position_embeddings"):
        factor = cfg["max_position_embeddings"] / original
    if factor is None:
        raise ValueError(f"rope scaling {rope_type!r} needs field 'factor'")
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(factor))
    if original is None:
        raise ValueError(f"rope scaling {rope_type!r} needs 'original_max_position_embeddings'")
    if rope_type == "yarn":
        optional = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")
        extra = {k: float(params[k]) for k in optional if params.get(k) is not None}
        return RopeConfig(theta=theta, rope_type="yarn", factor=float(factor),
                          original_max_position_embeddings=int(original),
                          truncate=bool(params.get("truncate", True)), **extra)
    for key in ("low_freq_factor", "high_freq_factor"):
        if key not in params:
            raise ValueError(f"rope scaling 'llama3' needs field {key!r}")
    return RopeConfig(
        theta=theta, rope_type="llama3", factor=float(factor),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(original),
    )


class Rotary(nn.Module):
    """Neox-style RoPE (rotate halves); cos/sin are built once per forward for all layers.

    ``inv_freq`` is a plain attribute, not a buffer: ``model.to(bfloat16)`` must not round it,
    and models are built on the meta device, which would leave a buffer empty.
    """

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        with torch.device("cpu"):
            self.inv_freq = rope.inv_freq(head_dim)
        self.scaling = rope.attention_scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def cos_sin_cache(self, max_positions: int, device: torch.device) -> torch.Tensor:
        """``[max_positions, head_dim]`` float32, cos then sin of every position (the table
        fused RoPE kernels index by position), with the same frequencies and scaling."""
        positions = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = positions[:, None] * self.inv_freq.to(device)[None, :]
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * self.scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
