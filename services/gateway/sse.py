"""Streaming plumbing: an SSE response with its own send loop, and cancellation of the
request's task when its client disconnects (which cancels the router calls it awaits)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class SSEResponse(StreamingResponse):
    """Server-sent events; ``end`` runs once when the response is over, however it ends."""

    def __init__(self, body: AsyncIterator[bytes], end: Callable[[], None],
                 headers: dict[str, str]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self.end = end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Starlette's own loop runs a task group per response to notice a disconnect; one
        # watcher that cancels this task does the same for less (the stream is the hot path).
        try:
            with cancel_on_disconnect(receive):
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                async for chunk in self.body_iterator:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except ClientGone:
            pass
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self.end()


async def _until_disconnected(receive: Receive) -> None:
    # After the body is read, the next ASGI message is the disconnect (or nothing).
    while (await receive())["type"] != "http.disconnect":
        pass


@contextlib.contextmanager
def cancel_on_disconnect(receive: Receive) -> Iterator[None]:
    """Run the block; if the client goes away meanwhile, cancel it and raise ClientGone.

    One watcher task, and the block runs in the request's own task (no task per await).
    """
    task = asyncio.current_task()
    assert task is not None
    watcher = asyncio.ensure_future(_until_disconnected(receive))
    active = True

    def on_disconnect(done: asyncio.Future[None]) -> None:
        if active and not done.cancelled():
            task.cancel()

    watcher.add_done_callback(on_disconnect)
    try:
        yield
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            task.uncancel()
            raise ClientGone() from None
        raise
    finally:
        active = False
        watcher.cancel()


