"""One request's state across its engine calls (``Flow``): its deadline and placement, the
waits for busy or down instances, and the errors the phases raise (``phases`` has the calls)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from pdserve.errors import StatusError, details_of
from pdserve.proto.v1 import common_pb2, engine_pb2, router_pb2
from services.router import metrics
from services.router.health import StallLimits
from services.router.instances import Instance
from services.router.policy import Choice, RouteQuery
from services.router.requests import Prepared

# Worth another instance: it was busy, down, broke, or no longer in that role (a flex engine
# that switched: FAILED_PRECONDITION). Anything else (INVALID_ARGUMENT, ...) would fail the
# same way elsewhere and goes back to the client as it is.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                       grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION})
# A decode that could not get the request's KV blocks failed for want of them, not by itself:
# their transfer was aborted (the source node lost, partitioned or stalled: ABORTED), they are
# nowhere (NOT_FOUND) or arrived corrupt twice (DATA_LOSS). Another decode pulling from the
# same source would wait out the same fault: the prompt is prefilled again instead.
KV_LOST = frozenset({grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND,
                     grpc.StatusCode.DATA_LOSS})


class KvLost(StatusError):
    """A decode could not get the request's KV before its first chunk (``KV_LOST``)."""


class Interrupted(StatusError):
    """A decode failed after part of the answer was sent (``failed``: that engine): the
    stream may go on elsewhere (``services.router.failover``), else this goes to the client."""

    def __init__(self, message: str, failed: Instance) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)
        self.failed = failed


@dataclass(frozen=True)
class Resume:
    """What a decode continuing an answer after a failover is given: the prompt followed by
    the tokens sent but the last (``prompt_ids``), the last one (``first_token_id``), how many
    of the prompt's are output (``prior_output``) and what is left of max_tokens."""

    prompt_ids: list[int]
    first_token_id: int
    prior_output: int
    sampling: common_pb2.SamplingParams


class Busy(StatusError):
    """Every instance tried answered RESOURCE_EXHAUSTED (KV cache or queue full): capacity
    that comes back as running requests finish, so the request waits (``wait_busy``) instead
    of failing."""


class Down(StatusError):
    """No instance of a role could take the request: every one tried failed (down, broken) or
    none is healthy. While some are known, they are likely restarting: the request waits
    (``Flow.wait_down``) for one to come back, like for busy ones."""


def retry_after_of(exc: grpc.RpcError) -> float:
    retry = details_of(exc).retry_after  # type: ignore[arg-type]
    return retry if retry is not None else 0.1


@dataclass
class Flow:
    """One request in flight: what was decided, and what is live where."""

    prepared: Prepared
    time_remaining: Callable[[], float | None]
    metadata: tuple[tuple[str, str], ...]  # traceparent for every outbound call
    arrived: float  # perf_counter at arrival
    max_retries: int
    query: RouteQuery | None = None
    choice: Choice | None = None
    prefill_response: engine_pb2.PrefillResponse | None = None
    num_tokens_sent: int = 0
    num_decode_chunks: int = 0  # chunks relayed from Decode streams (retry only before any)
    touched: list[Instance] = field(default_factory=list)  # engines that may hold the request
    is_finished: bool = False
    is_latency_recorded: bool = False
    max_wait: float = 30.0  # seconds the request may wait for busy engines, in all
    num_busy_waits: int = 0
    sent_ids: list[int] = field(default_factory=list)  # the answer's tokens sent so far
    resume: Resume | None = None  # set by a failover: decode from here
    num_failovers: int = 0
    stalls: StallLimits = field(default_factory=StallLimits)  # when a silent engine is left
    came_back: Callable[[], asyncio.Event] = asyncio.Event  # set when an instance is back

    def timeout(self) -> float | None:
        """Seconds left for an outbound call: the client's deadline, never more."""
        left = self.time_remaining()
        if left is not None and left <= 0:
            raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded in the router")
        return left

    async def wait_busy(self, busy: Busy, waited: float) -> float:
        """Sleep before trying busy engines again (backing off); raise RESOURCE_EXHAUSTED
        with Retry-After when the request's deadline or ``max_wait`` would pass first."""
        delay = min(0.5, 0.05 * 2 ** min(self.num_busy_waits, 4), busy.retry_after or 0.5)
        left = self.time_remaining()
        if waited + delay > self.max_wait or (left is not None and left < delay):
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{busy.message}; still busy after waiting {waited:.1f}s",
                              retry_after=max(1.0, busy.retry_after or 1.0))
        self.num_busy_waits += 1
        metrics.BUSY_WAITS.inc()
        await asyncio.sleep(delay)
        return waited + delay

    async def wait_down(self, down: StatusError, waited: float) -> float:
        """Sleep before looking for a healthy instance again (an engine restarting); raise
        ``down`` (told how long it waited) when the deadline or ``max_wait`` would pass first."""
        delay = min(0.5, 0.05 * 2 ** min(self.num_busy_waits, 4))
        left = self.time_remaining()
        if waited + delay > self.max_wait or (left is not None and left < delay):
            raise StatusError(down.code, f"{down.message}; none came back within {waited:.1f}s",
                              retry_after=1.0)
        self.num_busy_waits += 1
        metrics.DOWN_WAITS.inc()
        start = time.monotonic()
        with contextlib.suppress(TimeoutError):  # woken early when an instance comes back
            await asyncio.wait_for(self.came_back().wait(), delay)
        return waited + time.monotonic() - start

    def before_call(self) -> None:
        if not self.is_latency_recorded:
            self.is_latency_recorded = True
            metrics.ADDED_LATENCY.observe(time.perf_counter() - self.arrived)

    def usage(self, cached_tokens: int) -> common_pb2.Usage:
        return common_pb2.Usage(prompt_tokens=len(self.prepared.prompt_ids),
                                completion_tokens=self.num_tokens_sent,
                                cached_tokens=cached_tokens, failovers=self.num_failovers)

    def placement(self) -> router_pb2.Placement:
        assert self.choice is not None
        p = self.choice.prefill
        return router_pb2.Placement(
            prefill_instance=p.instance_id if p else "",
            decode_instance=self.choice.decode.instance_id,
            cached_blocks=self.choice.cached_blocks,
            prompt_tokens=len(self.prepared.prompt_ids))


def rpc_error(exc: grpc.RpcError, where: str) -> StatusError:
    code = exc.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return StatusError(code, f"deadline exceeded waiting for {where}")
    return StatusError.relay(exc, where)  # the peer's field violations and RetryInfo too

