"""Resource monitor: per-instance time series of engine ``Stats`` over a sliding window, the
rates derived from them, and a sink for the router's per-request latency observations.

    StatsSource (ABC)     sample() -> one Sample per reachable instance
      GrpcStatsSource     polls ``Engine.Stats`` on each engine (data credential, deadline)
    ResourceMonitor       keeps each instance's samples of the last ``window_s`` seconds;
                          rates from the cumulative token counters (not the engine's own window)
    LatencySink           TTFT / TPOT / ITL observations → percentiles and SLO attainment
"""

from __future__ import annotations

import abc
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from pdserve import auth
from pdserve.channel import insecure_channel
from pdserve.proto.v1 import engine_pb2, engine_pb2_grpc
from pdserve.roles import Role

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    """One instance's ``Stats`` at time ``t`` (monotonic seconds)."""

    instance_id: str
    address: str
    t: float
    role: str  # "prefill", "decode", "colocated" (what it runs now)
    is_flex: bool
    draining: bool
    queue_depth: int
    num_running: int
    kv_blocks_free: int
    kv_blocks_used: int
    prefill_tokens_per_s: float  # the engine's own recent window
    decode_tokens_per_s: float
    prefill_tokens_computed: int  # cumulative
    decode_tokens: int  # cumulative
    prefix_hit_tokens: int  # cumulative


def sample_from_proto(stats: engine_pb2.EngineStats, address: str, t: float) -> Sample:
    role = Role.from_proto(stats.role)
    return Sample(stats.instance_id, address, t, str(role) if role else "unknown", stats.is_flex,
                  stats.draining, stats.queue_depth, stats.num_running, stats.kv_blocks_free,
                  stats.kv_blocks_used, stats.prefill_tokens_per_s, stats.decode_tokens_per_s,
                  stats.prefill_tokens_computed, stats.decode_tokens, stats.prefix_hit_tokens)


class StatsSource(abc.ABC):
    """Where the monitor's samples come from. ``sample`` answers one Sample per instance it
    could reach now (an unreachable one is left out and logged, never a zero sample)."""

    @abc.abstractmethod
    async def sample(self) -> list[Sample]: ...


class GrpcStatsSource(StatsSource):
    """Polls ``Engine.Stats`` on every address, each call with ``timeout_s``."""

    def __init__(self, addresses: Sequence[str], timeout_s: float = 2.0,
                 credentials: Sequence[tuple[str, str]] | None = None) -> None:
        if not addresses:
            raise ValueError("GrpcStatsSource: no engine addresses")
        creds = auth.metadata((auth.DATA,)) if credentials is None else credentials
        self.timeout_s = timeout_s
        self._channels = {a: insecure_channel(a, credentials=creds) for a in addresses}

    async def sample(self) -> list[Sample]:
        out = []
        for address, channel in self._channels.items():
            stub = engine_pb2_grpc.EngineStub(channel)
            try:
                stats = await stub.Stats(engine_pb2.EngineStatsRequest(), timeout=self.timeout_s)
            except grpc.RpcError as exc:
                log.warning("stats poll failed", extra={"fields": {
                    "address": address, "code": exc.code().name, "details": exc.details()}})
                continue
            out.append(sample_from_proto(stats, address, time.monotonic()))
        return out

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


@dataclass(frozen=True)
class Rates:
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


class ResourceMonitor:
    """The last ``window_s`` seconds of samples per instance."""

    def __init__(self, source: StatsSource, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.source = source
        self.window_s = window_s
        self.series: dict[str, deque[Sample]] = {}

    async def poll(self) -> list[Sample]:
        samples = await self.source.sample()
        for s in samples:
            self.add(s)
        return samples

    def add(self, s: Sample) -> None:
        series = self.series.setdefault(s.instance_id, deque())
        series.append(s)
        while series and series[0].t < s.t - self.window_s:
            series.popleft()

    def latest(self) -> list[Sample]:
        return [s[-1] for s in self.series.values() if s]

    def samples(self) -> list[Sample]:
        return [x for s in self.series.values() for x in s]

    def rates(self, instance_id: str) -> Rates | None:
        """Tokens/s over the window from the cumulative counters; None with < 2 samples."""
        series = self.series.get(instance_id)
        if not series or len(series) < 2 or series[-1].t <= series[0].t:
            return None
        first, last = series[0], series[-1]
        dt = last.t - first.t
        return Rates((last.prefill_tokens_computed - first.prefill_tokens_computed) / dt,
                     (last.decode_tokens - first.decode_tokens) / dt)


@dataclass(frozen=True)
class LatencySummary:
    count: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    itl_p99_s: float | None
    slo_attainment: float | None  # fraction meeting both SLOs


class LatencySink:
    """Per-request latencies observed by the router, over the last ``window_s`` seconds."""

    def __init__(self, window_s: float, ttft_slo_s: float, tpot_slo_s: float) -> None:
        self.window_s = window_s
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s
        self._obs: deque[tuple[float, float, float, float]] = deque()  # t, ttft, tpot, max itl

    def observe(self, t: float, ttft_s: float, tpot_s: float, itls_s: Sequence[float] = ()) -> None:
        self._obs.append((t, ttft_s, tpot_s, max(itls_s, default=tpot_s)))

    def summary(self, now: float) -> LatencySummary:
        while self._obs and self._obs[0][0] < now - self.window_s:
            self._obs.popleft()
        if not self._obs:
            return LatencySummary(0, None, None, None, None, None)
        a = np.array(self._obs)
        ok = (a[:, 1] <= self.ttft_slo_s) & (a[:, 2] <= self.tpot_slo_s)
        return LatencySummary(len(a), float(np.percentile(a[:, 1], 50)),
                              float(np.percentile(a[:, 1], 99)), float(np.percentile(a[:, 2], 50)),
                              float(np.percentile(a[:, 3], 99)), float(ok.mean()))
