"""Engines that take a call and then answer nothing (``services.router.health``): a paused
engine (as after SIGSTOP: no chunk, no health answer) is left after the first-answer or stall
timeout and the request goes on elsewhere, before its first token with the blocks, after it
by failing over; a slow engine that answers its health check is waited for; the health poll
takes a paused engine out at once and back when it answers again."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.router.health import STALLS
from tests.router.conftest import Cluster, request
from tests.router.fakes import FakeEngine

PROMPT = list(range(10, 10 + 16 * 3))
FAST = {"first_answer_timeout": 0.3, "stall_timeout": 0.3, "probe_timeout": 0.2}


async def _pair(cluster: Cluster, num_tokens: int = 3) -> tuple[FakeEngine, ...]:
    """A prefill and two decodes; D1 looks idle and D2 loaded, so D1 is chosen first."""
    p = await cluster.engine("P", "prefill")
    d1 = await cluster.engine("D1", "decode", num_tokens=num_tokens)
    d2 = await cluster.engine("D2", "decode", num_tokens=num_tokens)
    d2.stats.num_running = 5
    return p, d1, d2


async def _eventually(check, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_a_decode_paused_before_its_first_chunk_is_left_for_another(
        cluster: Cluster) -> None:
    p, d1, d2 = await _pair(cluster)
    router, client = await cluster.router([p], [d1, d2], **FAST)
    d1.pause()
    before = STALLS.labels("decode")._value.get()
    start = time.monotonic()
    msgs = await client.generate(ids=PROMPT, request_id="paused-1")
    took = time.monotonic() - start
    assert [m.text for m in msgs] == ["<7>", "t0", "t1", "t2"]
    assert msgs[-1].finish_reason and msgs[-1].usage.failovers == 0
    assert took < 2.0, took  # 0.3 s silent + 0.2 s probe, then D2
    assert len(d1.seen.decodes) == 1 and len(d2.seen.decodes) == 1
    handed = d2.seen.decodes[0]  # the same blocks, pulled from prefill's kvd where missing
    assert handed.first_token_id == 7 and len(handed.blocks) == len(PROMPT) // 4
    assert handed.source.node_id == "node-P"
    assert len(p.seen.prefills) == 1  # no second prefill
    assert STALLS.labels("decode")._value.get() == before + 1
    inst = router.pool.instances[d1.address]
    assert not inst.is_healthy  # out of the rotation while paused
    d1.resume()
    await _eventually(lambda: "paused-1" in d1.seen.cancelled)  # the call was cancelled
    await router.poll()
    assert inst.is_healthy  # back once it answers


async def test_a_decode_paused_mid_stream_fails_over_from_the_tokens_sent(
        cluster: Cluster) -> None:
    p, d1, d2 = await _pair(cluster, num_tokens=6)
    d1.decode_pause_after = 2  # t0, t1, then silence
    router, client = await cluster.router([p], [d1, d2], **FAST)
    msgs = await client.generate(ids=PROMPT, max_tokens=8)
    assert [m.text for m in msgs][:3] == ["<7>", "t0", "t1"]
    assert msgs[-1].usage.failovers == 1
    resumed = d2.seen.decodes[0]  # prompt + all sent but the last; the last is its first
    assert list(resumed.prompt_token_ids) == [*PROMPT, 7, 100]
    assert resumed.first_token_id == 101 and resumed.prior_output == 2
    assert list(p.seen.prefills[1].prompt_token_ids) == [*PROMPT, 7, 100]
    assert not router.pool.instances[d1.address].is_healthy
    d1.resume()


async def test_a_slow_decode_that_answers_its_health_check_is_waited_for(
        cluster: Cluster) -> None:
    p, d1, d2 = await _pair(cluster)
    d1.decode_first_delay = 1.0  # busy (waiting for KV, say) but alive: 3 probes answered
    router, client = await cluster.router([p], [d1, d2], **FAST)
    msgs = await client.generate(ids=PROMPT)
    assert [m.text for m in msgs] == ["<7>", "t0", "t1", "t2"]
    assert not d2.seen.decodes and router.pool.instances[d1.address].is_healthy


async def test_a_paused_prefill_is_left_for_another(cluster: Cluster) -> None:
    p1, p2 = await cluster.engine("P1", "prefill"), await cluster.engine("P2", "prefill")
    d = await cluster.engine("D", "decode")
    router, client = await cluster.router([p1, p2], [d], policy="round_robin", **FAST)
    p1.pause()
    p2.pause()  # whichever is chosen first is paused; the other comes back in time
    call = asyncio.create_task(client.generate(ids=PROMPT))
    await _eventually(lambda: len(p1.seen.prefills) + len(p2.seen.prefills) == 1)
    stalled, other = (p1, p2) if p1.seen.prefills else (p2, p1)
    other.resume()
    msgs = await call
    assert msgs[0].placement.prefill_instance == other.name
    assert not router.pool.instances[stalled.address].is_healthy
    stalled.resume()


async def test_the_health_poll_takes_a_paused_engine_out_at_once(cluster: Cluster) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    router, _ = await cluster.router([p], [d], health_failures=3)
    router.pool.check_timeout = 0.2
    d.pause()
    await router.poll()  # one health check unanswered: out (a busy engine would answer)
    assert not router.pool.instances[d.address].is_healthy
    d.resume()
    await router.poll()
    assert router.pool.instances[d.address].is_healthy


async def test_the_only_decode_paused_mid_stream_ends_it_with_the_reason(
        cluster: Cluster) -> None:
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    d.decode_pause_after = 1
    _, client = await cluster.router([p], [d], max_wait=0.5, **FAST)
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for message in client.stub.Generate(request(ids=PROMPT), timeout=10):
            got.append(message.text)
    d.resume()
    assert got == ["<7>", "t0"]  # what was sent stays sent
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert ("decode on D failed after 2 tokens were sent: UNAVAILABLE D sent nothing for 0.3s "
            "and did not answer a health check within 0.2s (paused or hung): call cancelled; "
            "no other decode instance is left to go on") in err.value.details()


@pytest.mark.parametrize("flag", ["first_answer_timeout", "stall_timeout", "probe_timeout"])
def test_stall_settings_must_be_positive(flag: str) -> None:
    from services.router.config import RouterConfig

    with pytest.raises(ValueError, match="--" + flag.replace("_", "-")):
        RouterConfig(prefill=("127.0.0.1:1",), decode=("127.0.0.1:2",), **{flag: 0.0})


async def test_a_restarted_prefill_serves_its_waiting_request_without_a_poll(
        cluster: Cluster) -> None:
    """The 30 s poll never runs here: the re-check of instances out of the rotation (every
    0.05 s) finds P back, and the waiting request wakes at once."""
    p, d = await cluster.engine("P", "prefill"), await cluster.engine("D", "decode")
    router, client = await cluster.router([p], [d], recheck_interval=0.05, max_wait=20)
    port = p.port
    await p.stop()
    router.pool.check_timeout = 1.0  # (it follows the 30 s poll interval: a poll of a
    await router.poll()              # stopped engine waits out its reconnect that long)
    assert not router.pool.instances[p.address].is_healthy
    call = asyncio.create_task(client.generate(ids=PROMPT, timeout=15))
    await asyncio.sleep(1.0)  # waiting for P
    assert not call.done()
    restarted = time.monotonic()
    await p.start(port)
    msgs = await call
    assert msgs[0].placement.prefill_instance == "P"
    assert time.monotonic() - restarted < 0.6  # re-check 0.05 s, a reconnect <= 0.25 s
