"""A kvd and its engines recovering from each other's death, with real kvd processes: pins of
a dead client go when its session drops, a killed kvd's pool segment is removed by the next kvd
(never a live one's), and an engine registers again with a restarted kvd by itself."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from pdserve.engine.async_engine import AsyncEngine
from pdserve.errors import StatusError
from pdserve.kvd.bridge import KvBridge
from pdserve.kvd.client import KvdClient
from pdserve.kvd.link import KvdLink
from services.kvd import segments
from tests.kvd.conftest import KvdProc
from tests.kvd.test_kvd_processes import Factory, client, eventually, pinning_client, start
from tests.services.harness import engine

_SESSION_CLIENT = """
import asyncio, sys
from pdserve.kvd.client import KvdClient
from pdserve.kvd.layout import BlockLayout
async def main():
    c = KvdClient(sys.argv[1], "doomed")
    await c.register(BlockLayout(2, 16, 2, 16, "float16"))
    session = c.session()
    await session.__anext__()
    pins = await c.allocate(5)  # the kvd's default lease: 30 s
    print(len(pins), flush=True)
    await asyncio.sleep(60)
asyncio.run(main())
"""


async def test_a_dead_clients_pins_go_when_its_session_drops(kvd_factory: Factory,
                                                           redis_url: str) -> None:
    b = start(kvd_factory, redis_url)
    cb = await client(b)
    proc = await pinning_client(_SESSION_CLIENT, b.address, cb)
    try:
        proc.kill()
        proc.wait(timeout=10)
        killed = time.monotonic()

        async def released() -> bool:
            s = await cb.stats()
            return s.slots_pinned == 0 and s.slots_free == s.num_slots

        await eventually(released, timeout=2.0)
        assert time.monotonic() - killed < 2.0
        assert (await cb.stats()).num_lease_expiries == 0  # released, not expired
    finally:
        proc.kill()
    await cb.close()


async def test_a_session_needs_a_client_id(kvd_factory: Factory, redis_url: str) -> None:
    c = KvdClient(start(kvd_factory, redis_url).address, "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.session().__anext__()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "client_id: required" in (err.value.details() or "")
    await c.close()


def test_segment_names_carry_the_creators_pid() -> None:
    name = segments.segment_name("node/p0", 4242, 17)
    assert name == "pdserve-kvd-node-p0-4242-17"
    assert segments.owner_pid(name) == 4242
    assert segments.owner_pid("pdserve-kvd-node-p0-17") is None  # an old-style name: kept


async def test_a_killed_kvds_segment_goes_a_live_ones_stays(kvd_factory: Factory,
                                                           redis_url: str) -> None:
    shared = ("--capacity-mib", "1")
    doomed = start(kvd_factory, redis_url, *shared, node_id="node-shared")
    alive = start(kvd_factory, redis_url, *shared, node_id="node-shared")
    c_doomed, c_alive = await client(doomed), await client(alive)
    assert c_doomed.info is not None and c_alive.info is not None
    dead_seg = segments.SHM_DIR / c_doomed.info.shm_name
    live_seg = segments.SHM_DIR / c_alive.info.shm_name
    await c_doomed.close()
    doomed.kill()
    assert dead_seg.exists()  # SIGKILL: nobody unlinked it
    third = start(kvd_factory, redis_url, *shared, node_id="node-shared")
    c_third = await client(third)  # the pool is created at the first Register
    assert not dead_seg.exists()
    assert live_seg.exists()
    assert (await c_alive.stats()).num_slots > 0  # and still serves
    for c in (c_alive, c_third):
        await c.close()


async def test_an_engine_registers_again_with_a_restarted_kvd(kvd_factory: Factory,
                                                            redis_url: str) -> None:
    kvd = start(kvd_factory, redis_url)
    aengine = AsyncEngine(engine())
    aengine.start()
    bridge = KvBridge(aengine, KvdClient(kvd.address, "engine-t"), kvd.address)
    link = KvdLink(bridge, retry_s=0.1)
    await link.start()
    first_epoch = bridge.epoch
    assert bridge.client.info is not None and bridge.client.control_carrier == "socket"
    first_socket = bridge.client.info.control_socket
    try:
        assert await bridge.load_prefix([b"\1" * 32], 1.0) == []
        kvd.kill()
        await eventually(_lost(bridge), timeout=2.0)
        started = time.monotonic()
        with pytest.raises(StatusError) as err:  # fails at once, retryable, names the kvd
            await bridge.load_prefix([b"\1" * 32], 5.0)
        assert time.monotonic() - started < 1.0
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert f"kvd {kvd.address}:" in err.value.message
        assert "registering with it again" in err.value.message
        restarted = KvdProc(*kvd_args(kvd), node_id=kvd.node_id, port=kvd.port)
        kvd_factory[1].append(restarted)
        back = time.monotonic()
        await eventually(_connected(bridge), timeout=5.0)
        assert time.monotonic() - back < 3.0
        assert link.num_registrations == 2 and bridge.epoch > first_epoch
        assert await bridge.load_prefix([b"\1" * 32], 1.0) == []
        assert bridge.client.info is not None
        assert Path(segments.SHM_DIR / bridge.client.info.shm_name).exists()
        # the calls go on the restarted kvd's own socket (the old one was swept)
        assert bridge.client.info.control_socket != first_socket
        assert bridge.client.control_carrier == "socket"
        assert not Path(first_socket).exists()
        pins = await bridge.client.allocate(1)
        assert await bridge.client.release([p.pin_id for p in pins]) == 1
    finally:
        await link.stop()
        await bridge.client.close()
        await aengine.close()


def kvd_args(p: KvdProc) -> list[str]:
    """The flags ``p`` was started with (after ``--node-id <id>``)."""
    argv = [str(a) for a in p.proc.args]  # type: ignore[union-attr]
    return argv[argv.index("--node-id") + 2:]


def _lost(bridge: KvBridge):  # type: ignore[no-untyped-def]
    async def check() -> bool:
        return not bridge.is_connected
    return check


def _connected(bridge: KvBridge):  # type: ignore[no-untyped-def]
    async def check() -> bool:
        await asyncio.sleep(0)
        return bridge.is_connected
    return check
