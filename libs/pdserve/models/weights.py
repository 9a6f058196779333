"""Hugging Face tensor names -> pdserve parameters (with the rows a fused parameter takes).

    q_proj | k_proj | v_proj       -> self_attn.qkv_proj   rows [q | k | v]
    gate_proj | up_proj (or w1|w3) -> gate_up_proj / w13   rows [gate | up]
    experts.<e>.*                  -> w13[e] / w2[e]       (stacked experts)
    block_sparse_moe.*             -> mlp.*                (Mixtral's name for its MoE block)

Every parameter must be filled completely; a tensor with no home is an error, so a naming
mistake can never leave random memory in the model.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pdserve.models.config import ModelConfig

_ROW_SHARDS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_EXPERT_RE = re.compile(
    r"(?P<mlp>.+\.mlp)\.experts\.(?P<e>\d+)\.(?P<w>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_EXPERT_ROWS = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}
_FUSED_EXPERTS = {".mlp.experts.gate_up_proj": ".mlp.w13", ".mlp.experts.down_proj": ".mlp.w2"}
Index = tuple[int | slice, ...]


class WeightRouter:
    def __init__(self, config: ModelConfig, params: dict[str, nn.Parameter]) -> None:
        self.config = config
        self.params = params
        self.filled = dict.fromkeys(params, 0)

    def load(self, hf_name: str, tensor: torch.Tensor) -> None:
        target = self.route(hf_name)
        if target is None:
            return
        param_name, index = target
        param = self.params.get(param_name)
        if param is None:
            raise ValueError(f"unexpected tensor {hf_name!r} in checkpoint (no such parameter)")
        dst = param.data[index]
        if dst.shape != tensor.shape:
            raise ValueError(
                f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
            )
        dst.copy_(tensor)
        self.filled[param_name] += tensor.numel()

    def route(self, hf_name: str) -> tuple[str, Index] | None:
        """(parameter name, index into it), or None for tensors deliberately skipped."""
        name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
        if name.endswith("rotary_emb.inv_freq"):
            return None  # a cache the reference saves, recomputed here
        if name in ("embed_tokens.weight", "lm_head.weight"):
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                return None  # tied: the output projection is the embedding
            return name.removesuffix(".weight"), ()
        if match := _EXPERT_RE.match(name):
            mlp, expert, w = match["mlp"], int(match["e"]), match["w"]
            if w in ("w2", "down_proj"):
                return f"{mlp}.w2", (expert,)
            return f"{mlp}.w13", (expert, self._rows(f"{mlp}.w13", _EXPERT_ROWS[w], dim=1))
        for suffix, fused in _FUSED_EXPERTS.items():
            if name.endswith(suffix):
                return name.removesuffix(suffix) + fused, ()
        module, _, kind = name.rpartition(".")
        prefix, _, proj = module.rpartition(".")
        if proj in _ROW_SHARDS:
            fused, shard = _ROW_SHARDS[proj]
            param_name = f"{prefix}.{fused}.{kind}"
            return param_name, (self._rows(param_name, shard, dim=0),)
        return name, ()

    def _rows(self, param_name: str, shard: int, dim: int) -> slice:
        if param_name.endswith("qkv_proj.weight") or param_name.endswith("qkv_proj.bias"):
            sizes = [self.config.q_size, self.config.kv_size, self.config.kv_size]
        else:
            param = self.params.get(param_name)
            if param is None:
                raise ValueError(f"unexpected tensor for {param_name!r} in checkpoint")
            half = param.shape[dim] // 2
            sizes = [half, half]
        start = sum(sizes[:shard])
        return slice(start, start + sizes[shard])

    def check_complete(self) -> None:
        missing = [n for n, p in self.params.items() if self.filled[n] != p.numel()]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(
                f"checkpoint is missing weights for {len(missing)} parameters: {shown}"
            )
