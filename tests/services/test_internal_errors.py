"""The one error idiom (``pdserve.errors``): a client's mistake is INVALID_ARGUMENT naming the
field; a bug anywhere else (here injected: a plain ValueError from deep inside, as torch or
numpy raise them) is INTERNAL naming the request id, with its traceback in the log, and never
blamed on the client."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pytest

from pdserve.engine.engine import Engine
from pdserve.proto.v1 import common_pb2, engine_pb2
from services.engine.config import EngineServiceConfig
from tests.services.harness import engine, greedy, serve


def _broken_add(*args: Any, **kwargs: Any) -> None:
    raise ValueError("shape '[2, 7]' is invalid for input of size 15")


async def test_an_internal_error_in_prefill_is_internal_not_invalid_argument(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    eng = engine()
    monkeypatch.setattr(eng, "add_request", _broken_add)
    req = engine_pb2.PrefillRequest(meta=common_pb2.RequestMeta(request_id="bug-1"),
                                    prompt_token_ids=[5, 6, 7], sampling=greedy(4))
    async with serve(EngineServiceConfig(role="prefill"), eng) as p:
        with caplog.at_level(logging.ERROR), pytest.raises(grpc.aio.AioRpcError) as err:
            await p.prefill_stub.Prefill(req, timeout=10)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert err.value.details() == ("Prefill: internal error (ValueError) serving request "
                                       "bug-1; the service log has the details")
        assert p.instance is not None and p.instance.num_in_flight == 0
    record = next(r for r in caplog.records if r.getMessage() == "rpc failed with an internal "
                  "error")
    assert record.exc_info is not None and "shape '[2, 7]'" in str(record.exc_info[1])
    assert record.fields == {"rpc": "Prefill", "request_id": "bug-1"}  # type: ignore[attr-defined]


async def test_an_internal_error_in_a_decode_stream_is_internal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    eng = engine()
    monkeypatch.setattr(eng, "add_request", _broken_add)
    req = engine_pb2.DecodeRequest(meta=common_pb2.RequestMeta(request_id="bug-2"),
                                   prompt_token_ids=[5, 6, 7], sampling=greedy(4))
    async with serve(EngineServiceConfig(role="colocated"), eng) as d:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in d.decode_stub.Decode(req, timeout=10):
                pass
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "request bug-2" in (err.value.details() or "")
        stats = await d.stats()
        assert (stats.queue_depth, stats.num_running, stats.kv_blocks_used) == (0, 0, 0)


async def test_the_engines_own_validation_is_still_invalid_argument() -> None:
    """The engine's BadRequest (a ValueError too, for offline callers) keeps its code."""
    eng: Engine = engine()
    req = engine_pb2.PrefillRequest(meta=common_pb2.RequestMeta(request_id="bad-salt"),
                                    prompt_token_ids=[5, 6, 7], sampling=greedy(4))
    req.meta.priority = 1
    async with serve(EngineServiceConfig(role="prefill"), eng) as p:
        req.sampling.top_p = 2.0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await p.prefill_stub.Prefill(req, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "sampling.top_p must be in (0, 1], got 2.0"
