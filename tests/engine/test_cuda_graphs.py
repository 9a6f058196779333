"""The CUDA graph ladder on CPU: bucket choice, padding, and that a padded batch planned into
a graph bucket attends exactly like the unpadded one (FlashInfer stand-in)."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention.base import AttentionMetadata
from pdserve.attention.flashinfer_backend import FlashInferBackend
from pdserve.engine.cuda_graphs import DecodeGraphs, bucket_for, graph_ladder, pad_decode
from tests.engine import flashinfer_standin as standin

PAGE, PAGES, KVH, HEADS, HD = 4, 24, 2, 8, 64


def test_ladder() -> None:
    assert graph_ladder(1) == [1]
    assert graph_ladder(6) == [1, 2, 4, 6]
    assert graph_ladder(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graph_ladder(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    with pytest.raises(ValueError, match="max_batch"):
        graph_ladder(0)


@pytest.mark.parametrize(("num_seqs", "bucket"), [(1, 1), (3, 4), (4, 4), (5, 8), (11, 16),
                                                  (33, 40), (40, 40), (41, None)])
def test_bucket_is_the_smallest_that_holds_the_batch(num_seqs: int, bucket: int | None) -> None:
    assert bucket_for(graph_ladder(40), num_seqs) == bucket


def _decode_md(kv_lens: list[int]) -> AttentionMetadata:
    tables = [[2 * i, 2 * i + 1] for i in range(len(kv_lens))]
    slots = [t[(n - 1) // PAGE] * PAGE + (n - 1) % PAGE for t, n in zip(tables, kv_lens,
                                                                        strict=True)]
    return AttentionMetadata(torch.arange(len(kv_lens) + 1, dtype=torch.int32), tables,
                             torch.tensor(kv_lens, dtype=torch.int32), torch.tensor(slots), True)


def test_padding_rows_are_one_token_on_the_scratch_page() -> None:
    padded = pad_decode(_decode_md([5, 8, 2]), 8, scratch_page=23, page_size=PAGE)
    assert padded.num_seqs == 8 and padded.is_decode_only
    assert padded.qo_indptr.tolist() == list(range(9))
    assert padded.page_table[3:] == [[23]] * 5
    assert padded.kv_lens.tolist() == [5, 8, 2, 1, 1, 1, 1, 1]
    assert padded.slot_mapping.tolist()[3:] == [23 * PAGE] * 5
    with pytest.raises(ValueError, match="cannot pad a batch of 3"):
        pad_decode(_decode_md([5, 8, 2]), 2, scratch_page=23, page_size=PAGE)


def test_a_padded_bucket_attends_like_the_eager_batch() -> None:
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(PAGES, 2, PAGE, KVH, HD, generator=g).to(torch.bfloat16)]
    eager_layers = [layers[0].clone()]
    md = _decode_md([5, 8, 2])
    q, k, v = (torch.randn(3, h, HD, generator=g).to(torch.bfloat16) for h in (HEADS, KVH, KVH))
    eager = FlashInferBackend(eager_layers, HEADS, fi=standin)  # type: ignore[arg-type]
    eager.prepare(md)
    expect = eager.forward(0, q, k, v)
    graphed = FlashInferBackend(layers, HEADS, fi=standin)  # type: ignore[arg-type]
    bucket = graphed.graph_bucket(4, max_pages=PAGES)
    graphed.prepare(pad_decode(md, 4, scratch_page=PAGES - 1, page_size=PAGE), bucket)
    pad = torch.zeros(1, HEADS, HD, dtype=torch.bfloat16)
    pad_kv = torch.zeros(1, KVH, HD, dtype=torch.bfloat16)
    got = graphed.forward(0, torch.cat([q, pad]), torch.cat([k, pad_kv]), torch.cat([v, pad_kv]))
    torch.testing.assert_close(got[:3], expect)
    # The real rows' K/V landed where eager put them; the padding touched only the scratch page.
    assert torch.equal(layers[0][: PAGES - 1], eager_layers[0][: PAGES - 1])


def test_graphs_leave_mixed_and_oversized_batches_to_eager() -> None:
    graphs = DecodeGraphs(model=None, backend=type("B", (), {"page_size": PAGE})(),
                          max_batch=4, scratch_page=PAGES - 1, num_pages=PAGES,
                          device=torch.device("cpu"))
    graphs.graphs = {size: None for size in graphs.ladder}  # type: ignore[misc]
    ids = torch.zeros(5, dtype=torch.long)
    assert graphs.run(ids, ids, _decode_md([3] * 5)) is None  # 5 > the largest bucket
    mixed = _decode_md([3, 3])
    mixed.is_decode_only = False
    assert graphs.run(ids[:2], ids[:2], mixed) is None
