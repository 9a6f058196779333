"""pdserve's models against transformers on the same weights, float32, prompts of 1..300."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from pdserve.models import load_model

from .conftest import pdserve_logits, randomize, reference_logits, save_reference

VOCAB = 512  # the built-in tokenizer's
SMALL: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
)
ATOL = 1e-4  # float32, 3 layers, logits of std ~1


def _llama3_rope_old_dialect(directory: Path) -> None:
    """Rewrite config.json the way checkpoints made before transformers 5 spell RoPE."""
    cfg = json.loads((directory / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    cfg["rope_scaling"] = params
    (directory / "config.json").write_text(json.dumps(cfg))


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
CASES: dict[str, tuple[Any, dict[str, Any], dict[str, Any], Callable[[Path], None] | None]] = {
    # name: (config class, extra config, save_pretrained kwargs, config.json rewrite)
    "llama-llama3-rope-parameters": (
        transformers.LlamaConfig, {"rope_parameters": LLAMA3_ROPE, "attention_bias": True},
        {}, None),
    "llama-llama3-rope-scaling": (
        transformers.LlamaConfig, {"rope_parameters": LLAMA3_ROPE}, {},
        _llama3_rope_old_dialect),
    "mistral-sharded": (
        transformers.MistralConfig, {"sliding_window": 4096, "rope_theta": 1e6},
        {"max_shard_size": "100KB"}, None),
    "qwen2-bias-tied-yarn": (
        transformers.Qwen2Config,
        {"tie_word_embeddings": True, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
            "original_max_position_embeddings": 64}}, {}, None),
    "mixtral": (transformers.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2},
                {}, None),
    "qwen2-moe-shared": (
        transformers.Qwen2MoeConfig,
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 48, "norm_topk_prob": False,
         "mlp_only_layers": [1]}, {}, None),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         builtin_dirs: dict[str, Path]) -> tuple[Any, Any, Path]:
    """(transformers model, pdserve LoadedModel, directory) built from one small config."""
    config_cls, extra, save_kwargs, rewrite = CASES[request.param]
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config_cls(**SMALL, **extra))
    randomize(reference, seed=1)
    reference.eval()
    directory = tmp_path_factory.mktemp(request.param)
    save_reference(reference, directory, builtin_dirs["tiny"], **save_kwargs)
    if rewrite is not None:
        rewrite(directory)
    return reference, load_model(str(directory), dtype="float32"), directory


@pytest.mark.parametrize("length", [1, 37, 300])
def test_prompt_logits_match_transformers(pair: tuple[Any, Any, Path], length: int) -> None:
    reference, loaded, _ = pair
    ids = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(length))
    ours, theirs = pdserve_logits(loaded.model, ids), reference_logits(reference, ids)
    assert ours.dtype == torch.float32 and ours.shape == (length, VOCAB)
    assert theirs.std() > 0.3  # logits big enough that a wrong layer could not hide
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def test_positions_offset_match_transformers(pair: tuple[Any, Any, Path]) -> None:
    """Tokens run at positions 500.. (as a decode step deep in a sequence would)."""
    reference, loaded, _ = pair
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(7))
    ours = pdserve_logits(loaded.model, ids, start=500)
    torch.testing.assert_close(ours, reference_logits(reference, ids, start=500),
                               atol=ATOL, rtol=0)


def test_config_fields_follow_checkpoint(pair: tuple[Any, Any, Path]) -> None:
    reference, loaded, directory = pair
    cfg, ref_cfg = loaded.config, reference.config
    assert cfg.architecture == ref_cfg.architectures[0]
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (3, 4, 2, 16)
    assert cfg.dtype == torch.float32 and cfg.eos_token_ids == (1,)
    assert len(cfg.fingerprint) == 64
    if "sharded" in directory.name:
        assert len(list(directory.glob("*.safetensors"))) > 1
    if "tied" in directory.name:
        assert cfg.tie_word_embeddings and loaded.model.lm_head is None


def test_bfloat16_load_stays_close_to_float32(builtin_dirs: dict[str, Path]) -> None:
    f32 = load_model(str(builtin_dirs["tiny"]), dtype="float32")
    bf16 = load_model(str(builtin_dirs["tiny"]), dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    ids = torch.tensor(bf16.tokenizer.encode("The market opens near the bridge."))
    a, b = pdserve_logits(f32.model, ids), pdserve_logits(bf16.model, ids)
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.05 * a.abs().max()
