"""``health.watched`` on its own: a timer per call, a probe only when a limit passes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from services.router.health import Stalled, StallLimits, watched

LIMITS = StallLimits(first=0.05, between=0.05, probe=0.05)


class _Health:
    def __init__(self, alive: bool) -> None:
        self.alive, self.num_checks = alive, 0

    async def Check(self, request: Any, timeout: float) -> None:  # noqa: N802
        self.num_checks += 1
        if not self.alive:
            await asyncio.sleep(timeout)
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                       grpc.aio.Metadata())


def _inst(alive: bool) -> Any:
    return SimpleNamespace(instance_id="e1", health=_Health(alive))


async def test_a_silent_call_whose_engine_answers_no_probe_is_cancelled_as_stalled() -> None:
    pending = asyncio.get_running_loop().create_future()
    with pytest.raises(Stalled, match="e1 sent nothing for 0.1s and did not answer"):
        await watched(pending, _inst(False), LIMITS, True, pending.cancel, "decode")
    assert pending.cancelled()


async def test_a_slow_call_whose_engine_answers_is_waited_for() -> None:
    loop = asyncio.get_running_loop()
    pending = loop.create_future()
    loop.call_later(0.2, pending.set_result, "chunk")
    inst = _inst(True)
    assert await watched(pending, inst, LIMITS, False, pending.cancel, "decode") == "chunk"
    assert inst.health.num_checks >= 2  # probed at each limit, never cancelled


async def test_a_caller_cancelled_gets_its_cancel_not_a_stall() -> None:
    pending = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(watched(pending, _inst(True), LIMITS, True, pending.cancel,
                                       "decode"))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pending.cancelled()


async def test_a_quick_answer_leaves_no_timer_or_probe() -> None:
    inst = _inst(True)
    pending = asyncio.get_running_loop().create_future()
    pending.set_result(1)
    assert await watched(pending, inst, LIMITS, True, pending.cancel, "prefill") == 1
    await asyncio.sleep(0.1)
    assert inst.health.num_checks == 0
