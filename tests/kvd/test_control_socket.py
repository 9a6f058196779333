"""The kvd's control socket (services/kvd/control_socket.py): only its user and its credential
get in, a bad frame ends only its own connection, it goes with the kvd, an engine that cannot
reach it keeps the gRPC stream, and a peer kvd of the host sends its Transfers there.
Real kvd processes; the raw connections speak the frames a client would."""

from __future__ import annotations

import asyncio
import os
import stat
import struct
from pathlib import Path

import grpc
import pytest
import torch

from pdserve.kvd.client import KvdClient
from pdserve.kvd.control import LocalControl, frame, read_frame
from pdserve.kvd.layout import BlockLayout
from pdserve.proto.v1 import kvd_pb2
from services.kvd.peers import is_control_socket
from tests.kvd.conftest import BLOCK, KvdProc, common_args
from tests.kvd.test_kvd_processes import Factory, client, endpoint, entries, refs, start, write

REFUSED = "kvd control socket: ControlHello.secret: missing or wrong data credential"


async def _free_slots(c: KvdClient) -> int:
    return int((await c.stats()).slots_free)


def _connections(path: str) -> int:
    """Sockets bound or accepted at ``path`` (the listener counts one)."""
    with open("/proc/net/unix") as f:
        return sum(1 for line in f if line.rstrip().endswith(path))


async def test_the_socket_is_its_users_alone_and_goes_with_its_kvd(
        kvd_factory: Factory, redis_url: str) -> None:
    k = start(kvd_factory, redis_url)
    c = await client(k)
    path = c.info.control_socket  # type: ignore[union-attr]
    assert path.startswith("/dev/shm/pdserve-kvd-ctl-") and c.control_carrier == "socket"
    mode = os.stat(path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    await c.close()
    k.stop()
    assert not Path(path).exists()

    dead = start(kvd_factory, redis_url)  # SIGKILL leaves the file; the next kvd sweeps it
    c = await client(dead)
    path = c.info.control_socket  # type: ignore[union-attr]
    await c.close()
    dead.kill()
    assert Path(path).exists()
    start(kvd_factory, redis_url)
    assert not Path(path).exists()


@pytest.mark.parametrize("given", ["", "wrong"], ids=["missing", "wrong"])
async def test_a_connection_without_the_credential_is_refused_and_served_nothing(
        kvd_factory: Factory, redis_url: str, given: str) -> None:
    k = start(kvd_factory, redis_url, secret="s3cret")
    member = await client(k, secret="s3cret")
    path = member.info.control_socket  # type: ignore[union-attr]
    free = await _free_slots(member)

    reader, writer = await asyncio.open_unix_connection(path)
    allocate = kvd_pb2.ControlRequest(id=1, allocate=kvd_pb2.AllocateRequest(
        num_slots=1, client_id="stranger"))
    writer.write(frame(kvd_pb2.ControlHello(secret=given)) + frame(allocate))  # no waiting
    answer = await read_frame(reader, kvd_pb2.ControlResponse)
    assert answer is not None and answer.id == 0
    assert answer.error.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
    assert answer.error.message == REFUSED
    assert await read_frame(reader, kvd_pb2.ControlResponse) is None  # closed, nothing served
    writer.close()
    assert await _free_slots(member) == free

    stranger = LocalControl(path, given)  # the library's own client says the same
    with pytest.raises(grpc.RpcError) as err:
        await stranger.call("allocate", allocate.allocate, 5.0)
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, REFUSED)
    assert await _free_slots(member) == free
    assert len(await member.allocate(1)) == 1  # with the credential: served
    await member.close()


@pytest.mark.parametrize("bad", [struct.pack("!I", 1 << 30), struct.pack("!I", 3) + b"\xff" * 3,
                                 struct.pack("!I", 10) + b"short"],
                         ids=["over-the-limit", "not-a-message", "cut-short"])
async def test_a_bad_frame_closes_its_connection_only(kvd_factory: Factory, redis_url: str,
                                                      bad: bytes) -> None:
    k = start(kvd_factory, redis_url)
    member = await client(k)
    reader, writer = await asyncio.open_unix_connection(member.info.control_socket)  # type: ignore
    writer.write(frame(kvd_pb2.ControlHello()))
    hello = await read_frame(reader, kvd_pb2.ControlResponse)
    assert hello is not None and hello.WhichOneof("result") is None
    writer.write(bad)
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, no answer
    writer.close()
    pins = await member.allocate(2)  # the member's connection goes on
    assert await member.release([p.pin_id for p in pins]) == 2
    await member.close()


async def test_an_engine_that_cannot_reach_the_socket_keeps_the_grpc_stream(
        kvd_factory: Factory, redis_url: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    off = start(kvd_factory, redis_url, "--control-socket", "false")
    c = await client(off)
    assert c.info.control_socket == "" and c.control_carrier == "stream"  # type: ignore
    pins, hashes, sums = await write(c, 2)
    await c.commit(entries(pins, hashes, sums))
    await c.close()

    on = start(kvd_factory, redis_url)
    c = await client(on)
    assert c.control_carrier == "socket"
    await c._connect_local("/nonexistent/pdserve-kvd-ctl.sock")  # another container's path
    assert c.control_carrier == "stream"
    pins, hashes, sums = await write(c, 2)
    await c.commit(entries(pins, hashes, sums))

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # takes the hello, never answers

    monkeypatch.setattr("pdserve.kvd.control.HELLO_TIMEOUT", 0.2)
    mute = await asyncio.start_unix_server(silent, path=str(tmp_path / "mute.sock"))
    await c._connect_local(str(tmp_path / "mute.sock"))  # a socket that does not answer
    assert c.control_carrier == "stream"
    assert len(await c.allocate(1)) == 1
    mute.close()
    await c.close()


async def test_a_peer_kvd_of_the_host_sends_its_transfers_on_the_receivers_socket(
        kvd_factory: Factory, redis_url: str) -> None:
    a, b = start(kvd_factory, redis_url), start(kvd_factory, redis_url)
    ca = await client(a)
    cb = KvdClient(b.address, "test-b", local_control=False)  # B's socket: kvd A's alone
    await cb.register(BlockLayout(**BLOCK))  # type: ignore[arg-type]
    sock = cb.info.control_socket  # type: ignore[union-attr]

    async def push() -> None:
        pins, hashes, sums = await write(ca, 3)
        want = [ca.slot_view(p.slot).clone() for p in pins]
        await ca.commit(entries(pins, hashes, sums), destination=endpoint(b))
        got = await cb.await_blocks(refs(hashes, sums), timeout=5)
        assert all(torch.equal(cb.slot_view(p.slot), w) for p, w in zip(got, want, strict=True))
        await cb.release([p.pin_id for p in got])

    before = _connections(sock)
    await push()  # on the Control rpc; B's answer names its socket
    await push()  # on B's socket
    assert _connections(sock) == before + 1

    b.kill()  # a new B on the same address: A's next push reaches it all the same
    prefix, procs = kvd_factory
    procs.append(b2 := KvdProc(*common_args(redis_url, prefix), node_id=b.node_id, port=b.port))
    await cb.close()
    cb = KvdClient(b2.address, "test-b", local_control=False)
    await cb.register(BlockLayout(**BLOCK))  # type: ignore[arg-type]
    await push()
    await push()
    for c in (ca, cb):
        await c.close()


@pytest.mark.parametrize(("path", "accepted"), [
    ("/dev/shm/pdserve-kvd-ctl-127-0-0-1-50081-7-1796500000000", True),
    ("/tmp/listener.sock", False),                      # any path an answer may name
    ("/dev/shm/pdserve-kvd-127-0-0-1-50081-7-1", False),  # a pool segment, not a socket
    ("/dev/shm/../tmp/pdserve-kvd-ctl-x-1-2", False),
    ("/dev/shm/sub/pdserve-kvd-ctl-x-1-2", False),
    ("", False),
])
def test_a_kvd_presents_its_credential_only_at_a_kvd_control_socket(path: str,
                                                                   accepted: bool) -> None:
    assert is_control_socket(path) is accepted
