"""Built-in models that need no download: ``tiny``, ``tiny-moe``, ``bench-50m``.

A built-in is a Hugging Face config dict plus tensors under Hugging Face names, generated
from ``(seed, tensor name)``: the same seed gives bit-identical weights on every machine.
Weights are uniform with std 0.02 (like HF's normal init in scale) drawn by ``torch.rand``,
whose floats are exact multiples of 2**-24, then scaled in float32 and cast: no
transcendental function whose last bit could differ between CPUs.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.models import builtin_vocab as btok

if TYPE_CHECKING:
    import torch

_INIT_STD = 0.02
_COMMON: dict[str, Any] = {
    "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "vocab_size": btok.VOCAB_SIZE, "dtype": "float32",
    "rope_theta": 10000.0, "attention_bias": False,
}
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    # ~3.3M parameters: head_dim 32, GQA 8:2.
    "tiny": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "max_position_embeddings": 4096,
    },
    # ~5.6M parameters: 4 experts, top-2.
    "tiny-moe": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 256,
        "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "max_position_embeddings": 4096, "num_local_experts": 4,
        "num_experts_per_tok": 2, "router_jitter_noise": 0.0, "sliding_window": None,
    },
    # ~50M parameters, for benchmarks: head_dim 64, GQA 8:2.
    "bench-50m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
        "intermediate_size": 2816, "num_hidden_layers": 10, "num_attention_heads": 8,
        "num_key_value_heads": 2, "max_position_embeddings": 8192,
    },
}
BUILTIN_MODELS = tuple(BUILTIN_CONFIGS)


def parse_builtin(source: str) -> tuple[str, int] | None:
    """``"tiny"`` -> ("tiny", 0); ``"tiny@7"`` -> ("tiny", 7); anything else -> None."""
    name, sep, seed = source.partition("@")
    if name not in BUILTIN_CONFIGS:
        return None
    if not sep:
        return name, 0
    if not seed.isdigit():
        raise ValueError(f"built-in model seed must be a non-negative integer, got {seed!r}")
    return name, int(seed)


def fingerprint(name: str, seed: int) -> str:
    """The block-hash fingerprint of a built-in: the name and seed fix every weight."""
    return f"{name}@{seed}"


def hf_config(name: str) -> dict[str, Any]:
    if name not in BUILTIN_CONFIGS:
        raise ValueError(f"unknown built-in model {name!r}; one of {list(BUILTIN_MODELS)}")
    return {**_COMMON, **BUILTIN_CONFIGS[name]}


def tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes of a Llama or Mixtral config."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = hidden // heads
    q, kv, inter = heads * head_dim, cfg["num_key_value_heads"] * head_dim, cfg["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,),
                   p + "self_attn.q_proj.weight": (q, hidden),
                   p + "self_attn.k_proj.weight": (kv, hidden),
                   p + "self_attn.v_proj.weight": (kv, hidden),
                   p + "self_attn.o_proj.weight": (hidden, q)}
        if "num_local_experts" in cfg:
            shapes[p + "block_sparse_moe.gate.weight"] = (cfg["num_local_experts"], hidden)
            for e in range(cfg["num_local_experts"]):
                x = f"{p}block_sparse_moe.experts.{e}."
                shapes |= {x + "w1.weight": (inter, hidden), x + "w2.weight": (hidden, inter),
                           x + "w3.weight": (inter, hidden)}
        else:
            shapes |= {p + "mlp.gate_proj.weight": (inter, hidden),
                       p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter)}
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (cfg["vocab_size"], hidden)
    return shapes


def _tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    import torch  # here: the configs above are read by processes without torch (the router)

    if name.endswith("norm.weight"):
        return torch.ones(shape)
    digest = hashlib.sha256(f"pdserve-builtin:{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    half_width = _INIT_STD * math.sqrt(3.0)  # uniform(-a, a) has std a / sqrt(3)
    return (torch.rand(shape, generator=gen) * 2.0 - 1.0) * half_width


def iter_weights(name: str, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of built-in ``name``, generated lazily."""
    for tensor_name, shape in tensor_shapes(hf_config(name)).items():
        yield tensor_name, _tensor(tensor_name, shape, seed)


def save_builtin(name: str, directory: str | Path, seed: int = 0) -> Path:
    """Write built-in ``name`` as a Hugging Face model directory transformers can load."""
    parsed = parse_builtin(name)
    if parsed is None:
        raise ValueError(f"unknown built-in model {name!r}; one of {list(BUILTIN_MODELS)}")
    if "@" in name:
        name, seed = parsed
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(name)
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    from safetensors.torch import save_file

    save_file(dict(iter_weights(name, seed)), str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "tokenizer.json").write_text(btok.tokenizer_json(), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(btok.tokenizer_config(), indent=2))
    generation = {"bos_token_id": 0, "eos_token_id": 1}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path
