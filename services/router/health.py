"""Engines that took a call and then answer nothing: a paused (SIGSTOP'd) or hung process.

A call that has brought nothing for ``StallLimits.first`` seconds (its first answer: a
prefill's response, a decode's first chunk) or ``StallLimits.between`` seconds (between two
chunks of a stream) is not given up yet: a slow answer is as often a busy engine (a long
prefill, a decode waiting for KV blocks) as a dead one. The engine is asked ``Health.Check``,
which it answers off its engine thread: one that answers within ``StallLimits.probe`` is alive
and the call waits on; one that does not is stalled. The call is then cancelled and fails with
``Stalled`` (UNAVAILABLE): the caller takes the engine out of the rotation (until a poll finds
it answering again) and goes on elsewhere, as after any UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import Counter

from services.router.instances import Instance

T = TypeVar("T")
STALLS = Counter("pdserve_router_stalled_calls", "Engine calls cancelled because the engine "
                 "sent nothing and did not answer a health check (paused or hung)", ["phase"])


@dataclass(frozen=True)
class StallLimits:
    """Seconds: until a call's first answer, between a stream's chunks, for the probe."""

    first: float = 3.0
    between: float = 3.0
    probe: float = 2.0


class Stalled(grpc.RpcError):
    """An engine that stopped answering a call and its health check: retried elsewhere."""

    def __init__(self, inst: Instance, waited: float, probe: float) -> None:
        self._details = (f"{inst.instance_id} sent nothing for {waited:.1f}s and did not "
                         f"answer a health check within {probe:.1f}s (paused or hung): call "
                         "cancelled")
        super().__init__(self._details)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


async def answers(inst: Instance, timeout: float) -> bool:
    """Whether ``inst``'s process answers a health check within ``timeout`` (any status:
    a draining engine is alive and finishes its calls)."""
    try:
        await inst.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError:
        return False
    return True


async def watched(pending: Awaitable[T], inst: Instance, limits: StallLimits, first: bool,
                  cancel: Callable[[], object], phase: str) -> T:
    """``pending``'s result, probing ``inst`` each time it takes longer than the limit;
    ``cancel`` (the call's) and ``Stalled`` when the engine does not answer the probe.

    ``pending`` is awaited in the caller's task (a timer watches it, no task per read); a
    stalled call is cancelled, which ends that await with CancelledError, raised here as
    ``Stalled`` unless the caller itself is being cancelled."""
    watch = _Watch(inst, limits, cancel, limits.first if first else limits.between)
    try:
        return await pending
    except (asyncio.CancelledError, grpc.RpcError):  # a cancelled call may end either way
        task = asyncio.current_task()
        if watch.stalled is None or (task is not None and task.cancelling()):
            raise
        STALLS.labels(phase).inc()
        raise watch.stalled from None
    finally:
        watch.stop()


class _Watch:
    """The timer of one ``watched`` call: at each limit a health probe (a task, only then);
    an engine that does not answer it has its call cancelled."""

    def __init__(self, inst: Instance, limits: StallLimits, cancel: Callable[[], object],
                 limit: float) -> None:
        self.inst, self.limits, self.cancel, self.limit = inst, limits, cancel, limit
        self.waited = 0.0
        self.stalled: Stalled | None = None
        self.loop = asyncio.get_running_loop()
        self.timer: asyncio.TimerHandle | None = self.loop.call_later(limit, self._fire)
        self.probe: asyncio.Task[None] | None = None

    def _fire(self) -> None:
        self.timer = None
        self.waited += self.limit
        self.probe = self.loop.create_task(self._probe())

    async def _probe(self) -> None:
        if await answers(self.inst, self.limits.probe):
            self.limit = self.limits.between
            self.timer = self.loop.call_later(self.limit, self._fire)
            return
        self.stalled = Stalled(self.inst, self.waited, self.limits.probe)
        self.cancel()

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.probe is not None and not self.probe.done():
            self.probe.cancel()
