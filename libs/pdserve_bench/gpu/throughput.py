"""Part b: engine decode tokens/s at 1, 32 and 128 sequences vs transformers ``generate``.

Same random weights (the Qwen2.5-0.5B-shaped checkpoint) in bfloat16 on the same GPU, same
prompts (128 tokens, 128 new tokens, greedy, EOS ignored), one run each after a warm-up:
decode tokens/s = tokens after the first / time after every sequence's first token. pdserve
runs as it serves (FlashInfer, fused kernels, CUDA graphs when they were captured).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pdserve_bench.engine import run_pdserve
from pdserve_bench.gpu import shapes

TARGET_AT_32 = 3.0


class _FirstTokenClock:
    """A generate() streamer noting when the first new tokens exist on the device."""

    def __init__(self) -> None:
        self.num_puts = 0
        self.t_first = 0.0

    def put(self, value: torch.Tensor) -> None:
        self.num_puts += 1
        if self.num_puts == 2:
            value.cpu()  # waits for the device: the tokens are really there
            self.t_first = time.perf_counter()

    def end(self) -> None:
        pass


@torch.inference_mode()
def run_hf(model: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    ids = torch.tensor(prompts, device=model.device)
    clock = _FirstTokenClock()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         pad_token_id=0, eos_token_id=None, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, streamer=clock)
    out.cpu()
    return clock.t_first - t0, time.perf_counter() - clock.t_first


def check(name: str, device: torch.device, concurrencies: tuple[int, ...] = (1, 32, 128),
          prompt_len: int = 128, new_tokens: int = 128) -> dict[str, Any]:
    hf = shapes.hf_model(name, device)
    lm = shapes.pdserve_model(name, shapes.hf_weights(hf), torch.bfloat16, device)
    hf.to(torch.bfloat16)
    max_seqs = max(concurrencies)
    blocks = max_seqs * (-(-(prompt_len + new_tokens) // 16) + 1)
    eng = shapes.engine(lm, device, num_blocks=blocks, max_num_seqs=max_seqs,
                        max_num_batched_tokens=max(2048, prompt_len * 8))
    vocab = lm.config.vocab_size
    warm = shapes.prompts(2, 16, vocab, seed=1)
    run_pdserve(eng, warm, 4)
    run_hf(hf, warm, 4)
    rows = []
    for n in concurrencies:
        plist = shapes.prompts(n, prompt_len, vocab, seed=n)
        decoded = n * (new_tokens - 1)
        hf_pre, hf_dec = run_hf(hf, plist, new_tokens)
        pd_pre, pd_dec, _ = run_pdserve(eng, plist, new_tokens)
        rows.append({"num_seqs": n, "pdserve_decode_tps": decoded / pd_dec,
                     "hf_decode_tps": decoded / hf_dec, "ratio": hf_dec / pd_dec,
                     "pdserve_prefill_s": pd_pre, "hf_prefill_s": hf_pre})
    at_32 = next((r["ratio"] for r in rows if r["num_seqs"] == 32), None)
    return {"model": name, "dtype": "bfloat16", "prompt_len": prompt_len,
            "new_tokens": new_tokens, "cuda_graphs": eng.runner.graphs is not None,
            "attention": type(eng.runner.backend).__name__, "kernels": eng.kernels,
            "rows": rows, "target": f"decode at 32 sequences >= {TARGET_AT_32}x transformers",
            "ok": at_32 is not None and at_32 >= TARGET_AT_32}
