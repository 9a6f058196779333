"""SLO-aware admission: the TTFT prediction from queue state and the calibrated model, and
what each --slo-admission mode does with a request predicted late (refused with Retry-After,
held until it fits, refused at once when its deadline cannot be met). Instances here are the
router's own objects with their counters set by hand (nothing is called on them)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdserve.controller.capacity import CapacityModel
from pdserve.errors import StatusError
from pdserve.proto.v1 import common_pb2
from services.router.admission import AdmissionQueue
from services.router.config import RouterConfig
from services.router.instances import InstancePool
from services.router.slo_admission import SloGate, predict

MODEL = CapacityModel(0.01, 1000.0, 0.02, 0.001, max_batch=8)  # step(1) = 0.021 s


def _pool(*peaks: float) -> InstancePool:
    pool = InstancePool([f"127.0.0.1:{i + 1}" for i in range(len(peaks))], [])
    for inst, peak in zip(pool.instances.values(), peaks, strict=True):
        inst.is_healthy, inst.peak_prefill_tokens_per_s = True, peak
    return pool


async def test_prediction_adds_queue_prompts_ahead_overhead_and_a_step() -> None:
    pool = _pool(0.0, 2000.0)  # the first has not shown a rate yet: the model's (1000/s)
    a, b = pool.instances.values()
    admission = AdmissionQueue(max_running=2, max_queued=10, mean_service_s=3.0)
    p = predict(500, admission, pool, MODEL)
    assert p is not None and p.queue_s == 0.0
    assert p.prefill_s == pytest.approx(500 / 2000 + 0.01 + 0.021)
    b.num_inflight_prefill_tokens = 3500  # b: 2 s of work ahead; a: 0.5 s of its own
    p = predict(500, admission, pool, MODEL)
    assert p is not None and p.prefill_s == pytest.approx(0.5 + 0.031)
    admission.num_running = 2  # full: the next one queues behind 0 waiters
    p = predict(500, admission, pool, MODEL)
    assert p is not None and p.queue_s == pytest.approx(1.5)
    assert p.ttft_s == pytest.approx(1.5 + 0.531)
    assert "predicted time to first token 2.03s (admission queue 1.50s, prefill 0.53s)" in str(p)


async def test_no_engine_no_prediction() -> None:
    pool = _pool(1000.0)
    next(iter(pool.instances.values())).is_healthy = False
    assert predict(10, AdmissionQueue(1, 1), pool, MODEL) is None


def _gate(mode: str, pool: InstancePool, slo_s: float = 0.5, max_wait_s: float = 1.0) -> SloGate:
    return SloGate(mode, slo_s, AdmissionQueue(4, 4), pool, lambda: MODEL, max_wait_s)


async def test_reject_refuses_a_late_request_with_retry_after() -> None:
    pool = _pool(1000.0)
    assert await _gate("reject", pool).check(100, None) is not None  # 0.131 s: in
    next(iter(pool.instances.values())).num_inflight_prefill_tokens = 2900
    with pytest.raises(StatusError) as err:
        await _gate("reject", pool).check(100, None)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.retry_after == 3.0  # 3.03 s predicted, 2.53 s over: ceil
    assert str(err.value) == ("router: predicted time to first token 3.03s (admission queue "
                              "0.00s, prefill 3.03s) exceeds the TTFT SLO of 500 ms "
                              "(--slo-ttft-ms); refused (--slo-admission reject)")


async def test_queue_holds_a_late_request_until_it_fits() -> None:
    pool = _pool(1000.0)
    inst = next(iter(pool.instances.values()))
    inst.num_inflight_prefill_tokens = 2900

    async def finish_prefills() -> None:
        await asyncio.sleep(0.3)
        inst.num_inflight_prefill_tokens = 0

    start = time.monotonic()
    task = asyncio.create_task(finish_prefills())
    p = await _gate("queue", pool).check(100, None)
    await task
    assert p is not None and p.ttft_s < 0.5
    assert 0.25 <= time.monotonic() - start < 1.0


async def test_queue_refuses_after_max_wait() -> None:
    pool = _pool(1000.0)
    next(iter(pool.instances.values())).num_inflight_prefill_tokens = 2900
    with pytest.raises(StatusError, match=r"^router: held 0\.\ds \(--max-wait 0\.3s\) and still "
                                          r"predicted time to first token 3\.03s .* exceeds the "
                                          r"TTFT SLO of 500 ms \(--slo-ttft-ms\)$") as err:
        await _gate("queue", pool, max_wait_s=0.3).check(100, None)
    assert err.value.retry_after == 3.0


@pytest.mark.parametrize("mode", ["queue", "reject"])
async def test_a_deadline_that_cannot_be_met_is_refused_at_once(mode: str) -> None:
    pool = _pool(1000.0)  # 0.131 s predicted: within the SLO, not within 0.1 s
    with pytest.raises(StatusError, match=r"^router: the request's deadline \(0\.10s left\) "
                                          r"cannot be met: predicted time to first token 0\.13s"):
        await _gate(mode, pool, slo_s=5.0).check(100, 0.1)


async def test_off_predicts_nothing() -> None:
    pool = _pool(1000.0)
    next(iter(pool.instances.values())).num_inflight_prefill_tokens = 10**6
    assert await _gate("off", pool).check(100, 0.01) is None


def test_an_unknown_mode_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--slo-admission"):
        RouterConfig(prefill=("h:1",), slo_admission="late")


async def test_colocated_engines_are_predicted_when_there_is_no_prefill_engine() -> None:
    pool = InstancePool([], ["127.0.0.1:9"])
    inst = next(iter(pool.instances.values()))
    inst.role, inst.is_healthy = common_pb2.ROLE_COLOCATED, True
    p = predict(1000, AdmissionQueue(1, 1), pool, MODEL)
    assert p is not None and p.prefill_s == pytest.approx(1.0 + 0.031)
