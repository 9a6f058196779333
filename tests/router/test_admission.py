"""The router's admission queue (``services.router.admission``): bounded, priority-ordered,
per-tenant fair, with Retry-After from the measured service time; and the byte limit that
runs before tokenizing (``services.router.preparing``)."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from pdserve.errors import StatusError
from pdserve.proto.v1 import router_pb2
from services.router.admission import AdmissionQueue
from services.router.model import load_model_spec
from services.router.preparing import Preparer, check_size
from services.router.requests import RouterLimits


async def _queued(q: AdmissionQueue, order: list[str], name: str, priority: int = 0,
                  tenant: str = "", time_left: float | None = None) -> None:
    await q.acquire(priority, tenant, time_left)
    order.append(name)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_free_slots_admit_at_once_then_requests_wait() -> None:
    q = AdmissionQueue(max_running=2, max_queued=4)
    await q.acquire(0, "a", None)
    await q.acquire(0, "a", None)
    order: list[str] = []
    waiting = asyncio.create_task(_queued(q, order, "third"))
    await _settle()
    assert (q.num_running, q.num_queued, order) == (2, 1, [])
    q.release(1.0)
    await waiting
    assert (q.num_running, q.num_queued, order) == (2, 0, ["third"])


async def test_a_full_queue_refuses_with_retry_after() -> None:
    q = AdmissionQueue(max_running=1, max_queued=2, mean_service_s=3.0)
    await q.acquire(0, "", None)
    tasks = [asyncio.create_task(_queued(q, [], str(i))) for i in range(2)]
    await _settle()
    with pytest.raises(StatusError) as err:
        await q.acquire(0, "", None)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.message == ("router: admission queue full (2 requests waiting, "
                                 "--max-queued 2; 1 running, --max-concurrent 1)")
    assert err.value.retry_after == 3.0  # one service time frees a place in line
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert q.num_queued == 0


async def test_priority_goes_first_and_tenants_take_turns() -> None:
    q = AdmissionQueue(max_running=1, max_queued=10)
    await q.acquire(0, "x", None)
    order: list[str] = []
    arrivals = [("a1", 1, "a"), ("a2", 1, "a"), ("a3", 1, "a"), ("b1", 1, "b"),
                ("c1", 1, "c"), ("urgent", 0, "a")]
    tasks = []
    for name, priority, tenant in arrivals:
        tasks.append(asyncio.create_task(_queued(q, order, name, priority, tenant)))
        await _settle()
    for _ in arrivals:
        q.release(None)
        await _settle()
    await asyncio.gather(*tasks)
    # Lower priority number first; within a class one request per tenant in turn, each
    # tenant's own in arrival order (a's burst does not hold b and c back).
    assert order == ["urgent", "a1", "b1", "c1", "a2", "a3"]


async def test_a_deadline_that_cannot_be_met_is_refused_at_once() -> None:
    q = AdmissionQueue(max_running=2, max_queued=10, mean_service_s=4.0)
    await q.acquire(0, "", None)
    await q.acquire(0, "", None)
    assert q.estimated_wait(0) == 2.0 and q.estimated_wait(3) == 8.0
    with pytest.raises(StatusError) as err:
        await q.acquire(0, "", time_left=1.0)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.message == ("router: the request's deadline (1.0s left) cannot be met: "
                                 "about 2.0s of queue ahead of it")
    assert err.value.retry_after == 2.0
    assert q.num_queued == 0


async def test_a_waiter_whose_deadline_passes_leaves_the_queue() -> None:
    q = AdmissionQueue(max_running=1, max_queued=10, mean_service_s=0.01)
    await q.acquire(0, "", None)
    with pytest.raises(StatusError) as err:
        await q.acquire(0, "", time_left=0.05)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert err.value.message == ("deadline exceeded after 0.1s waiting in the router's "
                                 "admission queue")
    assert (q.num_running, q.num_queued) == (1, 0)


async def test_the_service_time_estimate_follows_finished_requests() -> None:
    q = AdmissionQueue(max_running=1, max_queued=10, mean_service_s=1.0)
    for _ in range(30):
        await q.acquire(0, "", None)
        q.release(5.0)
    assert q.mean_service_s == pytest.approx(5.0, abs=0.01)
    assert q.retry_after() == 5.0


async def test_a_cancelled_waiter_frees_its_place() -> None:
    q = AdmissionQueue(max_running=1, max_queued=10)
    await q.acquire(0, "", None)
    order: list[str] = []
    gone = asyncio.create_task(_queued(q, order, "gone"))
    kept = asyncio.create_task(_queued(q, order, "kept"))
    await _settle()
    gone.cancel()
    await _settle()
    q.release(None)
    await kept
    assert order == ["kept"] and q.num_running == 1


def _limits() -> RouterLimits:
    return RouterLimits.for_model(load_model_spec("tiny"), 0, 64)


def test_the_prompt_limit_follows_the_model_context() -> None:
    limits = _limits()
    assert limits.max_prompt_tokens == 4095  # tiny: a 4,096-token context, one to generate
    assert limits.max_prompt_bytes == 32 * 4095


def test_a_huge_prompt_is_refused_before_tokenizing() -> None:
    request = router_pb2.GenerateRequest(prompt="x" * 4_000_000)
    with pytest.raises(StatusError) as err:
        check_size(request, _limits())
    assert err.value.message == ("prompt: 4000000 bytes, above the limit of 131040 bytes "
                                 "(--max-prompt-bytes; the prompt may have at most 4095 tokens)")
    chat = router_pb2.GenerateRequest()
    chat.chat.messages.add(role="user", content="é" * 70_000)  # 2 bytes a character
    with pytest.raises(StatusError) as err:
        check_size(chat, _limits())
    assert err.value.message.startswith("chat.messages: 140000 bytes, above the limit")
    check_size(router_pb2.GenerateRequest(prompt="hello"), _limits())


async def test_a_full_tokenizer_pool_refuses_with_retry_after() -> None:
    preparer = Preparer(num_workers=1, max_pending=1)
    release = threading.Event()
    busy = asyncio.ensure_future(preparer._offload(lambda: release.wait(5)))
    await _settle()
    with pytest.raises(StatusError) as err:
        await preparer._offload(lambda: True)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.message == ("router: 1 long prompts are being tokenized (at most 1); "
                                 "try again shortly")
    assert err.value.retry_after == 1.0
    release.set()
    assert await busy is True
    assert await preparer._offload(lambda: 7) == 7  # room again
    preparer.close()
