"""The Redis instance registry, and the router discovering engines through it."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from pdserve.registry import (
    InstanceRecord,
    deregister_instance,
    heartbeat_task,
    list_instances,
    register_instance,
)
from tests.router.conftest import Cluster


def record(name: str, role: str = "prefill", port: int = 5000) -> InstanceRecord:
    return InstanceRecord(name, role, f"127.0.0.1:{port}", kvd_node_id=f"node-{name}",
                          kvd_address="127.0.0.1:6000", model="tiny")


async def test_register_list_expire(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    await register_instance(r, record("b", "decode", 5001), ttl=10)
    await register_instance(r, record("a"), ttl=0.3)
    await register_instance(r, record("other"), ttl=10, prefix="elsewhere:")
    assert await list_instances(r) == [record("a"), record("b", "decode", 5001)]
    await asyncio.sleep(0.5)
    assert await list_instances(r) == [record("b", "decode", 5001)]
    await deregister_instance(r, "b")
    assert await list_instances(r) == []
    assert await list_instances(r, prefix="elsewhere:") == [record("other")]
    await r.aclose()


async def test_malformed_records_are_skipped(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    await r.set("pdserve:instance:junk", b"not json")
    await r.set("pdserve:instance:bad-role", b'{"instance_id": "x", "role": "boss", '
                                               b'"address": "h:1"}')
    await register_instance(r, record("ok"), ttl=10)
    assert [x.instance_id for x in await list_instances(r)] == ["ok"]
    await r.aclose()


async def test_heartbeat_keeps_the_record_and_removes_it_on_cancel(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    task = asyncio.create_task(heartbeat_task(r, record("hb"), ttl=0.3, interval=0.05))
    await asyncio.sleep(0.6)  # twice the TTL: only the heartbeat keeps it alive
    assert [x.instance_id for x in await list_instances(r)] == ["hb"]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert await list_instances(r) == []
    await r.aclose()


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"instance_id": ""}, "instance_id"),
    ({"role": "boss"}, "role"),
    ({"address": "nohost"}, "address"),
    ({"kvd_address": "x:99999"}, "kvd_address"),
    ({"block_size": 0}, "block_size"),
])
def test_record_validation_names_the_field(kwargs: dict, needle: str) -> None:
    base = {"instance_id": "a", "role": "prefill", "address": "h:1"}
    with pytest.raises(ValueError, match=needle):
        InstanceRecord(**{**base, **kwargs})


def test_heartbeat_interval_must_be_below_ttl() -> None:
    with pytest.raises(ValueError, match="interval"):
        asyncio.run(heartbeat_task(None, record("x"), ttl=1.0, interval=2.0))


async def test_router_discovers_registered_engines(cluster: Cluster, redis_url: str) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    r = aioredis.Redis.from_url(redis_url)
    await register_instance(r, InstanceRecord("P", "prefill", p.address, "node-P"), ttl=10)
    await register_instance(r, InstanceRecord("D", "decode", d.address, "node-D"), ttl=0.5)
    router, client = await cluster.router(redis_url=redis_url)
    msgs = await client.generate(ids=list(range(40)))
    assert (msgs[0].placement.prefill_instance, msgs[0].placement.decode_instance) == ("P", "D")
    await asyncio.sleep(0.7)  # D's heartbeat stopped: it expires and leaves the rotation
    await router.poll()
    assert [i.instance_id for i in router.cluster_state().instances] == ["P"]
    await r.aclose()
