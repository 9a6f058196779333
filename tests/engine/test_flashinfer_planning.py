"""FlashInferBackend's planning and index building, on CPU, over the stand-in FlashInfer module
(tests/engine/flashinfer_standin.py), against the torch backend on the same steps."""

from __future__ import annotations

import logging

import pytest
import torch

import pdserve.attention as attention
from pdserve.attention import get_backend
from pdserve.attention.base import AttentionMetadata
from pdserve.attention.flashinfer_backend import FlashInferBackend, unsupported_reason
from pdserve.attention.torch_backend import TorchBackend
from tests.engine import flashinfer_standin as standin

PAGE, HD, PAGES, KVH = 4, 64, 48, 2
DT = torch.bfloat16


def _step(cached: list[int], new: list[int], seed: int, heads: int, kvh: int = KVH,
          ) -> tuple[AttentionMetadata, list[torch.Tensor], tuple[torch.Tensor, ...]]:
    """Caches holding each sequence's cached prefix, the step's metadata, and q, k, v."""
    g = torch.Generator().manual_seed(seed)
    layers = [torch.zeros(PAGES, 2, PAGE, kvh, HD, dtype=DT) for _ in range(2)]
    perm = torch.randperm(PAGES, generator=g).tolist()
    tables, slots = [], []
    for c, n in zip(cached, new, strict=True):
        pages, perm = perm[:-(-(c + n) // PAGE)], perm[-(-(c + n) // PAGE):]
        tables.append(pages)
        for layer in layers:
            for pos in range(c):
                layer[pages[pos // PAGE], :, pos % PAGE] = torch.randn(2, kvh, HD, generator=g)
        slots += [pages[p // PAGE] * PAGE + p % PAGE for p in range(c, c + n)]
    num_tokens = sum(new)
    md = AttentionMetadata(
        qo_indptr=torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32),
        page_table=tables,
        kv_lens=torch.tensor([c + n for c, n in zip(cached, new, strict=True)],
                             dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        is_decode_only=all(n == 1 for n in new))
    qkv = tuple(torch.randn(num_tokens, h, HD, generator=g).to(DT) for h in (heads, kvh, kvh))
    return md, layers, qkv


def _compare(cached: list[int], new: list[int], heads: int, seed: int = 0) -> None:
    md, layers, (q, k, v) = _step(cached, new, seed, heads)
    fi_layers = [t.clone() for t in layers]
    ref = get_backend("torch", kv_caches=layers)
    fib = FlashInferBackend(fi_layers, num_qo_heads=heads, fi=standin)  # type: ignore[arg-type]
    ref.prepare(md)
    fib.prepare(md)
    for layer_id in range(len(layers)):
        expect = ref.forward(layer_id, q, k, v)
        got = fib.forward(layer_id, q, k, v)
        torch.testing.assert_close(got.float(), expect.float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(fi_layers[layer_id], layers[layer_id])  # same K/V in the same slots


@pytest.mark.parametrize(("cached", "new"), [
    ([0], [9]),                       # one fresh prefill
    ([0, 5, 9], [6, 3, 1]),           # mixed: fresh, a chunk over a cached prefix, a decode
    ([3, 8, 12, 1], [1, 1, 1, 1]),    # ragged decode (page boundaries: 8 -> 9 opens a page)
    ([16, 7], [5, 9]),                # chunked prefill over cached prefixes
])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8])
def test_flashinfer_planning_matches_torch(cached: list[int], new: list[int],
                                           group: int) -> None:
    _compare(cached, new, heads=KVH * group, seed=group + sum(cached))


@pytest.mark.parametrize(("group", "tensor_cores"), [(1, False), (4, False), (5, True),
                                                     (7, True), (8, True)])
def test_decode_uses_tensor_cores_above_group_4(group: int, tensor_cores: bool) -> None:
    standin.PLANS.clear()
    md, layers, _ = _step([5, 2], [1, 1], 0, heads=KVH * group)
    fib = FlashInferBackend(layers, num_qo_heads=KVH * group, fi=standin)  # type: ignore[arg-type]
    fib.prepare(md)
    assert fib.use_tensor_cores is tensor_cores
    assert standin.PLANS[-1]["tensor_cores"] is tensor_cores


def test_plan_gets_host_int32_and_the_workspace_is_zeroed() -> None:
    standin.PLANS.clear()
    md, layers, _ = _step([0, 5], [6, 3], 1, heads=4)
    fib = FlashInferBackend(layers, num_qo_heads=4, fi=standin)  # type: ignore[arg-type]
    assert fib.workspace.count_nonzero().item() == 0
    fib.prepare(md)
    plan = standin.PLANS[-1]
    assert plan["kind"] == "prefill"
    for name in ("qo_indptr", "indptr", "indices", "last_page_len"):
        assert plan[name].device.type == "cpu" and plan[name].dtype == torch.int32, name
    assert plan["indptr"].tolist() == [0, 2, 2 + 2]
    assert plan["last_page_len"].tolist() == [2, 4]  # 6 tokens -> 4 + 2; 8 -> 4 + 4


def test_graph_bucket_pads_and_matches_eager() -> None:
    """A decode batch of 3 planned into a bucket of 4 (the 4th row a 1-token dummy)."""
    md, layers, (q, k, v) = _step([3, 8, 12, 0], [1, 1, 1, 1], 2, heads=8)
    eager_layers = [t.clone() for t in layers]
    eager = FlashInferBackend(eager_layers, num_qo_heads=8, fi=standin)  # type: ignore[arg-type]
    graph = FlashInferBackend(layers, num_qo_heads=8, fi=standin)  # type: ignore[arg-type]
    bucket = graph.graph_bucket(4, max_pages=PAGES)
    eager.prepare(md)
    graph.prepare(md, bucket)
    assert bucket.store[3].tolist() == [0, 1, 2, 3]  # batch_indices stay fixed
    assert bucket.store[4].tolist() == [3, 8, 12, 0]  # positions of the new tokens
    torch.testing.assert_close(graph.forward(0, q, k, v), eager.forward(0, q, k, v))


def test_unsupported_shapes_are_named() -> None:
    assert unsupported_reason(128, 14, 2, DT) is None  # Qwen2.5-0.5B: group 7
    assert "head_dim 32" in (unsupported_reason(32, 8, 2, DT) or "")
    assert "whole multiple" in (unsupported_reason(64, 6, 4, DT) or "")
    assert "float32" in (unsupported_reason(64, 8, 2, torch.float32) or "")


@pytest.mark.parametrize(("shape", "heads", "reason"), [
    ((4, 2, 16, 2, 32), 8, "head_dim 32 is not one FlashInfer dispatches"),
    ((4, 2, 16, 4, 64), 6, "6 query heads are not a whole multiple of 4 KV heads"),
])
def test_auto_falls_back_to_torch_saying_why(monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture,
                                             shape: tuple[int, ...], heads: int,
                                             reason: str) -> None:
    monkeypatch.setattr(attention, "resolve_backend", lambda name, device: "flashinfer")
    cache = torch.zeros(*shape, dtype=DT)
    with caplog.at_level(logging.INFO, logger="pdserve.attention"):
        backend = get_backend("auto", kv_caches=[cache], num_qo_heads=heads)
    assert type(backend).__name__ == "TorchBackend"
    (record,) = [r for r in caplog.records if r.name == "pdserve.attention"]
    assert record.getMessage() == "attention backend: torch, not flashinfer"
    assert reason in record.fields["reason"]  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=f"cannot serve this model: {reason}"):
        get_backend("flashinfer", kv_caches=[cache], num_qo_heads=heads)


@pytest.mark.parametrize(("cached", "new"), [([0, 5, 9], [6, 3, 1]), ([3, 8], [1, 1])])
def test_fp8_cache_is_planned_natively_and_matches_torch(cached: list[int],
                                                        new: list[int]) -> None:
    """An fp8 cache: planned with kv_data_type float8_e4m3fn and q in bf16, K/V cast to e4m3
    on append, run with unit k_scale/v_scale; the torch backend reading the same bytes with
    unit scales (the layout FlashInfer keeps) gives the same output."""
    standin.PLANS.clear()
    md, layers, (q, k, v) = _step(cached, new, 3, heads=8)
    fp8 = [t.to(torch.float8_e4m3fn) for t in layers]
    ref_layers = [t.clone() for t in fp8]
    scales = [torch.ones(t.shape[:-1]) for t in fp8]
    ref = TorchBackend(ref_layers, kv_scales=scales, unit_scales=True)
    fib = FlashInferBackend(fp8, num_qo_heads=8, fi=standin,  # type: ignore[arg-type]
                            q_dtype=DT)
    ref.prepare(md)
    fib.prepare(md)
    assert standin.PLANS[-1]["kv_data_type"] == torch.float8_e4m3fn
    assert standin.PLANS[-1]["q_data_type"] == DT
    for layer_id in range(len(fp8)):
        torch.testing.assert_close(fib.forward(layer_id, q, k, v).float(),
                                   ref.forward(layer_id, q, k, v).float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(fp8[layer_id].view(torch.uint8),
                           ref_layers[layer_id].view(torch.uint8))  # the same e4m3 bytes


def test_kv_dtypes_flashinfer_cannot_serve_are_named() -> None:
    assert unsupported_reason(64, 8, 2, DT, torch.float8_e4m3fn) is None
    assert "KV cache dtype torch.int8 has no FlashInfer kernel" in (
        unsupported_reason(64, 8, 2, DT, torch.int8) or "")
    cache = torch.zeros(4, 2, 16, 2, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="torch.int8 has no FlashInfer kernel"):
        FlashInferBackend([cache], num_qo_heads=8, fi=standin,  # type: ignore[arg-type]
                          q_dtype=DT)
