"""``--calibrate``: an engine service measures itself at start and reports it in Stats (what
the router's controller starts from); without the flag the fields stay empty."""

from __future__ import annotations

import grpc

from pdserve.proto.v1 import engine_pb2, engine_pb2_grpc
from tests.services.harness import start_services, stop_all


async def _stats(address: str) -> engine_pb2.EngineStats:
    async with grpc.aio.insecure_channel(address) as ch:
        return await engine_pb2_grpc.EngineStub(ch).Stats(engine_pb2.EngineStatsRequest(),
                                                          timeout=10)


async def test_a_calibrating_engine_reports_its_measurements() -> None:
    common = ("--model", "tiny", "--role", "colocated", "--num-blocks", "256", "--threads", "1")
    procs = start_services(("decode", *common, "--calibrate", "true"), ("decode", *common))
    try:
        measured, plain = [await _stats(p.address) for p in procs]
    finally:
        stop_all(procs)
    assert measured.measured_prefill_tokens_per_s > 0
    assert [s.batch for s in measured.measured_decode_steps] == [1, 4, 16, 32]
    assert all(s.seconds > 0 for s in measured.measured_decode_steps)
    # the measurement's own tokens are not reported as served
    assert (measured.prefill_tokens_computed, measured.decode_tokens) == (0, 0)
    assert measured.kv_blocks_used == 0
    assert plain.measured_prefill_tokens_per_s == 0 and not plain.measured_decode_steps
