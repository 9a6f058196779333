"""The checkpoints the device check builds: Hugging Face configs with real models' shapes and
random weights (seeded), and pdserve engines over the very same tensors.

    qwen2.5-0.5b    24 layers, 14 query heads on 2 KV heads (GQA 7), head_dim 64, tied embeddings
    llama3-8b-4l    the first 4 layers of Llama-3-8B: 32 on 8 (GQA 4), head_dim 128, llama3 RoPE
    tiny-*          the same architectures shrunk, for ``--smoke`` runs on CPU

Weights are drawn with a larger spread than Hugging Face's default (0.02), so greedy decoding
of a random model varies from token to token instead of repeating one token (a comparison of
repeated tokens would prove little).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.config import EngineArgs
from pdserve.engine.engine import Engine
from pdserve.models import LoadedModel
from pdserve.models.builtin_vocab import tokenizer_config, tokenizer_json
from pdserve.models.config import parse_hf_config
from pdserve.models.loader import _build, builtin_tokenizer

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "vocab_size": 151936,
        "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None,
        "bos_token_id": 151643, "eos_token_id": 151643, "initializer_range": 0.05},
    "llama3-8b-4l": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 4, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 8192, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "vocab_size": 128256,
        "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128001,
        "initializer_range": 0.05},
}
CONFIGS["tiny-qwen"] = {**CONFIGS["qwen2.5-0.5b"], "hidden_size": 224, "intermediate_size": 256,
                        "num_hidden_layers": 2, "vocab_size": 2048, "initializer_range": 0.1}
CONFIGS["tiny-llama"] = {**CONFIGS["llama3-8b-4l"], "hidden_size": 256,
                         "intermediate_size": 512, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 1,
                         "vocab_size": 2048, "initializer_range": 0.1}


def hf_model(name: str, device: torch.device, seed: int = 0) -> Any:
    """The transformers model of ``name`` with seeded random weights, float32, on ``device``."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**CONFIGS[name])
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.eval()


def hf_weights(model: Any) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors under their Hugging Face names (a tied head is not a tensor)."""
    tied = model.config.tie_word_embeddings
    return [(n, t) for n, t in model.state_dict().items()
            if not (tied and n == "lm_head.weight")]


def pdserve_model(name: str, weights: list[tuple[str, torch.Tensor]], dtype: torch.dtype,
                  device: torch.device) -> LoadedModel:
    """pdserve's model over the same tensors (converted to ``dtype``)."""
    config = parse_hf_config(CONFIGS[name], dtype=dtype, eos_token_ids=(1,),
                             fingerprint=f"device-check:{name}")
    model = _build(config, device, ((n, t.to(dtype)) for n, t in weights))
    return LoadedModel(model=model, config=config, tokenizer=builtin_tokenizer())


def engine(lm: LoadedModel, device: torch.device, num_blocks: int, max_num_seqs: int = 8,
           **kw: Any) -> Engine:
    """An engine with an explicit cache size (the check shares its GPU with other parts)."""
    return Engine(lm, EngineArgs(device=str(device), num_blocks=num_blocks,
                                 max_num_seqs=max_num_seqs, **kw))


def save_dir(model: Any, path: Path, dtype: torch.dtype) -> Path:
    """Write the model as a Hugging Face directory pdserve's services load (with the built-in
    tokenizer's files: the check sends token ids, so its vocabulary does not matter)."""
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    (path / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()))
    return path


def prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (num, length), generator=g).tolist()
