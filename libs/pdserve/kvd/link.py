"""An engine's standing link with its node's kvd: registered, and registered again at once
when the kvd restarts.

    start():  Register (map the pool) -> open a Session (the kvd's epoch comes first)
    the Session ends (the kvd died, or its server stopped)
        -> the bridge is lost: calls in flight and new ones fail with UNAVAILABLE at once
        -> Register again every ``retry_s`` until the restarted kvd answers, then a new
           Session; a different epoch means a new pool, mapped by that Register
    a call answered "no block layout registered" (a kvd restarted between two calls) marks
    the bridge lost the same way

The Session is also how the kvd learns this engine died: its stream drops with the process,
and the kvd releases the engine's pins then, not when their leases pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from pdserve.errors import StatusError
from pdserve.kvd.bridge import KvBridge

log = logging.getLogger(__name__)


class KvdLink:
    def __init__(self, bridge: KvBridge, retry_s: float = 0.2) -> None:
        self.bridge = bridge
        self.retry_s = retry_s
        self.num_registrations = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        bridge.on_lost = self._wake.set

    async def start(self) -> None:
        """Register once (errors go to the caller: an engine whose kvd is not there does not
        start), then keep the link in the background."""
        await self.bridge.register()
        self.num_registrations = 1
        log.info("registered with the kvd",
                 extra={"fields": {"kvd": self.bridge.address, "epoch": self.bridge.epoch,
                                   "control": self.bridge.client.control_carrier}})
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await self._hold_session()
            self.bridge.mark_lost("its session ended (the kvd stopped or died)")
            await self._register_again()

    async def _hold_session(self) -> None:
        """Until the Session ends, or a call finds the kvd restarted."""
        self._wake.clear()
        if not self.bridge.is_connected:
            return
        session = asyncio.ensure_future(self._follow())
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait((session, woken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            session.cancel()
            woken.cancel()

    async def _follow(self) -> None:
        try:
            async for event in self.bridge.client.session():
                if event.epoch != self.bridge.epoch:  # restarted between Register and now
                    return
        except grpc.aio.AioRpcError as exc:
            log.info("kvd session ended", extra={"fields": {"kvd": self.bridge.address,
                                                            "code": exc.code().name}})

    async def _register_again(self) -> None:
        while True:
            try:
                await self.bridge.register()
            except (StatusError, OSError, ValueError) as exc:  # not back, or mid-start
                log.debug("kvd not back yet", extra={"fields": {"error": str(exc)}})
                await asyncio.sleep(self.retry_s)
                continue
            self.num_registrations += 1
            log.info("registered with the kvd again",
                     extra={"fields": {"kvd": self.bridge.address, "epoch": self.bridge.epoch,
                                       "control": self.bridge.client.control_carrier}})
            return
