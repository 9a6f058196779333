"""Prometheus metrics of the engine services (served on ``--metrics-port``), every series
labelled with the instance, its role and its model.

Counters and histograms count what the rpcs do; the gauges (queue, running batch, KV blocks)
are read at scrape time from the engine's latest step (``EngineCollector``). One engine per
process: ``bind`` names it once, at start.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import grpc
from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

WHO = ["instance", "role", "model"]
REQUESTS = Counter("pdserve_engine_requests_total", "Requests handled, by rpc and outcome "
                   "(ok or a gRPC status name)", [*WHO, "rpc", "outcome"])
TOKENS = Counter("pdserve_engine_tokens_total", "Tokens by kind: prompt (computed), cached "
                 "(prompt tokens served from KV blocks), generated", [*WHO, "kind"])
BLOCKS = Counter("pdserve_engine_kv_blocks_total", "KV blocks moved through the kvd, by "
                 "direction (exported, imported)", [*WHO, "direction"])
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
PREFILL_SECONDS = Histogram("pdserve_prefill_seconds", "Prefill rpc duration", WHO,
                            buckets=_BUCKETS)
KV_WAIT_SECONDS = Histogram("pdserve_decode_kv_wait_seconds", "Decode: waiting for and "
                            "importing the prompt's KV blocks", WHO, buckets=_BUCKETS)
TOKEN_GAP_SECONDS = Histogram("pdserve_decode_inter_token_seconds", "Decode: time between "
                              "streamed tokens", WHO, buckets=_BUCKETS)


class Engine(Protocol):
    """What the metrics read of an ``EngineInstance``."""

    @property
    def instance_id(self) -> str: ...

    role: Any
    config: Any
    aengine: Any


_bound: Engine | None = None


def bind(instance: Engine) -> EngineCollector:
    """Label this process's series with ``instance``; returns its (registered) collector."""
    global _bound
    _bound = instance
    collector = EngineCollector(instance)
    REGISTRY.register(collector)  # type: ignore[arg-type]
    return collector


def who() -> tuple[str, str, str]:
    if _bound is None:
        return "", "", ""
    return _bound.instance_id, str(_bound.role), _bound.config.model


def count(metric: Counter, *labels: str, amount: float = 1) -> None:
    metric.labels(*who(), *labels).inc(amount)


def observe(metric: Histogram, seconds: float) -> None:
    metric.labels(*who()).observe(seconds)


def count_rpc(rpc: str, code: grpc.StatusCode) -> None:
    """``rpc_handler``'s hook: one count per Prefill/Decode call and its final status."""
    count(REQUESTS, rpc, "ok" if code == grpc.StatusCode.OK else code.name)


_GAUGES = (  # (name, help, EngineStats field)
    ("pdserve_engine_requests_waiting", "Requests queued, not yet scheduled", "num_waiting"),
    ("pdserve_engine_requests_running", "Sequences in the running batch", "num_running"),
    ("pdserve_engine_kv_blocks_used", "KV cache pages held by requests", "num_blocks_used"),
    ("pdserve_engine_kv_blocks_free", "KV cache pages free or only cached", "num_blocks_free"),
)


class EngineCollector:
    def __init__(self, instance: Engine) -> None:
        self.instance = instance

    def collect(self) -> Iterator[Metric]:
        stats = self.instance.aengine.last_stats
        if stats is None:
            return
        labels = list(who())
        for name, text, field in _GAUGES:
            g = GaugeMetricFamily(name, text, labels=WHO)
            g.add_metric(labels, getattr(stats, field))
            yield g
        total = stats.num_blocks_used + stats.num_blocks_free
        g = GaugeMetricFamily("pdserve_engine_kv_usage_ratio",
                              "Share of the KV cache's pages held by requests", labels=WHO)
        g.add_metric(labels, stats.num_blocks_used / total if total else 0.0)
        yield g

    def unregister(self) -> None:
        REGISTRY.unregister(self)  # type: ignore[arg-type]
