"""The torch backend's decode mirror (attention/decode_mirror.py): the same outputs, bit for
bit, as the paged gather, over batches that continue, change, mix in a prefill, or reuse a
finished request's pages."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention.base import AttentionMetadata
from pdserve.attention.torch_backend import TorchBackend
from pdserve.engine import setup
from pdserve.engine.config import EngineArgs
from tests.engine.helpers import make_engine

PAGE, KVH, HEADS, HD, PAGES, LAYERS = 4, 2, 4, 8, 64, 2


class TwoBackends:
    """One backend given request ids (mirror on) and one not (gather), on equal caches."""

    def __init__(self, dtype: torch.dtype = torch.float32, max_bytes: int | None = None) -> None:
        self.g = torch.Generator().manual_seed(0)
        self.dtype = dtype
        caches = [torch.zeros(PAGES, 2, PAGE, KVH, HD, dtype=dtype) for _ in range(LAYERS)]
        self.mirrored = TorchBackend(caches)
        self.plain = TorchBackend([c.clone() for c in caches])
        if max_bytes is not None:
            self.mirrored.mirror.max_bytes = max_bytes
        self.free = list(range(PAGES))
        self.seqs: dict[str, tuple[list[int], int]] = {}  # id -> (pages, tokens stored)

    def step(self, work: list[tuple[str, int]]) -> str | None:
        """Run ``(request id, new tokens)`` through both backends; returns the mirror's mode."""
        tables, slots, kv_lens = [], [], []
        for rid, n in work:
            pages, done = self.seqs.get(rid, ([], 0))
            while len(pages) * PAGE < done + n:
                pages.append(self.free.pop(0))
            slots += [pages[p // PAGE] * PAGE + p % PAGE for p in range(done, done + n)]
            self.seqs[rid] = (pages, done + n)
            tables.append(list(pages))
            kv_lens.append(done + n)
        new = [n for _, n in work]
        total = sum(new)
        q, k, v = (torch.randn(total, h, HD, generator=self.g).to(self.dtype)
                   for h in (HEADS, KVH, KVH))
        outs = []
        for backend, ids in ((self.mirrored, [rid for rid, _ in work]), (self.plain, None)):
            backend.prepare(AttentionMetadata(
                qo_indptr=torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()],
                                       dtype=torch.int32),
                page_table=tables, kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
                slot_mapping=torch.tensor(slots, dtype=torch.int64),
                is_decode_only=all(n == 1 for n in new), seq_ids=ids))
            outs.append([backend.forward(i, q, k, v) for i in range(LAYERS)])
        for got, expect in zip(*outs, strict=True):
            assert torch.equal(got, expect)
        return self.mirrored.mirror.mode

    def finish(self, rid: str) -> None:
        self.free[:0] = self.seqs.pop(rid)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mirror_equals_gather_across_batch_changes(dtype: torch.dtype) -> None:
    sim = TwoBackends(dtype)
    assert sim.step([("a", 5), ("b", 3)]) is None  # prefill: no mirror
    modes = [sim.step([("a", 1), ("b", 1)]) for _ in range(6)]  # crosses page boundaries
    assert modes == ["refill"] + ["append"] * 5
    assert sim.step([("a", 1), ("b", 1), ("c", 4)]) is None  # mixed step clears it
    assert sim.step([("a", 1), ("b", 1), ("c", 1)]) == "refill"
    assert sim.step([("a", 1), ("b", 1), ("c", 1)]) == "append"
    assert sim.step([("b", 1), ("a", 1), ("c", 1)]) == "refill"  # reordered
    sim.finish("c")
    assert sim.step([("b", 1), ("a", 1)]) == "refill"  # one left the batch
    assert sim.step([("b", 1), ("a", 1)]) == "append"


def test_mirror_grows_past_its_capacity() -> None:
    sim = TwoBackends()
    sim.step([("a", 2)])
    modes = [sim.step([("a", 1)]) for _ in range(130)]  # 3 .. 132 tokens
    assert modes[0] == "refill" and sim.mirrored.mirror.cap == 160  # 3 + 64 -> 80, 81 + 64
    assert [i for i, mode in enumerate(modes) if mode == "refill"] == [0, 78]


def test_a_tight_budget_shrinks_the_headroom_but_keeps_the_mirror() -> None:
    """A cache sized to its batch (as a bench sizes it) still gets a mirror: the headroom
    shrinks to what ``max_bytes`` holds, down to MIN_HEADROOM; below that, none."""
    per_token = 2 * 2 * KVH * HD * 4 * LAYERS  # two sequences, K and V, float32
    sim = TwoBackends(max_bytes=per_token * 30)
    sim.step([("a", 5), ("b", 3)])
    modes = [sim.step([("a", 1), ("b", 1)]) for _ in range(25)]  # a: 6 .. 30 tokens
    assert modes[0] == "refill" and sim.mirrored.mirror.cap == 30  # not 6 + 64 -> 80
    assert modes[1:] == ["append"] * 24
    assert sim.step([("a", 1), ("b", 1)]) is None  # a: 31 tokens + 16 of headroom > 30
    assert sim.mirrored.mirror.buffers == [None] * LAYERS


def test_request_reusing_finished_pages_is_refilled() -> None:
    """Same pages, one token longer, same batch position, other K/V in the pages (as a KV
    transfer leaves them): only the request id differs, and the mirror must not append."""
    sim = TwoBackends()
    sim.step([("a", 6)])
    assert sim.step([("a", 1)]) == "refill"
    pages, done = sim.seqs.pop("a")
    for backend in (sim.mirrored, sim.plain):  # d's KV arrives in a's pages
        for cache in backend.kv_caches:
            cache[pages] = torch.randn(cache[pages].shape, generator=torch.Generator())
    sim.seqs["d"] = (pages, done)
    assert sim.step([("d", 1)]) == "refill"


def test_over_budget_batch_gathers() -> None:
    sim = TwoBackends(max_bytes=1024)
    sim.step([("a", 5), ("b", 3)])
    assert [sim.step([("a", 1), ("b", 1)]) for _ in range(3)] == [None] * 3
    assert sim.mirrored.mirror.buffers == [None] * LAYERS


def test_no_mirror_without_request_ids_or_for_a_quantized_cache() -> None:
    sim = TwoBackends()
    sim.step([("a", 5)])
    assert sim.step([("a", 1)]) == "refill"
    assert sim.plain.mirror.mode is None  # its metadata carried no ids
    caches = [torch.zeros(PAGES, 2, PAGE, KVH, HD, dtype=torch.int8)]
    scales = [torch.ones(PAGES, 2, PAGE, KVH)]
    assert TorchBackend(caches, kv_scales=scales).mirror.max_bytes == 0


def test_a_batch_of_new_shape_drops_the_old_copy_before_the_new_one_is_made() -> None:
    """Old and new buffers are never held together: at most ``max_bytes`` at any moment."""
    sim = TwoBackends()
    sim.step([("a", 5), ("b", 3)])
    assert sim.step([("a", 1), ("b", 1)]) == "refill"
    mirror = sim.mirrored.mirror
    assert all(buf is not None for buf in mirror.buffers)
    sim.step([("c", 2)])  # a third request joins with its prefill
    mirror.plan(["a", "b", "c"], [sim.seqs[r][0] for r in "abc"],
                [sim.seqs[r][1] + 1 for r in "abc"], torch.device("cpu"))
    assert mirror.mode == "refill" and mirror.buffers == [None] * LAYERS


def test_the_engine_bounds_its_mirror_by_its_kv_cache_by_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(num_blocks=40)
    cache_bytes = sum(layer.numel() * layer.element_size() for layer in engine.cache.layers)
    assert engine.runner.backend.mirror.max_bytes == cache_bytes
    monkeypatch.setattr(setup, "MIRROR_MAX_BYTES", cache_bytes // 2)  # a cache over the cap
    assert make_engine(num_blocks=40).runner.backend.mirror.max_bytes == cache_bytes // 2
    assert make_engine(num_blocks=40, decode_mirror_memory_bytes=0
                       ).runner.backend.mirror.max_bytes == 0
    assert make_engine(num_blocks=40, decode_mirror_memory_bytes=1 << 20
                       ).runner.backend.mirror.max_bytes == 1 << 20


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_bad_mirror_bound_is_named(value: object) -> None:
    with pytest.raises(ValueError) as err:
        EngineArgs(decode_mirror_memory_bytes=value)  # type: ignore[arg-type]
    assert str(err.value) == ("decode_mirror_memory_bytes must be None or an int >= 0, "
                              f"got {value!r}")
