"""ModelConfig: everything the engine and kvd need about a model, parsed from config.json."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.models.rope import RopeConfig, parse_rope

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM")
ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
# rope_theta when config.json names none (the transformers class defaults).
_DEFAULT_THETA = {"MixtralForCausalLM": 1e6}


@dataclass(frozen=True)
class MoeConfig:
    """Sparse MLP: top-k of ``num_experts``; ``dense_layers`` keep a plain MLP (Qwen2-MoE)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int = 0  # 0 = no shared expert
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, {self.num_experts}], got {self.top_k}"
            )
        if self.intermediate_size < 1:
            raise ValueError(f"moe intermediate_size must be >= 1, got {self.intermediate_size}")


@dataclass(frozen=True)
class ModelConfig:
    """The engine-facing description of a model (fields after ``fingerprint`` feed the layers).

    fingerprint: stable id of (architecture, config, weights); part of every block hash so two
    different models never share KV blocks. Built-ins: ``"tiny@<seed>"``; directories: sha256
    of config.json text plus the sorted safetensors file names and sizes.
    sliding_window: the checkpoint's attention window, if any. pdserve attends over the full
    context, so outputs match the reference only for contexts up to this length.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    fingerprint: str
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    moe: MoeConfig | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"unknown architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype}")
        if self.moe is None and self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1, got {self.intermediate_size}")
        if (self.moe is not None) != (self.architecture in MOE_ARCHITECTURES):
            raise ValueError("moe config must be given exactly for MoE architectures")
        if not self.fingerprint:
            raise ValueError("fingerprint must be non-empty")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def resolve_dtype(dtype: str, hf_config: Mapping[str, Any],
                  device: torch.device | str = "cpu") -> torch.dtype:
    """``auto`` takes the checkpoint's dtype (``dtype``/``torch_dtype``), else float32; on CUDA
    a float32 checkpoint runs in bfloat16 (half the memory and traffic, tensor cores)."""
    if dtype == "auto":
        name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
        if name not in DTYPES:
            raise ValueError(f"config.json dtype {name!r} is not one of {list(DTYPES)}")
        if torch.device(device).type == "cuda" and DTYPES[name] == torch.float32:
            return torch.bfloat16
        return DTYPES[name]
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {['auto', *DTYPES]}, got {dtype!r}")
    return DTYPES[dtype]


def _require(cfg: Mapping[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise ValueError(f"config.json is missing required field {key!r}")
    return cfg[key]


def _parse_moe(cfg: Mapping[str, Any], architecture: str, num_layers: int) -> MoeConfig:
    if architecture == "MixtralForCausalLM":
        return MoeConfig(
            num_experts=int(_require(cfg, "num_local_experts")),
            top_k=int(_require(cfg, "num_experts_per_tok")),
            intermediate_size=int(_require(cfg, "intermediate_size")),
            norm_topk_prob=True,
        )
    step = int(cfg.get("decoder_sparse_step") or 1)
    only_dense = set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(num_layers) if i in only_dense or (i + 1) % step)
    return MoeConfig(
        num_experts=int(_require(cfg, "num_experts")),
        top_k=int(_require(cfg, "num_experts_per_tok")),
        intermediate_size=int(_require(cfg, "moe_intermediate_size")),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        dense_layers=dense,
    )


def _sliding_window(cfg: Mapping[str, Any], architecture: str) -> int | None:
    if architecture.startswith("Qwen2") and not cfg.get("use_sliding_window"):
        return None
    window = cfg.get("sliding_window")
    return int(window) if window else None


def parse_hf_config(
    cfg: Mapping[str, Any], *, dtype: torch.dtype, eos_token_ids: tuple[int, ...],
    fingerprint: str,
) -> ModelConfig:
    """Build a ModelConfig from a config.json dict; errors name the offending field."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' field")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    hidden = int(_require(cfg, "hidden_size"))
    heads = int(_require(cfg, "num_attention_heads"))
    layers = int(_require(cfg, "num_hidden_layers"))
    attention_bias = bool(cfg.get("attention_bias", False))
    is_llama = arch == "LlamaForCausalLM"
    # Only Llama reads attention_bias (q, k, v and o); Qwen2 always has q, k, v biases.
    qkv_bias = {"LlamaForCausalLM": attention_bias, "Qwen2ForCausalLM": True,
                "Qwen2MoeForCausalLM": cfg.get("qkv_bias", True)}
    is_moe = arch in MOE_ARCHITECTURES
    return ModelConfig(
        architecture=arch,
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
        dtype=dtype,
        eos_token_ids=eos_token_ids,
        fingerprint=fingerprint,
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        rope=parse_rope(cfg, default_theta=_DEFAULT_THETA.get(arch, 10000.0)),
        qkv_bias=bool(qkv_bias.get(arch, False)),
        o_bias=attention_bias and is_llama,
        mlp_bias=bool(cfg.get("mlp_bias", False)) and is_llama,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        moe=_parse_moe(cfg, arch, layers) if is_moe else None,
        sliding_window=_sliding_window(cfg, arch),
    )
