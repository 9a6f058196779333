"""pdserve against Hugging Face transformers on the same random weights (float32).

Random Llama, Mixtral and Qwen2 (q/k/v bias, tied embeddings) models are built from small
configs with transformers, saved with save_pretrained and loaded by pdserve from the directory.
Tolerance on prompt logits: max abs difference <= 1e-4 (logits are O(1); float32 kernels differ
only in summation order).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from pdserve.attention import get_backend
from pdserve.attention.base import AttentionMetadata
from pdserve.engine.config import EngineArgs
from pdserve.engine.engine import Engine
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.models.builtin_vocab import VOCAB_SIZE, tokenizer_config, tokenizer_json
from pdserve.sampling_params import SamplingParams

LOGIT_ATOL = 1e-4
NEW_TOKENS = 32
PROMPT_LENS = [1, 7, 16, 33, 64, 129, 200, 300]  # two prompts each -> 16 prompts
_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, initializer_range=0.1, bos_token_id=0,
               eos_token_id=1)
CONFIGS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
                     sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(tie_word_embeddings=True, use_sliding_window=False)),
}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(2, VOCAB_SIZE, (n,), generator=g).tolist()
            for n in PROMPT_LENS for _ in range(2)]


def _save(kind: str, path: Path) -> Any:
    config_cls, model_cls, extra = CONFIGS[kind]
    torch.manual_seed(list(CONFIGS).index(kind))
    config = config_cls(**_COMMON, **extra)
    model = model_cls(config).eval()
    if kind == "qwen2":  # random biases (transformers zero-inits them) so they are exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()))
    model.generation_config.eos_token_id = None  # compare all NEW_TOKENS tokens
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    hf = _save(request.param, path)
    engine = Engine.from_model(str(path), EngineArgs(dtype="float32", num_blocks=400))
    return request.param, hf, engine


@torch.inference_mode()
def _hf_greedy(hf: Any, prompts: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for i in range(0, len(prompts), 2):  # same-length pairs batch without padding
        ids = torch.tensor(prompts[i:i + 2])
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, do_sample=False)
        out += gen[:, ids.shape[1]:].tolist()
    return out


def _generate(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    engine.check_integrity()
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def test_greedy_matches_transformers(pair) -> None:
    kind, hf, engine = pair
    prompts = _prompts()
    expected = _hf_greedy(hf, prompts)
    got = _generate(engine, prompts)
    assert all(len(e) == NEW_TOKENS for e in expected)
    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        assert g == e, f"{kind} prompt {i} (len {len(prompts[i])}) diverges"


@torch.inference_mode()
def test_prompt_logits_match_transformers(pair) -> None:
    """Whole prompt in one step, then again as two chunks over a cached prefix."""
    kind, hf, engine = pair
    model, cfg = engine.runner.model, engine.config
    prompt = _prompts()[-1]
    ref = hf(torch.tensor([prompt])).logits[0]
    cache = PagedKVCache(cfg.num_layers, 32, 16, cfg.num_kv_heads, cfg.head_dim,
                         torch.float32, "cpu")
    backend = get_backend("torch", cache.layers)
    pages = list(range(31, 31 - 19, -1))  # scattered, descending pages
    for start, end in [(0, len(prompt)), (0, 100), (100, len(prompt))]:
        n = end - start
        pos = torch.arange(start, end)
        backend.prepare(AttentionMetadata(
            qo_indptr=torch.tensor([0, n], dtype=torch.int32), page_table=[pages],
            kv_lens=torch.tensor([end], dtype=torch.int32),
            slot_mapping=torch.tensor(pages)[pos // 16] * 16 + pos % 16, is_decode_only=False))
        logits = model.compute_logits(model(torch.tensor(prompt[start:end]), pos, backend))
        diff = (logits - ref[start:end]).abs().max().item()
        assert diff <= LOGIT_ATOL, f"{kind} logits [{start}:{end}] differ by {diff}"
