"""The torch paged backend against dense causal SDPA on the same K/V."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.attention import get_backend
from pdserve.attention.base import AttentionMetadata

PAGE, KVH, HEADS, HD, PAGES = 4, 2, 4, 8, 40


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int) -> torch.Tensor:
    """Reference: q [n, H, D] attends to k, v [num_cached + n, KVH, D] causally, in float64."""
    rep = HEADS // KVH
    k = k.double().repeat_interleave(rep, 1)
    v = v.double().repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(HD)
    n, total = q.shape[0], k.shape[0]
    allowed = torch.arange(total)[None, :] <= (num_cached + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _run_step(cached: list[int], new: list[int], seed: int) -> float:
    """One backend step against dense attention; returns the largest deviation seen."""
    g = torch.Generator().manual_seed(seed)
    layers = [torch.zeros(PAGES, 2, PAGE, KVH, HD) for _ in range(2)]
    perm = torch.randperm(PAGES, generator=g).tolist()
    tables, slots, full_k, full_v, qs, ks, vs = [], [], [], [], [], [], []
    for c, n in zip(cached, new, strict=True):
        num_pages = -(-(c + n) // PAGE)
        pages, perm = perm[:num_pages], perm[num_pages:]
        tables.append(pages)
        k_all = torch.randn(c + n, KVH, HD, generator=g)
        v_all = torch.randn(c + n, KVH, HD, generator=g)
        for pos in range(c):  # the cached prefix is already in the pages
            for layer in layers:
                layer[pages[pos // PAGE], 0, pos % PAGE] = k_all[pos]
                layer[pages[pos // PAGE], 1, pos % PAGE] = v_all[pos]
        slots += [pages[p // PAGE] * PAGE + p % PAGE for p in range(c, c + n)]
        full_k.append(k_all)
        full_v.append(v_all)
        qs.append(torch.randn(n, HEADS, HD, generator=g))
        ks.append(k_all[c:])
        vs.append(v_all[c:])
    md = AttentionMetadata(
        qo_indptr=torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32),
        page_table=tables,
        kv_lens=torch.tensor([c + n for c, n in zip(cached, new, strict=True)], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        is_decode_only=all(n == 1 for n in new),
    )
    backend = get_backend("torch", kv_caches=layers)
    backend.prepare(md)
    worst = 0.0
    for layer_id in range(len(layers)):
        out = backend.forward(layer_id, torch.cat(qs), torch.cat(ks), torch.cat(vs))
        parts = zip(qs, full_k, full_v, cached, strict=True)
        ref = torch.cat([_dense(q, k, v, c) for q, k, v, c in parts])
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        worst = max(worst, (out.double() - ref).abs().max().item())
    # The new tokens' K/V were stored in their pages.
    for table, k_all, v_all, c, n in zip(tables, full_k, full_v, cached, new, strict=True):
        for pos in range(c, c + n):
            torch.testing.assert_close(layers[1][table[pos // PAGE], 0, pos % PAGE], k_all[pos])
            torch.testing.assert_close(layers[1][table[pos // PAGE], 1, pos % PAGE], v_all[pos])
    return worst


@pytest.mark.parametrize(
    ("cached", "new"),
    [
        ([0], [7]),                      # single fresh prefill (causal fast path)
        ([0, 0], [5, 5]),                # uniform fresh prefills
        ([0, 5, 9], [6, 3, 1]),          # mixed: fresh, chunk over a cached prefix, decode
        ([3, 8, 12, 1], [1, 1, 1, 1]),   # ragged decode
        ([6, 6], [1, 1]),                # uniform decode (no mask)
        ([4, 4], [3, 3]),                # uniform chunks over cached prefixes
    ],
)
def test_torch_backend_matches_dense(cached: list[int], new: list[int]) -> None:
    assert _run_step(cached, new, seed=sum(cached) * 31 + sum(new)) < 1e-5


def test_get_backend_rejects_unknown_name() -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        get_backend("nope", kv_caches=[torch.zeros(1, 2, 4, 1, 8)])


def test_auto_is_torch_on_cpu() -> None:
    backend = get_backend("auto", kv_caches=[torch.zeros(1, 2, 4, 1, 8)])
    assert type(backend).__name__ == "TorchBackend"


def test_cpu_engine_never_imports_flashinfer() -> None:
    import subprocess
    import sys
    from pathlib import Path

    libs = Path(__file__).resolve().parents[2] / "libs"
    code = (f"import sys; sys.path.insert(0, {str(libs)!r})\n"
            "from pdserve import LLM, SamplingParams\n"
            "llm = LLM('tiny', num_blocks=16)\n"
            "llm.generate('hi', SamplingParams(max_tokens=2))\n"
            "assert 'flashinfer' not in sys.modules, 'flashinfer imported'\n"
            "print(type(llm.engine.runner.backend).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "TorchBackend"


def test_flashinfer_needs_cuda() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_backend("flashinfer", kv_caches=[torch.zeros(1, 2, 4, 1, 8)], num_qo_heads=2)


def test_mixed_batch_splits_decode_from_prefill() -> None:
    """A long chunk next to decodes: two groups, and the decode group is not padded."""
    layers = [torch.zeros(PAGES, 2, PAGE, KVH, HD)]
    md = AttentionMetadata(
        qo_indptr=torch.tensor([0, 1, 41, 42], dtype=torch.int32),
        page_table=[[0, 1], [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [13]],
        kv_lens=torch.tensor([5, 41, 2], dtype=torch.int32),
        slot_mapping=torch.tensor([4, *range(8, 48), 53]), is_decode_only=False)
    backend = get_backend("torch", kv_caches=layers)
    backend.prepare(md)
    shapes = sorted(plan.shape for plan in backend.groups)  # type: ignore[attr-defined]
    assert shapes == [(1, 40, 41), (2, 1, 5)]
