"""The simulated cluster's state: its configuration, a request's timeline, an instance."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from pdserve_bench.sim.workload import SimRequest


@dataclass(frozen=True)
class SimConfig:
    chunk_tokens: int = 2048  # prompt tokens per prefill batch / colocated step
    block_size: int = 16
    block_bytes: float = 1 << 20  # KV bytes of one block (all layers)
    link_bytes_per_s: float = 1.25e9  # 10 Gbit/s
    switch_s: float = 1.0  # a flex engine's role switch once drained
    # A prefilled request's fixed cost before its decode engine can run it, whatever its
    # size: the router's Decode call, the kvd's wait and the engine's import (``--validate``
    # reads it from a run: the first decode gap's excess over the steady ones).
    handoff_s: float = 0.0

    def transfer_s(self, input_len: int) -> float:
        blocks = math.ceil(input_len / self.block_size)
        return self.handoff_s + blocks * self.block_bytes / self.link_bytes_per_s


@dataclass(slots=True)
class Req:
    r: SimRequest
    t_first: float = -1.0
    t_admit: float = -1.0  # joined a decode batch (after the KV transfer and any queue)
    t_done: float = -1.0
    prefill_left: int = 0


@dataclass(slots=True)
class Inst:
    idx: int
    role: str  # prefill | decode | colocated
    target: str = ""  # the role it is draining towards ("" = none)
    queue: deque[Req] = field(default_factory=deque)
    queued_tokens: int = 0
    batch_tokens: int = 0  # the prompt tokens of the batch (or colocated step) it computes
    busy: bool = False
    running: list[tuple[int, int, Req]] = field(default_factory=list)  # (finish step, rid, req)
    waiting: deque[Req] = field(default_factory=deque)
    k: int = 0
    step_t0: float = 0.0  # when its current step began
    noted: int = -1  # the load of its latest entry in the router's heap

    @property
    def accepting(self) -> bool:
        return not self.target

    @property
    def idle(self) -> bool:
        return not (self.busy or self.queue or self.running or self.waiting)

    @property
    def planned_role(self) -> str:
        return self.target or self.role
