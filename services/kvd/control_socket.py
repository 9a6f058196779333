"""The Control stream's messages on a Unix socket next to the pool, for engines of this host.

An engine maps the kvd's pool segment, so it runs on the kvd's host and sees ``/dev/shm``; the
socket lives there too (``/dev/shm/pdserve-kvd-ctl-<node>-<pid>-<epoch>``, a name the next
kvd's sweep removes once this kvd is dead) and ``Register`` names it. The messages and their
handling are the ``Control`` rpc's (``control.answer``): the same checks, errors and spans;
only the carrier differs (length-prefixed frames, ``pdserve.kvd.control``).

Who may connect: the socket is created mode 0600, so only this kvd's user (and root) can open
it — fewer than can reach its loopback gRPC port — and when the data plane has a credential
the first frame must present it (``ControlHello``), compared in constant time as the gRPC
guard does. A connection that does not, or sends a frame that is not a message, is answered
(where it can be) and closed; nothing it sent is served.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
from pathlib import Path
from typing import Any

import grpc

from pdserve.kvd.control import HELLO_TIMEOUT, FrameError, frame, read_frame
from pdserve.proto.v1 import kvd_pb2
from services.kvd import control, segments
from services.kvd.daemon import Kvd

log = logging.getLogger(__name__)


def socket_path(node_id: str, pid: int, epoch: int, shm_dir: Path = segments.SHM_DIR) -> Path:
    return shm_dir / segments.segment_name(f"ctl-{node_id}", pid, epoch)


def refusal(given: str, secret: str) -> kvd_pb2.ControlResponse | None:
    """The answer to a hello presenting ``given``: None to go on, else the refusal."""
    if not secret or (given and hmac.compare_digest(given.encode(), secret.encode())):
        return None
    out = kvd_pb2.ControlResponse(id=0)
    out.error.code = grpc.StatusCode.UNAUTHENTICATED.value[0]
    out.error.message = ("kvd control socket: ControlHello.secret: missing or wrong data "
                         "credential")
    return out


class ControlSocket:
    def __init__(self, kvd: Kvd, path: Path, secret: str) -> None:
        self.kvd, self.path, self._secret = kvd, path, secret
        self._server: asyncio.AbstractServer | None = None
        self._connections: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}

    async def start(self) -> None:
        segments.unlink_stale(self.path.parent)  # dead kvds' sockets (and pools) go first
        old = os.umask(0o177)  # the socket file is 0600 from the moment it exists
        try:
            self._server = await asyncio.start_unix_server(self._connection, path=str(self.path))
        finally:
            os.umask(old)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._connections.values():
            writer.close()  # each connection's read then ends: its handler returns
        if self._connections:
            _, late = await asyncio.wait(set(self._connections), timeout=2.0)
            for task in late:
                task.cancel()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        answers: set[asyncio.Task[None]] = set()
        try:
            hello = await asyncio.wait_for(read_frame(reader, kvd_pb2.ControlHello),
                                           HELLO_TIMEOUT)
            if hello is None:
                return
            refused = refusal(hello.secret, self._secret)
            if refused is not None:
                log.warning("control socket: connection refused (no valid credential)")
                writer.write(frame(refused))
                return
            writer.write(frame(kvd_pb2.ControlResponse(id=0)))
            while (req := await read_frame(reader, kvd_pb2.ControlRequest)) is not None:
                now = control.answer_now(self.kvd, req)
                if now is not None:
                    writer.write(frame(now))
                    continue
                answer = asyncio.ensure_future(self._answer(req, writer))
                answers.add(answer)
                answer.add_done_callback(answers.discard)
        except (FrameError, TimeoutError, OSError) as exc:
            log.warning("control socket: connection closed",
                        extra={"fields": {"reason": f"{type(exc).__name__}: {exc}"}})
        finally:
            for answer in list(answers):  # the caller is gone: nobody reads these answers
                answer.cancel()
            await asyncio.gather(*answers, return_exceptions=True)
            writer.close()
            self._connections.pop(task, None)

    async def _answer(self, req: kvd_pb2.ControlRequest, writer: asyncio.StreamWriter) -> None:
        out = await control.answer(self.kvd, req)
        if not writer.is_closing():
            writer.write(frame(out))
