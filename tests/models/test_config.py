"""config.json parsing: both RoPE dialects, RoPE frequencies, MoE layout, fingerprints."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pdserve.models import load_model
from pdserve.models.config import RopeConfig, parse_hf_config, parse_rope

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize(("new", "old"), [
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}},
     {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", **LLAMA3}}),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
     {"rope_theta": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, {"rope_theta": 1e6}),
])
def test_both_rope_dialects_parse_alike(new: dict, old: dict) -> None:
    assert parse_rope(new) == parse_rope(old)


def test_default_theta_follows_architecture() -> None:
    base = {"vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
            "intermediate_size": 8, "num_local_experts": 2, "num_experts_per_tok": 1}
    thetas = {arch: parse_hf_config({**base, "architectures": [arch]}, dtype=torch.float32,
                                    eos_token_ids=(), fingerprint="x").rope.theta
              for arch in ("MixtralForCausalLM", "LlamaForCausalLM")}
    assert thetas == {"MixtralForCausalLM": 1e6, "LlamaForCausalLM": 1e4}


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3},
    {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    {"rope_type": "default", "rope_theta": 1e4},
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
     "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "beta_fast": 16.0,
     "original_max_position_embeddings": 64, "truncate": False},
])
def test_inv_freq_matches_transformers(rope_parameters: dict) -> None:
    cfg = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2,
                                   rope_parameters=dict(rope_parameters))
    kind = rope_parameters["rope_type"]
    scaling = 1.0
    if kind == "default":
        expected = 1.0 / (1e4 ** (torch.arange(0, 64, 2).float() / 64))
    else:
        expected, scaling = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    rope = parse_rope({"rope_parameters": rope_parameters})
    torch.testing.assert_close(rope.inv_freq(64), expected.float(), atol=0, rtol=1e-6)
    assert rope.attention_scaling == pytest.approx(scaling, rel=1e-12)
    assert (scaling > 1.0) == (kind == "yarn")


def test_qwen2_moe_dense_layers_and_flags() -> None:
    cfg = {"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 8, "hidden_size": 8,
           "num_hidden_layers": 4, "num_attention_heads": 2, "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 4, "intermediate_size": 8,
           "decoder_sparse_step": 2, "mlp_only_layers": [3], "use_sliding_window": False,
           "sliding_window": 32}
    parsed = parse_hf_config(cfg, dtype=torch.float32, eos_token_ids=(), fingerprint="x")
    assert parsed.moe is not None and parsed.moe.dense_layers == (0, 2, 3)
    assert parsed.qkv_bias and not parsed.o_bias and parsed.sliding_window is None
    assert not parsed.moe.norm_topk_prob and parsed.moe.shared_intermediate_size == 0


def test_rope_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="rope_theta must be > 0"):
        RopeConfig(theta=0)
    with pytest.raises(ValueError, match="high_freq_factor must be > low_freq_factor"):
        RopeConfig(rope_type="llama3", factor=8, low_freq_factor=4, high_freq_factor=1)


def test_fingerprint_tracks_config_and_weight_files(
    tmp_path: Path, builtin_dirs: dict[str, Path]
) -> None:
    copy = Path(shutil.copytree(builtin_dirs["tiny"], tmp_path / "copy"))
    original = load_model(str(builtin_dirs["tiny"])).config.fingerprint
    assert load_model(str(copy)).config.fingerprint == original  # stable, path-independent
    config = copy / "config.json"
    config.write_text(config.read_text() + "\n")
    assert load_model(str(copy)).config.fingerprint != original
    assert load_model(str(builtin_dirs["tiny-moe"])).config.fingerprint != original
