"""Decode steps replayed from CUDA graphs, one graph per batch size of a ladder.

A decode step launches a few kernels per layer, each too short to hide Python's launch time;
a graph replays them all in one launch. Graphs have fixed shapes, so the step is captured for a
ladder of batch sizes (as vLLM and SGLang do) and a batch runs in the smallest bucket that
holds it, padded with dummy sequences; a larger batch, or one with a prefill chunk, runs
eagerly.

    ladder (max 40)   1  2  4  8  16  24  32  40
    batch of 11       ------------^ bucket 16: rows 11..15 are padding

A padding row is a one-token sequence on the scratch page (a page outside the block pool):
token 0 at position 0, so it writes and reads only that page, and its output is dropped.
What changes between replays lives in fixed device buffers: the input ids and positions
here, the page table in the FlashInfer bucket's (``FlashInferBackend.graph_bucket``).
"""

from __future__ import annotations

import bisect
import logging
from typing import Any

import torch

from pdserve.attention.base import AttentionMetadata

log = logging.getLogger(__name__)


def graph_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to ``max_batch`` (always included)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = {b for b in (1, 2, 4) if b < max_batch} | set(range(8, max_batch, 8))
    return sorted(sizes | {max_batch})


def bucket_for(ladder: list[int], num_seqs: int) -> int | None:
    """The smallest bucket holding ``num_seqs`` sequences; None when none does."""
    i = bisect.bisect_left(ladder, num_seqs)
    return ladder[i] if i < len(ladder) else None


def pad_decode(metadata: AttentionMetadata, size: int, scratch_page: int,
               page_size: int) -> AttentionMetadata:
    """A decode-only batch padded to ``size`` sequences with one-token dummies on the scratch
    page (see the module docstring)."""
    extra = size - metadata.num_seqs
    if extra < 0 or not metadata.is_decode_only:
        raise ValueError(f"cannot pad a batch of {metadata.num_seqs} "
                         f"({'decode' if metadata.is_decode_only else 'mixed'}) to {size}")
    i32 = torch.int32
    return AttentionMetadata(
        qo_indptr=torch.arange(size + 1, dtype=i32),
        page_table=[*metadata.page_table, *([[scratch_page]] * extra)],
        kv_lens=torch.cat([metadata.kv_lens.to("cpu", i32), torch.ones(extra, dtype=i32)]),
        slot_mapping=torch.cat([metadata.slot_mapping.cpu(),
                                torch.full((extra,), scratch_page * page_size)]),
        is_decode_only=True)


class DecodeGraphs:
    """Captured decode steps of ``model`` over a FlashInfer backend (CUDA only)."""

    def __init__(self, model: Any, backend: Any, max_batch: int, scratch_page: int,
                 num_pages: int, device: torch.device) -> None:
        self.model, self.backend = model, backend
        self.ladder = graph_ladder(max_batch)
        self.scratch_page, self.num_pages = scratch_page, num_pages
        self.page_size = backend.page_size
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _dummy(self, size: int) -> AttentionMetadata:
        empty = AttentionMetadata(torch.zeros(1, dtype=torch.int32), [],
                                  torch.zeros(0, dtype=torch.int32),
                                  torch.zeros(0, dtype=torch.long), True)
        return pad_decode(empty, size, self.scratch_page, self.page_size)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, all in one memory pool."""
        pool = None
        for size in reversed(self.ladder):
            bucket = self.backend.graph_bucket(size, self.num_pages)
            self.backend.prepare(self._dummy(size), bucket)
            ids, pos = self.input_ids[:size], self.positions[:size]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: lazy init and allocations, not captured
                self.model(ids, pos, self.backend)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(ids, pos, self.backend)
            pool = graph.pool()
            self.graphs[size] = (graph, out)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata) -> torch.Tensor | None:
        """The step's hidden states from a graph replay; None when no bucket fits (run it
        eagerly)."""
        size = bucket_for(self.ladder, metadata.num_seqs) if metadata.is_decode_only else None
        if size is None or size not in self.graphs:
            return None
        n = metadata.num_seqs
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:size].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:size].zero_()
        padded = pad_decode(metadata, size, self.scratch_page, self.page_size)
        self.backend.prepare(padded, self.backend.graph_bucket(size, self.num_pages))
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]


def try_capture(graphs: DecodeGraphs) -> DecodeGraphs | None:
    """Capture, or log why not and leave the engine eager (None)."""
    try:
        graphs.capture()
    except Exception as exc:  # noqa: BLE001 - graphs are an optimisation; eager still serves
        log.warning("CUDA graphs disabled: capture failed",
                    extra={"fields": {"error": f"{type(exc).__name__}: {exc}"}})
        return None
    log.info("CUDA graphs captured", extra={"fields": {"batch_sizes": graphs.ladder}})
    return graphs
