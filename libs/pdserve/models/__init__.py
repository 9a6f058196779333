"""The model layer: ModelConfig, the CausalLM contract, and load_model.

    loaded = load_model("tiny")                       # or a local Hugging Face directory
    hidden = loaded.model(input_ids, positions, attn)  # attn: an AttentionBackend
    logits = loaded.model.compute_logits(hidden[last_rows])
"""

from pdserve.models.base import CausalLM
from pdserve.models.builtin import BUILTIN_MODELS, save_builtin
from pdserve.models.config import ARCHITECTURES, ModelConfig, MoeConfig, RopeConfig
from pdserve.models.loader import LoadedModel, builtin_tokenizer, load_model

__all__ = [
    "ARCHITECTURES",
    "BUILTIN_MODELS",
    "CausalLM",
    "LoadedModel",
    "ModelConfig",
    "MoeConfig",
    "RopeConfig",
    "builtin_tokenizer",
    "load_model",
    "save_builtin",
]
