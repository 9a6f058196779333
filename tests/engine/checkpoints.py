"""Random checkpoints of one small Llama architecture, saved with transformers the way a
trained model is (save_pretrained plus pdserve's built-in tokenizer), and their greedy
reference: the two versions a hot reload moves between."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers

from pdserve.models.builtin_vocab import VOCAB_SIZE, tokenizer_config, tokenizer_json

CONFIG = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, initializer_range=0.1, bos_token_id=0,
              eos_token_id=1)


def save_llama(path: Path, seed: int, **overrides: Any) -> Any:
    """A random Llama checkpoint (weights from ``seed``) in ``path``; returns the HF model."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**CONFIG, **overrides}))
    model.eval().save_pretrained(path)
    (path / "tokenizer.json").write_text(tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                      min_new_tokens=n, do_sample=False)
    return gen[0, len(prompt):].tolist()


