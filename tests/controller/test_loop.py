"""The control loop: monitor → predict → optimize → act, its log line and metrics; only the
lease holder acts; a failed actuation leaves the old plan in force. The Stats source here is a
canned one (this tests the loop above it; the real source is tested in test_inplace.py)."""

from __future__ import annotations

import logging
import re

import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from pdserve.controller.actuator import DryRunActuator, InPlaceActuator
from pdserve.controller.capacity import CapacityModel
from pdserve.controller.lease import RedisLease
from pdserve.controller.loop import Controller, LoopConfig
from pdserve.controller.monitor import ResourceMonitor, Sample, StatsSource
from pdserve.controller.optimizer import Cluster, Plan, Policy, Slo
from pdserve.controller.predictor import Arrival, WorkloadWindow

MODEL = CapacityModel(0.0, 1000.0, 0.010, 0.001, max_batch=40)
CONFIG = LoopConfig(interval_s=1, horizon_s=0, slo=Slo(5.0, 0.05))


class CannedStats(StatsSource):
    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples
        self.polls = 0

    async def sample(self) -> list[Sample]:
        self.polls += 1
        return self.samples


def _controller(actuator: object, source: StatsSource | None = None,
                lease: RedisLease | None = None) -> Controller:
    monitor = ResourceMonitor(source or CannedStats([]), window_s=30)
    window = WorkloadWindow(window_s=10)
    for i in range(50):  # RAG-like: 5 req/s of 1000-token prompts and 10-token answers
        window.add(Arrival(90 + i * 0.2, 1000, 10))
    cluster = Cluster(10, allow_colocated=False)
    return Controller(monitor, window, MODEL, Policy(Plan(5, 5), 0.1, 0.0), cluster,
                      actuator, CONFIG, lease)  # type: ignore[arg-type]


def _metric(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


async def test_a_tick_decides_acts_logs_and_exports(caplog: pytest.LogCaptureFixture) -> None:
    act = DryRunActuator()
    source = CannedStats([])
    ctl = _controller(act, source)
    before = _metric("pdserve_controller_decisions_total", outcome="switch") or 0.0
    with caplog.at_level(logging.INFO, logger="pdserve.controller.loop"):
        d = await ctl.tick(now=100.0)
    assert source.polls == 1
    assert d.changed and d.plan == Plan(9, 1) and act.applied == [Plan(9, 1)]
    line = next(r.getMessage() for r in caplog.records if "controller decision" in r.getMessage())
    assert re.fullmatch(r"controller decision: p=9 d=1 reason=switch: load [45]\.\d\d req/s in "
                        r"1000/10 tokens: best p=9 d=1 serves 8\.00, p=5 d=5 serves 4\.44", line)
    assert _metric("pdserve_controller_decisions_total", outcome="switch") == before + 1
    assert _metric("pdserve_controller_plan_instances", role="prefill") == 9
    assert _metric("pdserve_controller_plan_instances", role="decode") == 1
    assert _metric("pdserve_controller_predicted_rate") == pytest.approx(5.0, rel=0.1)
    d = await ctl.tick(now=101.0)
    assert not d.changed and d.reason.startswith("hold")


async def test_the_decision_line_shows_the_models_and_the_engines_prefill_rates(
        caplog: pytest.LogCaptureFixture) -> None:
    # A busy prefill engine (prompts queued) at 850 tokens/s; an idle one's 1200 and a decode
    # engine's are no measure of prefill speed. The model in use says 1000.
    def sample(iid: str, role: str, queued: int, prefill_tps: float) -> Sample:
        return Sample(iid, f"{iid}:1", 99.0, role, True, False, queued, 1, 0, 0, prefill_tps,
                      0.0, 0, 0, 0)

    source = CannedStats([sample("p", "prefill", 3, 850.0), sample("q", "prefill", 0, 1200.0),
                          sample("d", "decode", 2, 5000.0)])
    ctl = _controller(DryRunActuator(), source)
    with caplog.at_level(logging.INFO, logger="pdserve.controller.loop"):
        await ctl.tick(now=100.0)
    [record] = [r for r in caplog.records if "controller decision" in r.getMessage()]
    fields = record.fields  # type: ignore[attr-defined]
    assert (fields["model_prefill_tps"], fields["busy_prefill_tps"]) == (1000, 850)


async def test_only_the_lease_holder_acts(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    key = "pdserve-test-15:loop-lease"
    await client.set(key, "other-router", px=60_000)
    lease = RedisLease(client, key, "this-router", 60_000)
    assert not await lease.try_acquire()
    act = DryRunActuator()
    d = await _controller(act, lease=lease).tick(now=100.0)
    assert d.reason == "not the leader" and act.applied == []
    assert _metric("pdserve_controller_leader") == 0
    await client.delete(key)
    assert await lease.try_acquire()
    d = await _controller(act, lease=lease).tick(now=100.0)
    assert d.changed and act.applied == [Plan(9, 1)]
    await lease.stop()
    await client.aclose()


async def test_a_failed_actuation_keeps_the_old_plan() -> None:
    ctl = _controller(InPlaceActuator(["127.0.0.1:1"], rpc_timeout_s=0.5))
    d = await ctl.tick(now=100.0)
    assert not d.changed and d.plan == Plan(5, 5) and ctl.policy.plan == Plan(5, 5)
    assert d.reason.startswith("failed: in place: Stats failed: UNAVAILABLE")


def _busy(role: str, running: int, p_tps: float, d_tps: float) -> Sample:
    return Sample(f"{role}-{running}", "a", 0.0, role, True, False, 2, running, 10, 2, p_tps,
                  d_tps, 0, 0, 0)


async def test_the_model_is_refit_from_stats_when_they_determine_it() -> None:
    samples = [_busy("decode", 4, 0, 4 / 0.024), _busy("decode", 20, 0, 20 / 0.040),
               _busy("prefill", 1, 3000.0, 0)]
    ctl = _controller(DryRunActuator(), CannedStats(samples))
    await ctl.tick(now=100.0)
    assert ctl.model.prefill_tokens_per_s == pytest.approx(3000)
    assert ctl.model.decode_base_s == pytest.approx(0.020)
    assert ctl.model.decode_per_seq_s == pytest.approx(0.001)


class FailingOnce(StatsSource):
    """Raises on its first poll (a bug in one tick), then answers."""

    def __init__(self) -> None:
        self.polls = 0

    async def sample(self) -> list[Sample]:
        self.polls += 1
        if self.polls == 1:
            raise RuntimeError("boom")
        return []


async def test_the_loop_outlives_a_failed_tick_and_calls_its_hook(
        caplog: pytest.LogCaptureFixture) -> None:
    import asyncio

    from pdserve.controller.optimizer import Decision

    seen: list[Decision | None] = []
    source = FailingOnce()
    ctl = _controller(DryRunActuator(), source)
    ctl.config = LoopConfig(interval_s=0.05, horizon_s=0, slo=CONFIG.slo)
    ctl.on_tick = seen.append
    with caplog.at_level(logging.INFO, logger="pdserve.controller.loop"):
        ctl.start()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if len(seen) >= 3:
                break
        await ctl.stop()
    assert seen[0] is None and all(d is not None for d in seen[1:3])
    assert any(r.getMessage() == "controller tick failed" and r.exc_info for r in caplog.records)
    assert source.polls >= 3
    ctl.on_tick = lambda d: 1 / 0  # a failing hook is logged too; the tick's answer stands
    assert await ctl.run_once() is not None
    assert any(r.getMessage() == "controller on_tick hook failed" for r in caplog.records)


@pytest.mark.parametrize(("samples", "why"), [
    # decode steps of 0.5 s: one sequence past the 50 ms TPOT SLO
    ([_busy("decode", 1, 0, 1 / 0.5), _busy("decode", 2, 0, 2 / 0.6),
      _busy("prefill", 1, 3000.0, 0)], "a decode step of one sequence 0.500s > TPOT SLO 0.05s"),
    # 40 prompt tokens/s: a 1000-token prompt takes 25 s, past the 5 s TTFT SLO
    ([_busy("decode", 4, 0, 4 / 0.024), _busy("decode", 20, 0, 20 / 0.040),
      _busy("prefill", 1, 40.0, 0)], "no plan serves 1000/10 tokens within the SLOs"),
])
async def test_a_refit_under_which_nothing_serves_is_rejected(
        samples: list[Sample], why: str, caplog: pytest.LogCaptureFixture) -> None:
    # Stats of engines idle much of their window look slow; the old model stays.
    ctl = _controller(DryRunActuator(), CannedStats(samples))
    with caplog.at_level(logging.INFO, logger="pdserve.controller.loop"):
        d = await ctl.tick(now=100.0)
    assert ctl.model == MODEL and d.changed and d.plan == Plan(9, 1)
    [rejected] = [r for r in caplog.records if "model rejected" in r.getMessage()]
    assert rejected.fields["rejected"].startswith(f"refit: {why}")  # type: ignore[attr-defined]
    assert rejected.fields["using"] == "in use"  # type: ignore[attr-defined]


async def test_a_model_in_use_that_fits_no_longer_falls_back_to_the_calibration() -> None:
    # A model fitted on another mix (prefill 40 tokens/s: fine for 10-token prompts) is in use;
    # the 1000-token RAG mix arrives and the Stats determine no fit: the starting model returns.
    ctl = _controller(DryRunActuator(), CannedStats([]))
    ctl.model = CapacityModel(0.0, 40.0, 0.010, 0.001, max_batch=40)
    d = await ctl.tick(now=100.0)
    assert ctl.model == MODEL and d.changed and d.plan == Plan(9, 1)


async def test_each_tick_sizes_the_colocated_chunk_from_the_tpot_slo() -> None:
    act = DryRunActuator()
    ctl = _controller(act)
    await ctl.tick(now=100.0)
    # (50 ms TPOT - an 11 ms step of one sequence) · 1000 prompt tokens/s = 39 tokens
    assert (ctl.cluster.chunk_tokens, act.chunk_tokens) == (39, 39)
    ctl.model = CapacityModel(0.0, 200.0, 0.010, 0.001, max_batch=40)  # a slower refit
    await ctl.tick(now=100.5)
    assert ctl.cluster.chunk_tokens == 39  # sized from the calibration it started from
    ctl.config = LoopConfig(interval_s=1, horizon_s=0, slo=CONFIG.slo, chunk_tokens=64)
    await ctl.tick(now=101.0)
    assert (ctl.cluster.chunk_tokens, act.chunk_tokens) == (64, 64)  # as configured
