"""Admission: a bounded, priority-ordered, per-tenant fair queue in front of the router's
``--max-concurrent`` slots. Overload waits here instead of being refused.

    acquire(priority, tenant, time_left)
      a slot is free and nobody waits      -> admitted at once
      the queue holds --max-queued already -> RESOURCE_EXHAUSTED, Retry-After = estimated
                                              time for one queued request to be admitted
      the estimated wait > time_left       -> RESOURCE_EXHAUSTED (the deadline cannot be
                                              met), Retry-After = that estimate
      else                                 -> queued; admitted when a slot frees, or
                                              DEADLINE_EXCEEDED when time_left runs out
    release()   a slot frees: the next waiter is admitted

Order of admission: lower ``priority`` first (0 = interactive); within a priority, tenants
take turns (round robin), and each tenant's own requests keep their arrival order. So one
tenant's burst of a hundred requests does not delay another tenant's single request by a
hundred service times.

The estimate: requests finish at about ``max_running / mean_service_s`` per second (the mean
measured over recent requests, ``mean_service_s`` at start), so the n-th in line waits about
``n * mean_service_s / max_running``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from pdserve.errors import StatusError

_EWMA = 0.2  # weight of the newest request's service time in the running mean


@dataclass(eq=False)
class _Waiter:
    tenant: str
    future: asyncio.Future[None]


@dataclass
class AdmissionQueue:
    """One per router, used from its event loop only."""

    max_running: int
    max_queued: int
    mean_service_s: float = 1.0  # prior, until requests have been measured
    clock: Callable[[], float] = time.monotonic
    num_running: int = 0
    # priority -> tenant -> that tenant's waiters in arrival order (tenants in turn order).
    _classes: dict[int, OrderedDict[str, deque[_Waiter]]] = field(default_factory=dict)
    num_queued: int = 0

    def estimated_wait(self, position: int) -> float:
        """Seconds until the request ``position`` places behind the head (0 = head) starts."""
        return (position + 1) * self.mean_service_s / self.max_running

    def retry_after(self) -> float:
        """When a refused request may try again: about when the queue has room for it."""
        over = max(1, self.num_queued - self.max_queued + 1)
        return max(1.0, math.ceil(self.estimated_wait(over - 1)))

    async def acquire(self, priority: int, tenant: str, time_left: float | None) -> float:
        """Wait for a slot (see the module doc); returns the admission clock time."""
        if self.num_running < self.max_running and self.num_queued == 0:
            self.num_running += 1
            return self.clock()
        if self.num_queued >= self.max_queued:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"router: admission queue full ({self.num_queued} requests "
                              f"waiting, --max-queued {self.max_queued}; "
                              f"{self.num_running} running, --max-concurrent {self.max_running})",
                              retry_after=self.retry_after())
        wait = self.estimated_wait(self._position(priority))
        if time_left is not None and wait > time_left:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"router: the request's deadline ({time_left:.1f}s left) cannot "
                              f"be met: about {wait:.1f}s of queue ahead of it",
                              retry_after=max(1.0, math.ceil(wait)))
        waiter = _Waiter(tenant, asyncio.get_running_loop().create_future())
        self._push(priority, waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), time_left)
        except TimeoutError:
            if not self._drop(waiter):  # admitted in the same instant: give the slot back
                self.release(None)
            raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"deadline exceeded after {time_left:.1f}s waiting in the "
                              "router's admission queue") from None
        except asyncio.CancelledError:
            if not self._drop(waiter):
                self.release(None)
            raise
        return self.clock()

    def release(self, service_s: float | None) -> None:
        """A running request ended after ``service_s`` seconds (None: not measured)."""
        self.num_running -= 1
        if service_s is not None:
            self.mean_service_s += _EWMA * (service_s - self.mean_service_s)
        self._grant()

    def _position(self, priority: int) -> int:
        """How many waiters are admitted before a new one of ``priority`` (at least)."""
        return sum(len(q) for p, tenants in self._classes.items() if p <= priority
                   for q in tenants.values())

    def _push(self, priority: int, waiter: _Waiter) -> None:
        tenants = self._classes.setdefault(priority, OrderedDict())
        tenants.setdefault(waiter.tenant, deque()).append(waiter)
        self.num_queued += 1

    def _drop(self, waiter: _Waiter) -> bool:
        """Remove a waiter not yet admitted; False if it was admitted already."""
        if waiter.future.done():
            return False
        for priority, tenants in self._classes.items():
            line = tenants.get(waiter.tenant)
            if line is not None and waiter in line:
                line.remove(waiter)
                if not line:
                    del tenants[waiter.tenant]
                if not tenants:
                    del self._classes[priority]
                self.num_queued -= 1
                waiter.future.cancel()
                return True
        return False

    def _grant(self) -> None:
        while self.num_running < self.max_running and self.num_queued:
            priority = min(self._classes)
            tenants = self._classes[priority]
            tenant, line = next(iter(tenants.items()))
            waiter = line.popleft()
            del tenants[tenant]
            if line:  # this tenant's next request goes to the back of the turn order
                tenants[tenant] = line
            if not tenants:
                del self._classes[priority]
            self.num_queued -= 1
            self.num_running += 1
            waiter.future.set_result(None)
