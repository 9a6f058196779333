"""One Engine, stepped by one dedicated thread, driven from asyncio.

    asyncio loop (gRPC handlers)              engine thread (touches Engine; see inline below)
    ---------------------------               -------------------------------------------
    await call(fn) ── commands (SimpleQueue) ─►  run queued commands between steps
    add_request() -> RequestStream               while work: step() -> outputs
    async for out in stream  ◄── call_soon_threadsafe(deliver) ── per-request asyncio.Queue

The Engine is not thread-safe, so every access (add, abort, release, export/import of blocks,
stats) is a command the thread runs between two steps. Steps never block the event loop, and
a handler awaiting its queue costs nothing while the batch runs.

A short call may ask to run at once (``call(fn, inline=True)``: adds, releases, the kvd
bridge's small block copies). On a CPU engine whose thread is parked (no step running, no command
queued) it then runs on the caller's thread, under the lock the engine thread holds while it
works, instead of waking the engine thread and waiting to be woken back: two thread hand-offs,
0.15-0.3 ms on this repository's 2-vCPU machine. Otherwise it is queued like any call.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from pdserve.engine.engine import Engine
from pdserve.engine.request import EngineStats, RequestOutput, RequestStatus
from pdserve.errors import StatusError
from pdserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineFailed(StatusError):
    """The engine raised inside a step; every live request of that step is failed with it."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.INTERNAL, message)


@dataclass
class StepTimes:
    """When a request was first scheduled and how long the steps that advanced it took."""

    added: float = 0.0
    first_scheduled: float | None = None
    compute_s: float = 0.0

    @property
    def queue_s(self) -> float:
        return 0.0 if self.first_scheduled is None else self.first_scheduled - self.added


@dataclass
class RequestStream:
    """Outputs of one request, in step order; iteration ends after the finished output."""

    request_id: str
    times: StepTimes
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    finished: bool = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item


class ThroughputWindow:
    """Recent prefill/decode tokens per second: the tokens of the steps that ended in the last
    ``window_s`` seconds (counted from cumulative counters sampled after each step)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, int, int]] = collections.deque()

    def add(self, now: float, num_prefill: int, num_decode: int) -> None:
        self._samples.append((now, num_prefill, num_decode))
        # Keep one sample at or before the window's start: the baseline of the counts.
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def rates(self, now: float) -> tuple[float, float]:
        samples = list(self._samples)  # a snapshot: the engine thread appends concurrently
        if not samples:
            return 0.0, 0.0
        start = now - self.window_s
        base = samples[0]
        for sample in samples:
            if sample[0] <= start:
                base = sample
        _, p1, d1 = samples[-1]
        span = max(min(self.window_s, now - base[0]), 1e-3)
        return (p1 - base[1]) / span, (d1 - base[2]) / span


class AsyncEngine:
    def __init__(self, engine: Engine, stats_window: float = 10.0) -> None:
        self.engine = engine
        self.window = ThroughputWindow(stats_window)
        self.last_stats: EngineStats | None = None  # after the latest step
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._progress: dict[str, int] = {}  # under _working: computed tokens per request
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Held by the engine thread while it works on the engine (commands, a step); an
        # inline call that takes it runs while the thread is parked. CUDA engines keep every
        # access on their own thread (its device and streams).
        self._working = threading.Lock()
        self._inline = engine.device.type == "cpu"

    # -- life cycle -----------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        stats = self.engine.stats()  # the window's origin, so the first step has a rate
        self.last_stats = stats
        self.window.add(time.monotonic(), stats.num_prefill_tokens, stats.num_decode_tokens)
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    @property
    def num_streams(self) -> int:
        """Requests added through this wrapper that have not finished yet."""
        return len(self._streams)

    # -- calls from asyncio ---------------------------------------------------------------

    async def call(self, fn: Callable[[Engine], T], inline: bool = False) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps; return its result.
        ``inline``: a short ``fn`` that may run on this thread at once if the engine thread
        is parked (see the module's docstring)."""
        assert self._loop is not None, "AsyncEngine.start() was not called"
        if inline and self._inline and self._working.acquire(blocking=False):
            try:
                if self._commands.empty():  # nothing queued before it: the order holds
                    return fn(self.engine)
            finally:
                self._working.release()
                self._wake.set()  # the thread looks again for work (an add, or what is queued)
        loop, fut = self._loop, self._loop.create_future()

        def command() -> None:
            try:
                result: Any = fn(self.engine)
            except BaseException as exc:  # handed to the caller, who decides  # noqa: BLE001
                loop.call_soon_threadsafe(_settle, fut, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, fut, result, None)

        self._commands.put(command)
        self._wake.set()
        return await fut

    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams, priority: int = 0, cache_salt: str = "",
                          prefill_only: bool = False, hold: bool = False,
                          prior_output: int = 0) -> RequestStream:
        """Queue a request; raises the engine's BadRequest (naming the field) if it is bad."""
        stream = RequestStream(request_id, StepTimes(added=time.monotonic()))
        self._streams[request_id] = stream  # before the add: its first output may come at once

        def add(engine: Engine) -> None:
            engine.add_request(request_id, prompt_token_ids, params, priority, cache_salt,
                               prefill_only, hold, prior_output)
            self._progress[request_id] = 0

        try:
            await self.call(add, inline=True)
        except asyncio.CancelledError:
            # The add may still run on the engine thread: undo it there, after it.
            self._streams.pop(request_id, None)
            self._commands.put(lambda: self._abort_quietly(request_id))
            self._wake.set()
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    async def abort(self, request_id: str) -> bool:
        """Abort a queued, running or held request and free its pages."""
        found = await self.call(lambda e: e.abort(request_id))
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            stream.queue.put_nowait(RequestOutput(request_id, [], finished=True,
                                                  finish_reason="abort"))
        return found

    async def refuse_waiting(self, request_ids: set[str], error: BaseException) -> list[str]:
        """Take those of ``request_ids`` the engine has queued but never scheduled (WAITING,
        never preempted: no token computed, no page held) out of it; their streams raise
        ``error``. A flex engine switching role hands such requests back this way (they can
        start elsewhere at no loss); the ones already running are left to finish."""

        def take(engine: Engine) -> list[str]:
            taken = []
            for rid in request_ids:
                req = engine.requests.get(rid)
                if req is not None and req.status == RequestStatus.WAITING \
                        and req.num_preemptions == 0:
                    engine.abort(rid)
                    taken.append(rid)
            # Posted before the step that emits their "abort" outputs: those find no stream.
            self._post(self._refuse_streams, (taken, error))
            return taken

        return await self.call(take)

    async def release(self, request_id: str) -> None:
        """Free the pages a finished held request (prefill_only or ``hold``) still has."""
        await self.call(lambda e: e.release(request_id), inline=True)

    # -- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            stalled = False
            with self._working:
                self._wake.clear()
                self._run_commands()
                idle = not self.engine.has_unfinished()
                if not idle:
                    stalled = self._step()
            if idle:
                self._wake.wait()
            elif stalled:
                # Every page is held by finished prefills whose blocks are being copied to
                # kvd: their release (a command, or an inline call) frees one; wait for it
                # instead of spinning.
                self._wake.wait(0.05)

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _step(self) -> bool:
        """One step; True when no request could be scheduled (every page held)."""
        start = time.monotonic()
        try:
            outputs = self.engine.step()
        except RuntimeError as exc:
            if "held by" in str(exc):
                return True
            log.exception("engine step failed")
            for rid in list(self.engine.requests):  # fail them all, so later steps can run
                self._abort_quietly(rid)
            self._post(self._fail_all, EngineFailed(f"engine step failed: {exc}"))
            return False
        end = time.monotonic()
        stats = self.last_stats = self.engine.stats()  # read by other threads (metrics)
        self.window.add(end, stats.num_prefill_tokens, stats.num_decode_tokens)
        advanced = self._advanced()
        if outputs or advanced:
            self._post(self._deliver, (outputs, advanced, start, end))
        return False

    def _abort_quietly(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except (RuntimeError, ValueError):
            log.exception("abort failed", extra={"fields": {"request_id": request_id}})

    def _advanced(self) -> list[str]:
        """Requests this step computed tokens for (for queue/compute timings)."""
        out = []
        for rid, before in list(self._progress.items()):
            req = self.engine.requests.get(rid)
            if req is None:
                del self._progress[rid]
                out.append(rid)  # finished in this step
                continue
            if req.num_computed_tokens != before:
                self._progress[rid] = req.num_computed_tokens
                out.append(rid)
        return out

    def _post(self, fn: Callable[[Any], None], arg: Any) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, arg)

    # -- back on the event loop -----------------------------------------------------------

    def _deliver(self, item: tuple[list[RequestOutput], list[str], float, float]) -> None:
        outputs, advanced, start, end = item
        for rid in advanced:
            stream = self._streams.get(rid)
            if stream is not None:
                if stream.times.first_scheduled is None:
                    stream.times.first_scheduled = start
                stream.times.compute_s += end - start
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.queue.put_nowait(out)
            if out.finished:
                del self._streams[out.request_id]

    def _refuse_streams(self, item: tuple[list[str], BaseException]) -> None:
        request_ids, error = item
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None and not stream.finished:
                stream.queue.put_nowait(error)

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.queue.put_nowait(exc)


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():  # the caller was cancelled meanwhile
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
