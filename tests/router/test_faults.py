"""Retries, deadlines, cancellation, quotas, unhealthy instances and Redis outages."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import grpc
import pytest

from pdserve import telemetry
from pdserve.hashing import hash_blocks
from pdserve.index import IndexUnavailable, NodeRecord, RedisPrefixIndex
from pdserve.proto.v1 import common_pb2
from services.router import metrics
from tests.conftest import RedisServer, free_port
from tests.router.conftest import Cluster, request

PROMPT = list(range(10, 10 + 16 * 3))


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.FAILED_PRECONDITION])
async def test_prefill_failure_moves_to_another_instance(cluster: Cluster, code) -> None:
    a, b = await cluster.engine("A", "prefill"), await cluster.engine("B", "prefill")
    d = await cluster.engine("D", "decode")
    a.prefill_errors = [code]
    router, client = await cluster.router([a, b], [d], policy="round_robin")
    msgs = await client.generate(ids=PROMPT)
    assert msgs[0].placement.prefill_instance == "B"
    assert len(a.seen.prefills) == 1 and len(b.seen.prefills) == 1
    by_id = {i.instance_id: i for i in router.pool.instances.values()}
    assert by_id["A"].num_errors == 1
    # Busy is not down; down or in another role takes A out of the rotation until a poll.
    assert by_id["A"].is_healthy == (code == grpc.StatusCode.RESOURCE_EXHAUSTED)
    await router.poll()
    assert by_id["A"].is_healthy


async def test_busy_prefills_are_waited_for_not_relayed(cluster: Cluster) -> None:
    engines = [await cluster.engine(n, "prefill") for n in "ABC"]
    d = await cluster.engine("D", "decode")
    for e in engines:
        e.prefill_errors = [grpc.StatusCode.RESOURCE_EXHAUSTED]
    _, client = await cluster.router(engines, [d], max_retries=1)
    msgs = await client.generate(ids=PROMPT)  # busy everywhere at first: waited, then served
    assert [list(m.token_ids) for m in msgs] == [[7], [100], [101], [102]]
    assert sum(len(e.seen.prefills) for e in engines) == 3  # one try + one retry, then one


async def test_engines_busy_past_max_wait_answer_retry_after(cluster: Cluster) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    p.prefill_errors = [grpc.StatusCode.RESOURCE_EXHAUSTED] * 1000
    _, client = await cluster.router([p], [d], max_retries=0, max_wait=0.3)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.generate(ids=PROMPT)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "every prefill instance is busy" in err.value.details()
    assert "still busy after waiting" in err.value.details()
    assert dict(err.value.trailing_metadata() or ())["retry-after"] == "1"
    assert 2 <= len(p.seen.prefills) < 20  # retried with backoff, not spun


async def test_engine_invalid_argument_is_not_retried(cluster: Cluster) -> None:
    a, b = await cluster.engine("A", "prefill"), await cluster.engine("B", "prefill")
    d = await cluster.engine("D", "decode")
    a.prefill_errors = b.prefill_errors = [grpc.StatusCode.INVALID_ARGUMENT]
    _, client = await cluster.router([a, b], [d])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.generate(ids=PROMPT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(a.seen.prefills) + len(b.seen.prefills) == 1


async def test_decode_failing_before_its_first_token_is_retried(cluster: Cluster) -> None:
    p = await cluster.engine("P", "prefill")
    d1, d2 = await cluster.engine("D1", "decode"), await cluster.engine("D2", "decode")
    d1.decode_errors = [grpc.StatusCode.UNAVAILABLE]
    _, client = await cluster.router([p], [d1, d2], policy="round_robin")
    msgs = await client.generate(ids=PROMPT)
    assert [list(m.token_ids) for m in msgs] == [[7], [100], [101], [102]]
    assert msgs[0].placement.decode_instance == "D1"  # where prefill pushed
    retry = d2.seen.decodes[0]
    assert retry.first_token_id == 7 and len(retry.blocks) == 12
    assert retry.source.node_id == "node-P"  # the new decode pulls from prefill's kvd


@pytest.mark.parametrize("code", [grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND,
                                  grpc.StatusCode.DATA_LOSS])
async def test_decode_without_its_kv_is_prefilled_again_elsewhere(cluster: Cluster,
                                                                 code) -> None:
    """The decode's kvd could not get the blocks (their source partitioned or lost: ABORTED):
    another prefill computes them again; the client keeps the first token it already has."""
    a = await cluster.engine("A", "prefill", first_token=7)
    b = await cluster.engine("B", "prefill", first_token=9)
    d = await cluster.engine("D", "decode")
    d.decode_errors = [code]
    router, client = await cluster.router([a, b], [d], policy="round_robin")
    msgs = await client.generate(ids=PROMPT)
    assert [list(m.token_ids) for m in msgs] == [[7], [100], [101], [102]]
    assert len(a.seen.prefills) == 1 and len(b.seen.prefills) == 1
    first, second = d.seen.decodes
    assert first.source.node_id == "node-A" and second.source.node_id == "node-B"
    assert second.first_token_id == 7  # the token already sent, not B's own
    by_id = {i.instance_id: i for i in router.pool.instances.values()}
    assert by_id["D"].is_healthy and by_id["D"].num_errors == 0  # the KV was lost, not D


async def test_kv_lost_twice_is_a_clear_error(cluster: Cluster) -> None:
    a, b = await cluster.engine("A", "prefill"), await cluster.engine("B", "prefill")
    d = await cluster.engine("D", "decode")
    d.decode_errors = [grpc.StatusCode.ABORTED, grpc.StatusCode.ABORTED]
    _, client = await cluster.router([a, b], [d], policy="round_robin")
    call = client.stub.Generate(request(ids=PROMPT), timeout=10)
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for m in call:
            got.append(list(m.token_ids))
    assert got == [[7]]
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "decode on D could not get the request's KV blocks" in err.value.details()
    assert len(d.seen.decodes) == 2


async def test_decode_failing_after_tokens_gives_them_and_a_clear_error(cluster: Cluster) -> None:
    p = await cluster.engine("P", "prefill")
    d1 = await cluster.engine("D1", "decode")
    d1.decode_fail_after = 1
    _, client = await cluster.router([p], [d1], policy="round_robin")
    call = client.stub.Generate(request(ids=PROMPT), timeout=10)
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for m in call:
            got.append(list(m.token_ids))
    assert got == [[7], [100]]
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "decode on D1 failed after 2 tokens" in err.value.details()
    assert "no other decode instance is left to go on" in err.value.details()
    assert len(p.seen.prefills) == 1  # no other decode: nothing computed again


async def test_deadline_reaches_every_engine_call(cluster: Cluster) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    _, client = await cluster.router([p], [d])
    await client.generate(ids=PROMPT, timeout=4.0)
    for remaining in (p.seen.time_remaining[0], d.seen.time_remaining[0]):
        # gRPC sends timeouts rounded up to its wire units: a few ms over is the same deadline.
        assert remaining is not None and 2.0 < remaining <= 4.05
    p.prefill_hang = True
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.generate(ids=PROMPT, timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await _eventually(lambda: len(p.seen.cancelled) == 1)


async def test_client_cancel_reaches_the_engine(cluster: Cluster) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    d.decode_hang = True
    _, client = await cluster.router([p], [d])
    call = client.stub.Generate(request(ids=PROMPT, request_id="gone"), timeout=10)
    it = call.__aiter__()
    assert list((await it.__anext__()).token_ids) == [7]
    assert list((await it.__anext__()).token_ids) == [100]
    call.cancel()
    await _eventually(lambda: d.seen.cancelled == ["gone"] and d.seen.aborts == ["gone"])
    assert p.seen.aborts == []  # prefill was done: nothing of the request left there


async def test_tenant_quotas_answer_resource_exhausted_with_retry_after(
        cluster: Cluster, tmp_path: Path) -> None:
    quotas = tmp_path / "quotas.json"
    quotas.write_text(json.dumps({"tenants": {"small": {"tokens_per_minute": 60 * 20,
                                                        "burst_tokens": 100}}}))
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    _, client = await cluster.router([p], [d], quotas_file=str(quotas))
    await client.generate(ids=[1] * 50, max_tokens=40, tenant="small")  # charged 90, refunded 36
    call = client.stub.Generate(request(ids=[1] * 50, max_tokens=40, tenant="small"), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _ = [m async for m in call]
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "small" in err.value.details()
    trailers = dict(err.value.trailing_metadata() or ())
    assert 1 <= int(trailers["retry-after"]) <= 3
    await client.generate(ids=[1] * 50, max_tokens=40, tenant="other")  # not limited
    assert len(p.seen.prefills) == 2


async def test_unhealthy_instance_leaves_and_returns(cluster: Cluster) -> None:
    a, b = await cluster.engine("A", "prefill"), await cluster.engine("B", "prefill")
    d = await cluster.engine("D", "decode")
    router, client = await cluster.router([a, b], [d], policy="round_robin")
    router.pool.check_timeout = 0.5  # a stopped engine's check: out in 0.5 s, not 30
    port = b.port
    await b.stop()
    await router.poll()
    assert {(i.instance_id, i.healthy) for i in router.cluster_state().instances} == {
        ("A", True), ("B", False), ("D", True)}
    for _ in range(3):
        assert (await client.generate(ids=PROMPT))[0].placement.prefill_instance == "A"
    await b.start(port)
    deadline = time.monotonic() + 10  # polls (and the recheck loop) wait out gRPC's reconnect
    while not {i.instance_id for i in router.cluster_state().instances if i.healthy} >= {"B"}:
        assert time.monotonic() < deadline, "B did not return within 10 s of its restart"
        await router.poll()
        await asyncio.sleep(0.1)
    placements = {(await client.generate(ids=PROMPT))[0].placement.prefill_instance
                  for _ in range(2)}
    assert placements == {"A", "B"}


async def test_draining_instance_leaves_the_rotation(cluster: Cluster) -> None:
    a, b = await cluster.engine("A", "prefill"), await cluster.engine("B", "prefill")
    d = await cluster.engine("D", "decode")
    b.stats.draining = True
    _, client = await cluster.router([a, b], [d], policy="round_robin")
    for _ in range(2):
        assert (await client.generate(ids=PROMPT))[0].placement.prefill_instance == "A"


async def test_redis_down_routes_by_load_and_recovers(cluster: Cluster) -> None:
    redis = RedisServer(free_port())
    redis.start()
    try:
        a, b = await cluster.engine("A", "prefill"), await cluster.engine("B", "prefill")
        d = await cluster.engine("D", "decode")
        hashes = hash_blocks(PROMPT, 16, cluster.spec.fingerprint)
        # The real index, as kvd B fills it; the router builds its own from --redis-url.
        kvd_b = RedisPrefixIndex(redis.url)

        async def kvd_b_announces() -> None:
            await kvd_b.register_node(NodeRecord("node-B", "127.0.0.1:1", b"", 64, 1), ttl=60)
            await kvd_b.add("node-B", hashes)

        await kvd_b_announces()
        router, client = await cluster.router([a, b], [d], redis_url=redis.url)
        assert (await client.generate(ids=PROMPT))[0].placement.prefill_instance == "B"
        redis.stop()
        got = [(await client.generate(ids=PROMPT))[0].placement for _ in range(4)]
        assert {pl.prefill_instance for pl in got} == {"A", "B"}  # load only: spread
        assert all(pl.cached_blocks == 0 for pl in got)
        assert not router.cluster_state().index_available
        assert metrics.INDEX_AVAILABLE._value.get() == 0
        await router.poll()  # registry and index unreachable: the instances stay
        assert len(router.pool.healthy(common_pb2.ROLE_PREFILL)) == 2
        redis.start()
        # Each client's first call after the restart may meet a pooled dead connection;
        # the next one reconnects (kvd and router both retry on their next beat or poll).
        with contextlib.suppress(IndexUnavailable):
            await kvd_b_announces()
        await kvd_b_announces()  # kvd B re-announces what it holds
        for _ in range(3):
            await router.poll()
            if router.cluster_state().index_available:
                break
        assert router.cluster_state().index_available
        assert metrics.INDEX_AVAILABLE._value.get() == 1
        placement = (await client.generate(ids=PROMPT))[0].placement
        assert (placement.prefill_instance, placement.cached_blocks) == ("B", 3)
        await kvd_b.close()
    finally:
        redis.stop()


async def test_traceparent_reaches_the_engines(cluster: Cluster) -> None:
    telemetry.init_tracing("router-test")
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    _, client = await cluster.router([p], [d])
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    await client.generate(ids=PROMPT, metadata=(("traceparent", parent),))
    for md in (p.seen.metadata[0], d.seen.metadata[0]):
        version, trace_id, span_id, _ = md["traceparent"].split("-")
        assert trace_id == "0af7651916cd43dd8448eb211c80319c"  # same trace, the router's span
        assert span_id != "b7ad6b7169203331"


async def test_request_metrics_count_codes(cluster: Cluster) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    _, client = await cluster.router([p], [d])
    ok, bad = metrics.REQUESTS.labels("OK"), metrics.REQUESTS.labels("INVALID_ARGUMENT")
    ok0, bad0 = ok._value.get(), bad._value.get()
    await client.generate(ids=PROMPT)
    with pytest.raises(grpc.aio.AioRpcError):
        await client.generate(ids=PROMPT, max_tokens=10**6)
    assert (ok._value.get() - ok0, bad._value.get() - bad0) == (1, 1)


async def _eventually(predicate, timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def test_router_concurrency_limit_answers_retry_after(cluster: Cluster) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    d.decode_hang = True
    _, client = await cluster.router([p], [d], max_concurrent=1, max_queued=0)
    held = client.stub.Generate(request(ids=PROMPT), timeout=10)
    it = held.__aiter__()
    await it.__anext__()  # the first request is in flight
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.generate(ids=PROMPT)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-concurrent 1" in err.value.details()
    assert dict(err.value.trailing_metadata() or ())["retry-after"] == "1"
    held.cancel()
    await _eventually(lambda: d.seen.cancelled != [])
    d.decode_hang = False
    assert len(await client.generate(ids=PROMPT)) == 4  # the slot came back


async def test_failed_request_gets_its_quota_back(cluster: Cluster, tmp_path: Path) -> None:
    quotas = tmp_path / "quotas.json"
    quotas.write_text(json.dumps({"default": {"tokens_per_minute": 60, "burst_tokens": 100}}))
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    p.prefill_errors = [grpc.StatusCode.INVALID_ARGUMENT]
    _, client = await cluster.router([p], [d], quotas_file=str(quotas))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.generate(ids=[1] * 50, max_tokens=40)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await client.generate(ids=[1] * 50, max_tokens=40)  # 90 of 100 again: nothing was kept


async def test_a_router_bug_is_internal_with_the_request_id(cluster: Cluster) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    router, client = await cluster.router([p], [d])

    def broken(*args: object) -> None:
        raise ZeroDivisionError("float division by zero")

    router.policy.choose = broken  # type: ignore[method-assign]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.generate(ids=PROMPT, request_id="route-bug")
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert err.value.details() == ("Generate: internal error (ZeroDivisionError) serving request "
                                   "route-bug; the service log has the details")
    assert router.num_in_flight == 0 and not p.seen.prefills


async def test_requests_beyond_max_concurrent_wait_their_turn(cluster: Cluster) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    d.decode_hang = True
    router, client = await cluster.router([p], [d], max_concurrent=1)
    held = client.stub.Generate(request(ids=PROMPT), timeout=10)
    it = held.__aiter__()
    await it.__anext__()
    await it.__anext__()  # the first request holds the only slot, hanging in its decode
    d.decode_hang = False
    waiting = asyncio.create_task(client.generate(ids=PROMPT))
    await _eventually(lambda: router.admission.num_queued == 1)
    assert len(p.seen.prefills) == 1  # queued in the router: no engine work yet
    held.cancel()
    assert len(await waiting) == 4  # admitted when the slot came back
    assert router.admission.num_queued == 0


async def test_a_busy_engine_stays_in_rotation_until_several_checks_time_out(
        cluster: Cluster) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    router, client = await cluster.router([p], [d], health_failures=3)
    router.pool.check_timeout = 0.2
    d.stats_delay = 0.5  # connected, answering, but slower than a check may take
    for _ in range(2):
        await router.poll()
        assert router.pool.instances[d.address].is_healthy  # busy, not dead
    assert len(await client.generate(ids=PROMPT)) == 4
    await router.poll()  # the third timeout in a row: out
    assert not router.pool.instances[d.address].is_healthy
    d.stats_delay = 0.0
    await router.poll()
    assert router.pool.instances[d.address].is_healthy


async def test_a_request_waits_for_the_only_prefill_to_come_back(cluster: Cluster) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    router, client = await cluster.router([p], [d], poll_interval=0.1, max_wait=20)
    port = p.port
    await p.stop()  # restarting: down for a while, known to the router
    await router.poll()
    restart = asyncio.create_task(asyncio.sleep(1.0))
    restart.add_done_callback(lambda _: asyncio.ensure_future(p.start(port)))
    msgs = await client.generate(ids=PROMPT, timeout=15)
    assert msgs[0].placement.prefill_instance == "P"  # served once P was back
    assert restart.done()


async def test_a_prefill_down_past_max_wait_fails_with_the_wait(cluster: Cluster) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    _, client = await cluster.router([p], [d], max_wait=0.5)
    await p.stop()  # the first prefill call finds it down
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.generate(ids=PROMPT)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no capacity" in err.value.details()
    assert "none came back within" in err.value.details()
