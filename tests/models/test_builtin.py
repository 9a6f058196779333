"""Built-in models: deterministic weights, non-degenerate outputs, and save_builtin producing a
directory transformers loads to the same logits."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import transformers

from pdserve.models import BUILTIN_MODELS, load_model
from pdserve.models.builtin import hf_config, iter_weights, tensor_shapes
from pdserve.models.builtin_vocab import tokenizer_json

from .conftest import pdserve_logits, reference_logits

# Pinned digests of the generated weights (Hugging Face names, float32 bytes) and of the
# learned vocabulary: a change here means built-ins differ between machines or versions, which
# would silently invalidate every cached KV block and benchmark baseline.
GOLDEN_WEIGHTS = {
    "tiny": "44fa8b7bb2409b9a8a065724ace6422f0bf2f6ba22d73df3fea5171e179318dc",
    "tiny-moe": "9fe9cd05d3e04367ceffc375684d703b672c0bb8a3915293d7c64cb2005cf2a6",
}
GOLDEN_VOCAB = "f4655338d9e93573d000794c507a4f30ce7051ea2bfe8c0e51c0800ff019c217"


def _weights_digest(name: str, seed: int) -> str:
    h = hashlib.sha256()
    for tensor_name, tensor in iter_weights(name, seed):
        h.update(tensor_name.encode())
        h.update(tensor.numpy().tobytes())
    return h.hexdigest()


def _state_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_same_seed_same_weights(name: str) -> None:
    assert _weights_digest(name, 0) == GOLDEN_WEIGHTS[name]
    first, second = load_model(name), load_model(name)
    assert _state_digest(first.model) == _state_digest(second.model)
    assert _state_digest(load_model(f"{name}@1").model) != _state_digest(first.model)


def test_vocabulary_is_pinned() -> None:
    model = json.loads(tokenizer_json())["model"]
    blob = json.dumps([model["vocab"], model["merges"]], sort_keys=True).encode()
    assert hashlib.sha256(blob).hexdigest() == GOLDEN_VOCAB


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_fingerprint_names_model_and_seed(name: str) -> None:
    assert load_model(name).config.fingerprint == f"{name}@0"
    assert load_model(f"{name}@3").config.fingerprint == f"{name}@3"


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_save_builtin_loads_in_transformers_with_same_logits(
    name: str, builtin_dirs: dict[str, Path]
) -> None:
    ours = load_model(name)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        builtin_dirs[name], dtype=torch.float32).eval()
    ids = torch.tensor(ours.tokenizer.encode("Tell me a story about a cat who wanted to fly."))
    torch.testing.assert_close(pdserve_logits(ours.model, ids), reference_logits(reference, ids),
                               atol=1e-5, rtol=0)
    # The directory path gives the same model as the built-in name (but its own fingerprint).
    from_dir = load_model(str(builtin_dirs[name]))
    assert _state_digest(from_dir.model) == _state_digest(ours.model)
    assert from_dir.config.fingerprint != ours.config.fingerprint


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_greedy_prediction_depends_on_prompt(name: str) -> None:
    loaded = load_model(name)
    prompts = ["The river starts", "What is the capital of France?", "Numbers: 1 2 3",
               "Please write a short poem", "Computers read text as numbers."]
    last = [int(pdserve_logits(loaded.model, torch.tensor(loaded.tokenizer.encode(p)))[-1]
                .argmax()) for p in prompts]
    assert len(set(last)) >= 3, last


def test_sizes() -> None:
    sizes = {n: sum(torch.Size(s).numel() for s in tensor_shapes(hf_config(n)).values())
             for n in BUILTIN_MODELS}
    assert 2e6 < sizes["tiny"] < 6e6 and 2e6 < sizes["tiny-moe"] < 8e6
    assert 45e6 < sizes["bench-50m"] < 55e6
    tiny = load_model("tiny").config
    assert tiny.head_dim >= 32 and tiny.num_kv_heads < tiny.num_heads
    assert tiny.vocab_size == load_model("tiny").tokenizer.vocab_size
