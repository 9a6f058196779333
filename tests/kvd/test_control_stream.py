"""The engine's calls over one Control stream or the kvd's control socket
(libs/pdserve/kvd/control.py, services/kvd/control.py) answer as the unary rpcs do,
concurrently, and fail at once when the kvd goes. Real kvds."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdserve.kvd.client import CommitEntry, KvdClient
from pdserve.kvd.layout import BlockLayout
from pdserve.proto.v1 import common_pb2, kvd_pb2, kvd_pb2_grpc
from tests.kvd.conftest import BLOCK
from tests.kvd.test_kvd_processes import Factory, client, endpoint, refs, start, write


async def _failure(call: asyncio.Future[object] | object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        await call  # type: ignore[misc]
    return err.value.code(), err.value.details() or ""


async def test_socket_and_stream_calls_fail_exactly_as_unary_ones(kvd_factory: Factory,
                                                                redis_url: str) -> None:
    k = start(kvd_factory, redis_url)
    carriers = {}
    for name, kwargs in (("socket", {}), ("stream", {"local_control": False}),
                         ("unary", {"control_stream": False, "local_control": False})):
        carriers[name] = KvdClient(k.address, f"test-{name}", **kwargs)  # type: ignore[arg-type]
        await carriers[name].register(BlockLayout(**BLOCK))  # type: ignore[arg-type]
        assert carriers[name].control_carrier == name
    for c in carriers.values():
        pins, hashes, _ = await write(c, 1)
        got = [await _failure(c.release([123])),
               await _failure(c.commit([CommitEntry(pins[0], hashes[0], 7)])),
               await _failure(c.allocate(10_000)),
               await _failure(c.await_blocks([common_pb2.BlockRef(hash=b"x" * 3)], timeout=2))]
        if c is carriers["socket"]:
            want = got
        assert got == want
        await c.release([p.pin_id for p in pins])  # the next client gets the same slot
    assert want[0] == (grpc.StatusCode.INVALID_ARGUMENT, "pin_ids: unknown or expired pin 123")
    assert want[1][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert want[1][1].startswith("entries[0].checksum: does not match the bytes of slot")
    assert want[2][0] == grpc.StatusCode.INVALID_ARGUMENT and "num_slots" in want[2][1]
    assert want[3][0] == grpc.StatusCode.INVALID_ARGUMENT
    for c in carriers.values():
        await c.close()


@pytest.mark.parametrize("local_control", [True, False], ids=["socket", "stream"])
async def test_a_waiting_call_holds_back_nothing_and_a_lost_kvd_fails_calls_at_once(
        kvd_factory: Factory, redis_url: str, local_control: bool) -> None:
    a = start(kvd_factory, redis_url, "--fault-send-delay-ms", "5000")  # bytes come late
    b = start(kvd_factory, redis_url)
    ca = await client(a)
    cb = KvdClient(b.address, "test-b", local_control=local_control)
    await cb.register(BlockLayout(**BLOCK))  # type: ignore[arg-type]
    pins, hashes, sums = await write(ca, 1)
    await ca.commit([CommitEntry(pins[0], hashes[0], sums[0])], destination=endpoint(b))
    in_flight = refs(hashes, sums)
    waiting = asyncio.ensure_future(cb.await_blocks(in_flight, timeout=1.5))
    await asyncio.sleep(0.1)
    t = time.monotonic()
    pins = await cb.allocate(1)  # behind the Await on the same stream
    assert await cb.release([p.pin_id for p in pins]) == 1
    assert time.monotonic() - t < 0.5 and not waiting.done()
    code, _ = await _failure(waiting)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED

    waiting = asyncio.ensure_future(cb.await_blocks(in_flight, timeout=20))
    await asyncio.sleep(0.2)
    b.kill()
    t = time.monotonic()
    code, _ = await _failure(waiting)
    assert code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t < 5
    for c in (ca, cb):
        await c.close()


async def test_a_stream_without_the_credential_is_refused(kvd_factory: Factory,
                                                         redis_url: str) -> None:
    k = start(kvd_factory, redis_url, secret="s3cret")
    member = await client(k, secret="s3cret")
    assert len(await member.allocate(1)) == 1  # on the stream, with the credential
    stranger = KvdClient(k.address, "stranger")
    code, details = await _failure(stranger.allocate(1))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "x-pdserve-secret" in details
    for c in (member, stranger):
        await c.close()


async def test_a_request_naming_no_call_is_answered_with_its_error_and_the_stream_goes_on(
        kvd_factory: Factory, redis_url: str) -> None:
    k = start(kvd_factory, redis_url)
    c = await client(k)
    async with grpc.aio.insecure_channel(k.address) as channel:
        call = kvd_pb2_grpc.KvdStub(channel).Control()
        await call.write(kvd_pb2.ControlRequest(id=5))
        await call.write(kvd_pb2.ControlRequest(id=6, release=kvd_pb2.ReleaseRequest()))
        first, second = await call.read(), await call.read()
        assert (first.id, first.error.code) == (5, grpc.StatusCode.INVALID_ARGUMENT.value[0])
        assert first.error.message == ("call: one of allocate, commit, wait, release, "
                                       "transfer is required")
        assert second.id == 6 and second.WhichOneof("result") == "release"
        call.cancel()
    await c.close()
