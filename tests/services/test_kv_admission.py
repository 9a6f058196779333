"""Watermark KV admission on a decode instance (``services.decode.decode.KvAdmission``): a
prefilled request waits for room in a real engine's cache instead of failing at once."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.errors import StatusError
from services.decode.decode import kv_admission
from services.engine.config import EngineServiceConfig
from tests.services.harness import engine, serve


async def test_a_request_waits_for_room_and_promises_do_not_overcommit() -> None:
    async with serve(EngineServiceConfig(role="decode", num_blocks=8), engine("tiny", 8)) as d:
        inst = d.instance
        assert inst is not None
        admission = kv_admission(inst)
        await admission.admit(inst, 6, timeout=1.0)  # 6 of the 8 free blocks promised
        with pytest.raises(StatusError) as err:
            await admission.admit(inst, 3, timeout=0.2)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.message == ("KV cache: 8 free blocks (6 promised), this request "
                                     "needs 3; none freed within 0.2s")
        waiting = asyncio.create_task(admission.admit(inst, 3, timeout=5.0))
        await asyncio.sleep(0.1)
        assert not waiting.done() and admission.num_waiting == 1
        admission.settle(6)  # the first request runs: its pages are the engine's now
        await asyncio.wait_for(waiting, 2.0)
        assert admission.num_promised == 3
        admission.settle(3)


async def test_a_request_larger_than_the_cache_fails_at_once() -> None:
    async with serve(EngineServiceConfig(role="decode", num_blocks=8), engine("tiny", 8)) as d:
        assert d.instance is not None
        with pytest.raises(StatusError) as err:
            await kv_admission(d.instance).admit(d.instance, 9, timeout=5.0)
        assert err.value.message == ("KV cache: this request needs 9 blocks to start, more "
                                     "than the 8 the cache has")
