"""Part a: greedy tokens and logits of pdserve vs transformers, same random weights, same device.

float32: pdserve's tokens must equal transformers' (both in float32; FlashInfer has no float32
kernels, so pdserve runs its torch attention there). bfloat16: the target is stated relative
to bfloat16's own noise on this checkpoint: pdserve's largest last-position logit deviation
from transformers' float32 logits may be at most ``BF16_TOLERANCE`` times transformers'
bfloat16 deviation (plus 0.01). Greedy tokens in bfloat16 are reported (how many lead equal),
not required: random weights give near-ties that bfloat16 rounding breaks either way.
"""

from __future__ import annotations

from typing import Any

import torch

from pdserve.attention import get_backend
from pdserve.attention.base import AttentionMetadata
from pdserve.engine.kv_cache import PagedKVCache
from pdserve.models import LoadedModel
from pdserve.sampling_params import SamplingParams
from pdserve_bench.gpu import shapes

BF16_TOLERANCE = 2.0
NEW_TOKENS = 24
PROMPT_LENS = (37, 64, 101)


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         pad_token_id=0, eos_token_id=None)
    return [int(t) for t in out[0, len(prompt):].tolist()]


def pdserve_greedy(lm: LoadedModel, device: torch.device, prompt_list: list[list[int]],
                   new_tokens: int) -> tuple[list[list[int]], str]:
    """Tokens per prompt (all in one batch), and which attention backend and elementwise
    kernels produced them."""
    eng = shapes.engine(lm, device, num_blocks=64 * len(prompt_list))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompt_list):
        eng.add_request(f"a{i}", p, params)
    tokens: dict[str, list[int]] = {f"a{i}": [] for i in range(len(prompt_list))}
    while eng.has_unfinished():
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
    used = f"{type(eng.runner.backend).__name__}, {eng.kernels} kernels"
    return [tokens[f"a{i}"] for i in range(len(prompt_list))], used


@torch.inference_mode()
def pdserve_last_logits(lm: LoadedModel, device: torch.device, prompt: list[int]
                        ) -> torch.Tensor:
    """Float32 logits of the prompt's last position: one prefill on a throwaway cache."""
    cfg, n, bs = lm.config, len(prompt), 16
    pages = -(-n // bs)
    cache = PagedKVCache(cfg.num_layers, pages, bs, cfg.num_kv_heads, cfg.head_dim, cfg.dtype,
                         device)
    backend = get_backend("auto", cache.layers, cfg.num_heads)
    backend.prepare(AttentionMetadata(torch.tensor([0, n], dtype=torch.int32),
                                      [list(range(pages))], torch.tensor([n], dtype=torch.int32),
                                      torch.arange(n), n == 1))
    hidden = lm.model(torch.tensor(prompt, device=device), torch.arange(n, device=device),
                      backend)
    return lm.model.compute_logits(hidden[-1:])[0].float()


@torch.inference_mode()
def hf_last_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt], device=model.device)).logits[0, -1].float()


def _setup(name: str, device: torch.device) -> tuple[Any, list[Any], list[list[int]]]:
    hf = shapes.hf_model(name, device)
    vocab = hf.config.vocab_size
    return hf, shapes.hf_weights(hf), [shapes.prompts(1, n, vocab, seed=n)[0]
                                       for n in PROMPT_LENS]


def check_float32(name: str, device: torch.device, new_tokens: int = NEW_TOKENS
                  ) -> dict[str, Any]:
    """pdserve's greedy tokens in float32 must equal transformers'."""
    hf, weights, plist = _setup(name, device)
    ref = [hf_greedy(hf, p, new_tokens) for p in plist]
    got, used = pdserve_greedy(shapes.pdserve_model(name, weights, torch.float32, device),
                               device, plist, new_tokens)
    return {"model": name, "prompt_lens": list(PROMPT_LENS), "new_tokens": new_tokens,
            "engine": used, "identical": got == ref,
            "first_mismatch": _first_mismatch(got, ref), "ok": got == ref}


def check_bfloat16(name: str, device: torch.device, new_tokens: int = NEW_TOKENS
                   ) -> dict[str, Any]:
    """pdserve's bfloat16 logits within the stated tolerance (module docstring)."""
    hf, weights, plist = _setup(name, device)
    logits32 = [hf_last_logits(hf, p) for p in plist]
    lm16 = shapes.pdserve_model(name, weights, torch.bfloat16, device)
    got, used = pdserve_greedy(lm16, device, plist, new_tokens)
    pd_dev = max(float((pdserve_last_logits(lm16, device, p) - ref).abs().max())
                 for p, ref in zip(plist, logits32, strict=True))
    hf.to(torch.bfloat16)
    hf_dev = max(float((hf_last_logits(hf, p) - ref).abs().max())
                 for p, ref in zip(plist, logits32, strict=True))
    ref16 = [hf_greedy(hf, p, new_tokens) for p in plist]
    limit = BF16_TOLERANCE * hf_dev + 0.01
    return {"model": name, "prompt_lens": list(PROMPT_LENS), "new_tokens": new_tokens,
            "engine": used, "max_logit_dev_vs_hf_fp32": pd_dev,
            "hf_bf16_max_logit_dev_vs_hf_fp32": hf_dev,
            "tolerance": f"<= {BF16_TOLERANCE} x transformers' own bf16 deviation + 0.01",
            "limit": limit, "leading_tokens_equal_hf_bf16": [
                _lead(a, b) for a, b in zip(got, ref16, strict=True)],
            "ok": pd_dev <= limit}


def _lead(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _first_mismatch(got: list[list[int]], ref: list[list[int]]) -> list[int] | None:
    """Per prompt, the index of the first differing token (None when all equal)."""
    leads = [_lead(a, b) for a, b in zip(got, ref, strict=True)]
    return None if got == ref else leads
