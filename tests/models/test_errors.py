"""Every user-caused error names the thing that is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.models import ModelConfig, load_model, save_builtin
from pdserve.models.config import MoeConfig, RopeConfig, parse_hf_config


@pytest.fixture
def tiny_copy(tmp_path: Path, builtin_dirs: dict[str, Path]) -> Path:
    return Path(shutil.copytree(builtin_dirs["tiny"], tmp_path / "tiny"))


def _edit_config(directory: Path, **changes: object) -> None:
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(changes)
    (directory / "config.json").write_text(json.dumps(cfg))


def test_unknown_architecture(tiny_copy: Path) -> None:
    _edit_config(tiny_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unknown architecture 'GPT2LMHeadModel'"):
        load_model(str(tiny_copy))


@pytest.mark.parametrize("filename", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file_is_named(tiny_copy: Path, filename: str) -> None:
    (tiny_copy / filename).unlink()
    expected = "safetensors" if filename == "model.safetensors" else filename
    with pytest.raises(FileNotFoundError, match=expected):
        load_model(str(tiny_copy))


def test_missing_shard_is_named(tiny_copy: Path) -> None:
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (tiny_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_model(str(tiny_copy))


def test_unknown_model_name_and_missing_directory() -> None:
    with pytest.raises(ValueError, match="unknown model 'huge'.*tiny"):
        load_model("huge")
    with pytest.raises(FileNotFoundError, match="/no/such/model"):
        load_model("/no/such/model")
    with pytest.raises(ValueError, match="seed"):
        load_model("tiny@abc")
    with pytest.raises(ValueError, match="unknown built-in model 'huge'"):
        save_builtin("huge", "/tmp/never-written")


def test_bad_dtype() -> None:
    with pytest.raises(ValueError, match="dtype must be one of.*got 'float8'"):
        load_model("tiny", dtype="float8")


def test_missing_and_unexpected_and_misshapen_tensors(tiny_copy: Path) -> None:
    weights = load_file(str(tiny_copy / "model.safetensors"))
    norm = weights.pop("model.layers.2.post_attention_layernorm.weight")
    save_file(weights, str(tiny_copy / "model.safetensors"))
    with pytest.raises(ValueError, match="missing weights.*layers.2.post_attention_layernorm"):
        load_model(str(tiny_copy))
    weights["model.layers.2.post_attention_layernorm.weight"] = norm
    weights["model.layers.0.self_attn.extra.weight"] = norm.clone()
    save_file(weights, str(tiny_copy / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.self_attn.extra"):
        load_model(str(tiny_copy))
    del weights["model.layers.0.self_attn.extra.weight"]
    weights["model.norm.weight"] = torch.ones(7)
    save_file(weights, str(tiny_copy / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(7,\)"):
        load_model(str(tiny_copy))


def test_unsupported_config_fields(tiny_copy: Path) -> None:
    _edit_config(tiny_copy, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        load_model(str(tiny_copy))
    _edit_config(tiny_copy, hidden_act="silu", rope_scaling={"rope_type": "longrope"})
    with pytest.raises(ValueError, match="rope_type 'longrope'"):
        load_model(str(tiny_copy))
    _edit_config(tiny_copy, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        load_model(str(tiny_copy))
    _edit_config(tiny_copy, rope_scaling=None, hidden_size=None)
    with pytest.raises(ValueError, match="missing required field 'hidden_size'"):
        load_model(str(tiny_copy))


def _config(**changes: object) -> ModelConfig:
    fields: dict[str, object] = dict(
        architecture="LlamaForCausalLM", vocab_size=10, hidden_size=8, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=4, max_position_embeddings=16,
        dtype=torch.float32, eos_token_ids=(1,), fingerprint="x", intermediate_size=8)
    return ModelConfig(**{**fields, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_heads": 3, "num_kv_heads": 2}, "num_heads .3. must be a multiple of num_kv_heads"),
    ({"vocab_size": 0}, "vocab_size must be >= 1"),
    ({"head_dim": 3}, "head_dim must be even"),
    ({"dtype": torch.int8}, "dtype must be one of"),
    ({"fingerprint": ""}, "fingerprint must be non-empty"),
    ({"architecture": "Foo"}, "unknown architecture 'Foo'"),
    ({"architecture": "MixtralForCausalLM"}, "moe config"),
])
def test_model_config_validation(changes: dict[str, object], message: str) -> None:
    _config()  # the base is valid
    with pytest.raises(ValueError, match=message):
        _config(**changes)


def test_moe_and_rope_validation() -> None:
    with pytest.raises(ValueError, match="num_experts_per_tok must be in"):
        MoeConfig(num_experts=2, top_k=3, intermediate_size=4, norm_topk_prob=True)
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        RopeConfig(rope_type="dynamic")
    with pytest.raises(ValueError, match="no 'architectures'"):
        parse_hf_config({}, dtype=torch.float32, eos_token_ids=(), fingerprint="x")
