"""Continuous batching from two small managers under one per-step token budget.

    schedule():  budget = max_num_batched_tokens; prompt tokens also <= max_prefill_tokens
      1. DecodeManager  - every running request (most urgent first) gets its next tokens: one
                          for decode, the next chunk for an unfinished prefill. Out of pages ->
                          preempt the least urgent running request (recompute later).
      2. PrefillAdder   - waiting requests (priority, then FIFO) join while budget, seats
                          (max_num_seqs) and pages last; a prefix hit skips cached blocks.

``max_prefill_tokens`` (None: the budget alone) caps the prompt tokens of a step that also
decodes, not its decode tokens: a colocated engine whose steps must stay within an
inter-token latency takes its prompts in smaller chunks while answers stream, and every
running answer still gets its token each step; a step with no answer to stall takes the
whole budget (the controller sets the cap, ``SetRoleRequest.max_prefill_tokens``).

A request's life: WAITING -> RUNNING -> FINISHED, or RUNNING -> WAITING on preemption, or
RUNNING -> HELD for held requests (prefill_only, or ``hold``: pages kept for export until
release).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """The step's sequences in batch order and how many new tokens each computes."""

    reqs: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def add(self, req: Request, num_new: int) -> None:
        self.reqs.append(req)
        self.num_new_tokens.append(num_new)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.reqs

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.num_new_tokens)


class WaitingQueue:
    """Requests ordered by (priority, arrival): lower number first, FIFO within a class.
    Preempted requests keep their arrival, so they go back ahead of later ones."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, int]] = []
        self._reqs: list[Request] = []

    def __len__(self) -> int:
        return len(self._reqs)

    def push(self, req: Request) -> None:
        i = bisect.bisect_right(self._keys, req.sort_key())
        self._keys.insert(i, req.sort_key())
        self._reqs.insert(i, req)

    def peek(self) -> Request:
        return self._reqs[0]

    def pop(self) -> Request:
        self._keys.pop(0)
        return self._reqs.pop(0)

    def remove(self, req: Request) -> bool:
        for i, r in enumerate(self._reqs):
            if r is req:
                del self._keys[i], self._reqs[i]
                return True
        return False


class DecodeManager:
    """Running requests; schedules their next tokens and preempts when pages run out."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.running: list[Request] = []
        self.num_preemptions = 0

    def schedule(self, batch: ScheduledBatch, budget: int, prefill: int) -> tuple[int, int]:
        """``prefill``: the prompt tokens the step may take. Returns both budgets left."""
        self.running.sort(key=Request.sort_key)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens_to_compute, budget)
            if req.is_prefilling:  # the prompt's next chunk
                num_new = min(num_new, prefill)
                if num_new == 0:
                    i += 1
                    continue
                prefill -= num_new
            while self.kv.allocate_slots(req, num_new) is None:
                victim = self.running.pop()  # least urgent; never one already scheduled
                self.preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    return budget, prefill
            batch.add(req, num_new)
            budget -= num_new
            i += 1
        return budget, prefill

    def preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1

    def remove(self, req: Request) -> None:
        self.running.remove(req)


class PrefillAdder:
    """Moves waiting requests to running under the remaining budget (chunked prefill)."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.num_hit_tokens = 0

    def schedule(self, batch: ScheduledBatch, budget: int, waiting: WaitingQueue,
                 decode: DecodeManager) -> int:
        """``budget``: the step's prompt tokens left (already under any prefill cap)."""
        while waiting and budget > 0 and len(decode.running) < self.max_num_seqs:
            req = waiting.peek()
            # Scoring the prompt (prompt_logprobs) needs every position's hidden state.
            may_hit = req.num_computed_tokens == 0 and req.params.prompt_logprobs is None
            hits = self.kv.get_computed_blocks(req) if may_hit else []
            num_hit = len(hits) * self.kv.block_size
            num_new = min(req.num_tokens - req.num_computed_tokens - num_hit, budget)
            if self.kv.allocate_slots(req, num_new, hits) is None:
                break  # head-of-line: keep priority order rather than skip ahead
            waiting.pop()
            req.num_computed_tokens += num_hit
            req.num_prefix_hit_tokens = num_hit
            self.num_hit_tokens += num_hit
            req.status = RequestStatus.RUNNING
            decode.running.append(req)
            batch.add(req, num_new)
            budget -= num_new
        return budget


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens: int | None = None
        self.waiting = WaitingQueue()
        self.decode = DecodeManager(kv)
        self.prefill = PrefillAdder(kv, max_num_seqs)

    @property
    def running(self) -> list[Request]:
        return self.decode.running

    def add(self, req: Request) -> None:
        self.waiting.push(req)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        cap = self.max_prefill_tokens
        if cap is None or all(r.is_prefilling for r in self.decode.running):
            cap = self.max_num_batched_tokens  # no answer streams: nothing to stall
        budget, prefill = self.decode.schedule(batch, self.max_num_batched_tokens, cap)
        for req in batch.preempted:
            self.waiting.push(req)
        if not batch.preempted:  # admitting now would only steal the pages just freed
            self.prefill.schedule(batch, min(budget, prefill), self.waiting, self.decode)
        return batch

    def finish(self, req: Request, reason: str) -> None:
        """Take a request out of scheduling; held ones (``hold``) keep their pages."""
        if req.status == RequestStatus.RUNNING:
            self.decode.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        req.finish_reason = reason
        keep = req.hold and reason != "abort"
        req.status = RequestStatus.HELD if keep else RequestStatus.FINISHED
        if not keep:
            self.kv.free(req)
