"""The simulated cluster: a heapq event loop over arrivals, prefill batches, KV transfers,
decode steps, role switches and controller ticks.

    arrival ──router──► prefill instance (FIFO; a batch ≤ chunk tokens costs what its rows
        cost, ``cost.py``) ── first token at batch end ── KV hand-off ──► decode
    decode instance: continuous batching ≤ max_batch; a step of b costs step_time(b); a
        request that joined at step k finishes at step k + output_len - 1
    colocated instance: each step carries up to ``chunk`` prompt tokens beside its decodes,
        and costs what its rows cost (``cost.py``): prompts stall decodes, as chunked
        prefill does
    a prompt's KV reaches its decode instance ``handoff_s`` + blocks · block bytes / link
        after its first token
    flex instance switching role: no new work, finishes what it has, then ``switch_s``

The router sends a prompt to the prefill (or colocated) instance with the fewest prompt
tokens queued or in its running batch (the real router counts in-flight prefills) and a
prefilled request to the decode instance with the smallest batch.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator
from typing import cast

from pdserve.controller.capacity import CapacityModel
from pdserve_bench.sim.cost import step_cost
from pdserve_bench.sim.sharing import CoreSharing
from pdserve_bench.sim.state import Inst, Req, SimConfig
from pdserve_bench.sim.workload import SimRequest

ARRIVE, PREFILL_DONE, KV_DONE, STEP_DONE, SWITCH_DONE, TICK = range(6)


class Sim:
    def __init__(self, model: CapacityModel, config: SimConfig, roles: list[str],
                 on_tick: Callable[[Sim, float], None] | None = None,
                 tick_s: float = 10.0, cores: list[str] | None = None) -> None:
        self.m, self.c = model, config
        self.insts = [Inst(i, r) for i, r in enumerate(roles)]
        if cores is not None and len(cores) != len(roles):
            raise ValueError(f"cores: {len(cores)} given for {len(roles)} instances")
        # Instances pinned to one CPU set share it (``sharing.py``).
        self.sharing = CoreSharing(cores, self.push) if cores is not None else None
        self.on_tick, self.tick_s = on_tick, tick_s
        self.on_arrival: Callable[[SimRequest], None] | None = None
        # When a list: (inter-token gap, sequences that saw it), for ``--validate``'s ITL.
        self.itl: list[tuple[float, int]] | None = None
        # When a dict: every token's time per request id (its first token's first), for
        # ``--validate`` to group them into the chunks the real stream sent.
        self.token_times: dict[int, list[float]] | None = None
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.now = 0.0
        self.done: list[Req] = []
        self.backlog: dict[str, deque[Req]] = {"prefill": deque(), "decode": deque()}
        # Per role, (load, index) entries, stale ones dropped when met: the router's least
        # loaded pick in O(log n) (a scan of 512 instances per request is too slow).
        self.heaps: dict[str, list[tuple[int, int]]] = {"prefill": [], "decode": [],
                                                        "colocated": []}
        for inst in self.insts:
            self._touch(inst, force=True)

    def push(self, t: float, kind: int, obj: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, obj))

    def run(self, requests: list[SimRequest], until: float) -> list[Req]:
        arrivals = iter(requests)
        first = next(arrivals, None)
        if first is not None:
            self.push(first.t, ARRIVE, (first, arrivals))
        if self.on_tick is not None:
            self.push(0.0, TICK, None)
        handlers = {ARRIVE: self._arrive, PREFILL_DONE: self._prefill_done,
                    KV_DONE: self._kv_done, STEP_DONE: self._step_done,
                    SWITCH_DONE: self._switch_done, TICK: self._tick}
        while self.events:
            t, _, kind, obj = heapq.heappop(self.events)
            if t > until:
                break
            self.now = t
            handlers[kind](obj)
        return self.done

    # -- routing --------------------------------------------------------------------------

    @staticmethod
    def _load(inst: Inst) -> int:
        if inst.role == "prefill":
            return inst.queued_tokens + inst.batch_tokens
        if inst.role == "decode":
            return len(inst.running) + len(inst.waiting)
        return inst.queued_tokens + inst.batch_tokens + 64 * len(inst.running)

    def _touch(self, inst: Inst, force: bool = False) -> None:
        """Note ``inst``'s load (call after anything that changes it, before the next pick;
        ``force`` after a role or accepting change, whose old entries were dropped)."""
        load = self._load(inst)
        if force or load != inst.noted:
            inst.noted = load
            heapq.heappush(self.heaps[inst.role], (load, inst.idx))

    def _pick(self, role: str) -> Inst | None:
        """The accepting instance of ``role`` with the least load (ties: the lowest index)."""
        heap = self.heaps[role]
        while heap:
            load, idx = heap[0]
            inst = self.insts[idx]
            if inst.role == role and inst.accepting and self._load(inst) == load:
                return inst
            heapq.heappop(heap)
        return None

    def _arrive(self, obj: object) -> None:
        r: SimRequest
        rest: Iterator[SimRequest]
        r, rest = obj  # type: ignore[misc]
        nxt = next(rest, None)
        if nxt is not None:
            self.push(nxt.t, ARRIVE, (nxt, rest))
        if self.on_arrival is not None:
            self.on_arrival(r)
        self._route_prompt(Req(r, prefill_left=r.input_len))

    def _route_prompt(self, req: Req) -> None:
        inst = self._pick("colocated") or self._pick("prefill")
        if inst is None:
            self.backlog["prefill"].append(req)
            return
        inst.queue.append(req)
        inst.queued_tokens += req.r.input_len
        self._touch(inst)
        if not inst.busy:
            self._start(inst)

    def _kv_done(self, req: object) -> None:
        assert isinstance(req, Req)
        inst = self._pick("decode")
        if inst is None:
            self.backlog["decode"].append(req)
            return
        inst.waiting.append(req)
        self._touch(inst)
        if not inst.busy:
            self._start(inst)

    # -- instances ------------------------------------------------------------------------

    def _start(self, inst: Inst) -> None:
        if inst.role == "prefill":
            self._start_prefill(inst)
        else:
            self._start_step(inst)

    def _start_prefill(self, inst: Inst) -> None:
        batch: list[Req] = []
        tokens = 0
        while inst.queue and (not batch or tokens + inst.queue[0].r.input_len
                              <= self.c.chunk_tokens):
            req = inst.queue.popleft()
            batch.append(req)
            tokens += req.r.input_len
        inst.queued_tokens -= tokens
        inst.batch_tokens = tokens
        self._touch(inst)
        if not batch:
            inst.busy = False
            self._maybe_switch(inst)
            return
        inst.busy = True
        self._compute(inst, step_cost(self.m, 0, tokens), PREFILL_DONE, (inst, batch))

    def _prefill_done(self, obj: object) -> None:
        (inst, batch), version = cast(tuple[tuple[Inst, list[Req]], int], obj)
        if not self._computed(inst, version):
            return
        for req in batch:
            req.t_first = self.now
            self.push(self.now + self.c.transfer_s(req.r.input_len), KV_DONE, req)
        self._start_prefill(inst)

    def _admit(self, inst: Inst) -> None:
        while inst.waiting and len(inst.running) < self.m.max_batch:
            req = inst.waiting.popleft()
            req.t_admit = self.now
            if req.r.output_len <= 1:
                self._finish(req)
                continue
            heapq.heappush(inst.running, (inst.k + req.r.output_len - 1, req.r.rid, req))

    def _start_step(self, inst: Inst) -> None:
        self._admit(inst)
        chunk = 0
        if inst.role == "colocated":
            chunk = self._take_chunk(inst)
        inst.batch_tokens = chunk
        self._touch(inst)
        if not inst.running and chunk == 0:
            inst.busy = False
            self._maybe_switch(inst)
            return
        inst.busy, inst.step_t0 = True, self.now
        self._compute(inst, step_cost(self.m, len(inst.running), chunk), STEP_DONE, inst)

    def _compute(self, inst: Inst, work: float, kind: int, payload: object) -> None:
        """Schedule the end of ``inst``'s operation of ``work`` seconds at full speed (slower
        while others share its CPU set; the end event carries ``(payload, version)``)."""
        if self.sharing is None:
            self.push(self.now + work, kind, (payload, -1))
        else:
            self.sharing.start(self.now, inst.idx, work, kind, payload)

    def _computed(self, inst: Inst, version: int) -> bool:
        """At an operation's end event: False for a stale one (re-timed since)."""
        return self.sharing is None or self.sharing.end(self.now, inst.idx, version)

    def _take_chunk(self, inst: Inst) -> int:
        """Colocated: the prompt tokens this step computes (while the batch has room)."""
        budget = self.c.chunk_tokens
        room = self.m.max_batch - len(inst.running) - len(inst.waiting)
        taken = 0
        for req in inst.queue:
            if budget == 0 or room <= 0:
                break
            n = min(budget, req.prefill_left)
            req.prefill_left -= n
            budget -= n
            taken += n
            room -= req.prefill_left == 0
        inst.queued_tokens -= taken
        return taken

    def _step_done(self, obj: object) -> None:
        inst, version = cast(tuple[Inst, int], obj)
        if not self._computed(inst, version):
            return
        inst.k += 1
        if self.itl is not None:
            self._record_gaps(inst)
        while inst.running and inst.running[0][0] <= inst.k:
            self._finish(heapq.heappop(inst.running)[2])
        while inst.queue and inst.queue[0].prefill_left == 0:  # colocated prompts done
            req = inst.queue.popleft()
            req.t_first = self.now
            inst.waiting.append(req)
        self._start_step(inst)

    def _record_gaps(self, inst: Inst) -> None:
        """This step's gap for every sequence in it; a sequence's first decode token's gap
        runs from its first token (the stall of the KV transfer and the decode queue)."""
        assert self.itl is not None
        gap = self.now - inst.step_t0
        first = [req for end, _, req in inst.running if end - req.r.output_len + 2 == inst.k]
        self.itl.append((gap, len(inst.running) - len(first)))
        self.itl.extend((self.now - req.t_first, 1) for req in first)
        if self.token_times is not None:
            for _, rid, req in inst.running:
                self.token_times.setdefault(rid, [req.t_first]).append(self.now)

    def _finish(self, req: Req) -> None:
        req.t_done = self.now
        self.done.append(req)

    # -- role switches (flex) -------------------------------------------------------------

    def switch(self, inst: Inst, role: str) -> None:
        """Drain ``inst`` towards ``role`` (the controller's actuator in the simulation)."""
        if role == inst.role and not inst.target:
            return
        inst.target = role if role != inst.role else ""
        if inst.target:
            self._maybe_switch(inst)
        else:
            self._touch(inst, force=True)  # accepting again

    def _maybe_switch(self, inst: Inst) -> None:
        if inst.target and inst.idle:
            inst.busy = True  # switching
            self.push(self.now + self.c.switch_s, SWITCH_DONE, inst)

    def _switch_done(self, inst: object) -> None:
        assert isinstance(inst, Inst)
        inst.role, inst.target, inst.busy = inst.target or inst.role, "", False
        self._touch(inst, force=True)
        if inst.queue or inst.waiting:  # work routed here while a cancelled switch ran
            self._start(inst)
        backlog = self.backlog[inst.role]
        while backlog:
            req = backlog.popleft()
            self._route_prompt(req) if inst.role == "prefill" else self._kv_done(req)

    def _tick(self, _: object) -> None:
        assert self.on_tick is not None
        self.on_tick(self, self.now)
        self.push(self.now + self.tick_s, TICK, None)
