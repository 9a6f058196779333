"""SLO-aware admission (``--slo-admission``; issue 15 item 5): a request whose predicted time
to first token misses the TTFT SLO (``--slo-ttft-ms``) or its deadline is never silently late.

    predicted TTFT = wait in the admission queue        (AdmissionQueue.estimated_wait)
                   + prompt tokens queued on the least loaded prefill engine, and its own,
                     at that engine's prefill rate    (the fastest it has shown; before any,
                                                       the calibrated CapacityModel's)
                   + the model's prefill batch overhead and one decode step

    --slo-admission off      no prediction
                    reject   over the SLO -> RESOURCE_EXHAUSTED (429) with Retry-After
                    queue    over the SLO -> held until the prediction (from then) fits, at
                             most --max-wait (or the deadline); then RESOURCE_EXHAUSTED
    either mode: a prediction over the request's deadline -> RESOURCE_EXHAUSTED at once

The prediction ignores prefix-cache hits (not looked up yet): it errs on the late side.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from pdserve.controller.capacity import CapacityModel
from pdserve.errors import StatusError
from pdserve.proto.v1 import common_pb2
from services.router.admission import AdmissionQueue
from services.router.instances import Instance, InstancePool

SLO_ADMISSION_MODES = ("off", "queue", "reject")
QUEUE_STEP_S = 0.05  # how often a held request's prediction is made again


@dataclass(frozen=True)
class Prediction:
    queue_s: float  # admission queue
    prefill_s: float  # prompts ahead + this one + overhead + one decode step

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.prefill_s

    def __str__(self) -> str:
        return (f"predicted time to first token {self.ttft_s:.2f}s (admission queue "
                f"{self.queue_s:.2f}s, prefill {self.prefill_s:.2f}s)")


def _prefill_engines(pool: InstancePool) -> list[Instance]:
    return pool.healthy(common_pb2.ROLE_PREFILL) or pool.healthy(common_pb2.ROLE_COLOCATED)


def predict(prompt_tokens: int, admission: AdmissionQueue, pool: InstancePool,
            model: CapacityModel) -> Prediction | None:
    """The TTFT a request of ``prompt_tokens`` arriving now can expect; None without engines."""
    engines = _prefill_engines(pool)
    if not engines:
        return None
    waits = admission.num_running >= admission.max_running or admission.num_queued > 0
    queue_s = admission.estimated_wait(admission.num_queued) if waits else 0.0

    def prefill_s(inst: Instance) -> float:
        rate = inst.peak_prefill_tokens_per_s or model.prefill_tokens_per_s
        ahead = max(inst.num_inflight_prefill_tokens, inst.stats.queue_depth * prompt_tokens)
        return (ahead + prompt_tokens) / rate

    best = min(prefill_s(i) for i in engines)
    return Prediction(queue_s, best + model.prefill_overhead_s + model.step_time(1))


@dataclass
class SloGate:
    """One per router (its event loop). ``model`` is read at each call: the controller's refits
    replace it."""

    mode: str
    ttft_slo_s: float
    admission: AdmissionQueue
    pool: InstancePool
    model: Callable[[], CapacityModel]
    max_wait_s: float
    clock: Callable[[], float] = time.monotonic

    async def check(self, prompt_tokens: int, time_left: float | None) -> Prediction | None:
        """Return when the request may go on; raise ``StatusError`` when it may not."""
        if self.mode == "off":
            return None
        start = self.clock()
        while True:
            p = predict(prompt_tokens, self.admission, self.pool, self.model())
            left = None if time_left is None else time_left - (self.clock() - start)
            if p is None or p.ttft_s <= self.ttft_slo_s and (left is None or p.ttft_s <= left):
                return p
            if left is not None and p.ttft_s > left:
                raise _refused(f"router: the request's deadline ({left:.2f}s left) cannot be "
                               f"met: {p}", p.ttft_s)
            over = f"{p} exceeds the TTFT SLO of {self.ttft_slo_s * 1000:g} ms (--slo-ttft-ms)"
            if self.mode == "reject":
                raise _refused(f"router: {over}; refused (--slo-admission reject)",
                               p.ttft_s - self.ttft_slo_s)
            waited = self.clock() - start
            if waited + QUEUE_STEP_S > self.max_wait_s:
                raise _refused(f"router: held {waited:.1f}s (--max-wait {self.max_wait_s:g}s) "
                               f"and still {over}", p.ttft_s - self.ttft_slo_s)
            await asyncio.sleep(QUEUE_STEP_S)


def _refused(message: str, late_s: float) -> StatusError:
    return StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, message,
                       retry_after=max(1.0, math.ceil(late_s)))
