"""Turns a scheduled batch into model inputs, runs the model, and samples.

Flat batch of T tokens, sequences back to back (qo_indptr); each token's KV slot is
``page * page_size + position % page_size`` with page = the request's block for that position.
Only sequences whose last scheduled token is their last known token get logits and a sample;
a non-final prefill chunk just fills the cache.
"""

from __future__ import annotations

import torch

from pdserve.attention.base import AttentionBackend, AttentionMetadata
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.prompt_logprobs import record_prompt_logprobs
from pdserve.engine.sampler import Sampler, SamplerOutput
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.models.base import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCacheManager, backend: AttentionBackend,
                 sampler: Sampler, device: torch.device,
                 graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.kv = kv
        self.backend = backend
        self.sampler = sampler
        self.device = device
        self.graphs = graphs

    def prepare(self, batch: ScheduledBatch
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Build input ids, positions (on the device) and the attention metadata."""
        bs = self.kv.block_size
        input_ids: list[int] = []
        starts, lens, tables = [], [], []
        for req, n in zip(batch.reqs, batch.num_new_tokens, strict=True):
            start = req.num_computed_tokens
            input_ids.extend(req.token_ids[start:start + n])
            starts.append(start)
            lens.append(n)
            tables.append(self.kv.blocks_of(req.request_id))
        q_lens = torch.tensor(lens, dtype=torch.long)
        seq_of_token = torch.repeat_interleave(torch.arange(len(lens)), q_lens)
        qo_indptr = torch.zeros(len(lens) + 1, dtype=torch.long)
        qo_indptr[1:] = q_lens.cumsum(0)
        positions = torch.tensor(starts, dtype=torch.long)[seq_of_token] + (
            torch.arange(len(input_ids)) - qo_indptr[:-1][seq_of_token])
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        slots = table[seq_of_token, positions // bs] * bs + positions % bs
        metadata = AttentionMetadata(
            qo_indptr=qo_indptr.to(torch.int32),
            page_table=tables,
            kv_lens=(torch.tensor(starts) + q_lens).to(torch.int32),
            slot_mapping=slots,
            is_decode_only=batch.is_decode_only,
            seq_ids=[req.request_id for req in batch.reqs],
        )
        return (torch.tensor(input_ids, dtype=torch.long).to(self.device, non_blocking=True),
                positions.to(self.device, non_blocking=True), metadata)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states of the step: a CUDA graph replay when one fits, else eager."""
        if self.graphs is not None:
            hidden = self.graphs.run(input_ids, positions, metadata)
            if hidden is not None:
                return hidden
        self.backend.prepare(metadata)
        return self.model(input_ids, positions, self.backend)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> SamplerOutput | None:
        """Forward the batch; sample for the sequences that reach their last known token."""
        if batch.is_empty:
            return None
        hidden = self.forward(*self.prepare(batch))
        if any(r.params.prompt_logprobs is not None for r in batch.reqs):
            record_prompt_logprobs(self.model, hidden, batch)
        rows, reqs = [], []
        end = 0
        for req, n in zip(batch.reqs, batch.num_new_tokens, strict=True):
            end += n
            if req.num_computed_tokens + n == req.num_tokens:
                rows.append(end - 1)
                reqs.append(req)
        if not reqs:
            return None
        if len(rows) != hidden.shape[0]:
            hidden = hidden[torch.tensor(rows, device=hidden.device)]
        logits = self.model.compute_logits(hidden)
        return self.sampler(logits, reqs)
