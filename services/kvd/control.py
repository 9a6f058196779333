"""The engine's per-transfer calls over one stream (``Kvd.Control``, or the same messages on
the kvd's Unix socket: ``control_socket``): Allocate, Commit, Await and
Release as messages on a stream the engine holds open, each answered by id; peer kvds send
their Transfer requests on one too.

    engine ──ControlRequest{id, commit}──►  kvd   (one task per request: an Await waiting on
    engine ──ControlRequest{id, wait}────►         a transfer holds back nothing behind it)
    engine ◄──ControlResponse{id, ...}────         answers in completion order

The calls are the unary rpcs' own code (``calls``), so checks, semantics and error messages are
the same; a failure answers that request with a ``ControlError`` and the stream goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
from opentelemetry import propagate, trace

from pdserve.errors import StatusError
from pdserve.proto.v1 import kvd_pb2
from services.kvd.daemon import Kvd

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("pdserve")
_RPC = {"allocate": "Allocate", "commit": "Commit", "wait": "Await", "release": "Release",
        "transfer": "Transfer"}


def margin(timeout: float) -> float:
    """Finish an Await a little before the caller's deadline, so it gets our reason."""
    return max(0.0, timeout - min(0.05, timeout / 10))


def allocate(kvd: Kvd, req: kvd_pb2.AllocateRequest) -> kvd_pb2.AllocateResponse:
    pins = kvd.allocate(req.num_slots, req.lease_ms, req.client_id)
    return kvd_pb2.AllocateResponse(pins=[kvd_pb2.Pin(slot=p.slot, pin_id=p.pin_id)
                                          for p in pins])


async def commit(kvd: Kvd, req: kvd_pb2.CommitRequest) -> kvd_pb2.CommitResponse:
    dest = req.destination if req.HasField("destination") else None
    return await kvd.commit(req.entries, dest, req.release, req.client_id)


async def wait(kvd: Kvd, req: kvd_pb2.AwaitRequest, timeout: float) -> kvd_pb2.AwaitResponse:
    source = req.source if req.HasField("source") else None
    pins = await kvd.await_blocks(req.blocks, source, req.lease_ms, req.client_id, timeout)
    return kvd_pb2.AwaitResponse(pins=[kvd_pb2.Pin(slot=p.slot, pin_id=p.pin_id)
                                       for p in pins])


def release(kvd: Kvd, req: kvd_pb2.ReleaseRequest) -> kvd_pb2.ReleaseResponse:
    return kvd_pb2.ReleaseResponse(num_released=kvd.release(req.pin_ids, req.client_id))


# Calls the daemon answers without waiting on anything: a carrier answers them as it reads them,
# not in a task of their own (a task is one more turn of the event loop before the answer).
AT_ONCE = frozenset({"allocate", "release"})


def answer_now(kvd: Kvd, req: kvd_pb2.ControlRequest) -> kvd_pb2.ControlResponse | None:
    """The answer to an ``AT_ONCE`` call (in its span, as ``answer`` gives it); None for the
    other calls, which ``answer`` serves."""
    kind = req.WhichOneof("call")
    if kind not in AT_ONCE:
        return None
    with _serving(req, kind) as out:
        _at_once(kvd, req, kind, out)
    return out


async def answer(kvd: Kvd, req: kvd_pb2.ControlRequest) -> kvd_pb2.ControlResponse:
    """Serve one request in a span named as its unary rpc's (``Kvd.Commit``...), a child of
    the caller's trace context."""
    kind = req.WhichOneof("call")
    with _serving(req, kind) as out:
        if kind in AT_ONCE:
            _at_once(kvd, req, kind, out)
        elif kind == "commit":
            out.commit.CopyFrom(await commit(kvd, req.commit))
        elif kind == "wait":
            timeout = req.timeout_ms / 1000 if req.timeout_ms else kvd.config.transfer_timeout
            out.wait.CopyFrom(await wait(kvd, req.wait, margin(timeout)))
        elif kind == "transfer":
            out.transfer.CopyFrom(await kvd.transfer(req.transfer))
        else:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              "call: one of allocate, commit, wait, release, transfer is "
                              "required")
    return out


def _at_once(kvd: Kvd, req: kvd_pb2.ControlRequest, kind: str | None,
             out: kvd_pb2.ControlResponse) -> None:
    if kind == "allocate":
        out.allocate.CopyFrom(allocate(kvd, req.allocate))
    else:
        out.release.CopyFrom(release(kvd, req.release))


@contextlib.contextmanager
def _serving(req: kvd_pb2.ControlRequest, kind: str | None
             ) -> Iterator[kvd_pb2.ControlResponse]:
    """The call's answer, filled in the call's span (named as its unary rpc's, a child of the
    caller's trace context). A failure becomes the answer's error: its status and message, or
    INTERNAL (as the unary idiom answers) with the details in the log; an error marks the
    span."""
    span = _tracer.start_span(f"Kvd.{_RPC.get(kind or '', 'Control')}",
                              context=propagate.extract(dict(req.trace_context)),
                              kind=trace.SpanKind.SERVER)
    out = kvd_pb2.ControlResponse(id=req.id)
    with trace.use_span(span, end_on_exit=True):
        try:
            yield out
        except StatusError as exc:
            out.error.code, out.error.message = exc.code.value[0], exc.message
        except Exception as exc:  # noqa: BLE001 - answered INTERNAL like the unary idiom does
            log.error("control call failed with an internal error", exc_info=exc,
                      extra={"fields": {"call": kind}})
            out.error.code = grpc.StatusCode.INTERNAL.value[0]
            out.error.message = (f"{kind}: internal error ({type(exc).__name__}); the kvd log "
                                 "has the details")
        if out.WhichOneof("result") == "error":
            span.set_status(trace.StatusCode.ERROR, str(out.error.code))


async def serve(kvd: Kvd, requests: AsyncIterator[kvd_pb2.ControlRequest]
                ) -> AsyncIterator[kvd_pb2.ControlResponse]:
    """Answer every request of the stream, each in its own task, in completion order."""
    answers: asyncio.Queue[kvd_pb2.ControlResponse | None] = asyncio.Queue()
    tasks: set[asyncio.Task[Any]] = set()

    async def respond(req: kvd_pb2.ControlRequest) -> None:
        answers.put_nowait(await answer(kvd, req))

    async def read() -> None:
        try:
            async for req in requests:
                now = answer_now(kvd, req)
                if now is not None:
                    answers.put_nowait(now)
                    continue
                task = asyncio.ensure_future(respond(req))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:  # the client half-closed: finish what it asked first
                await asyncio.wait(set(tasks))
        finally:
            answers.put_nowait(None)

    reader = asyncio.ensure_future(read())
    try:
        while (item := await answers.get()) is not None:
            yield item
        reader.result()  # a broken request stream ends the call with its error
    finally:
        reader.cancel()
        for task in list(tasks):
            task.cancel()
