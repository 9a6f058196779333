"""Prometheus metrics of the gateway, in a registry of their own (one per app, so tests can run
several gateways in one process without colliding on the global registry)."""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

# Latency buckets from 1 ms (the hot path's budget) to minutes (long generations).
_LATENCY = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    """``with_process_registry``: also expose prometheus_client's default registry, where an
    embedded router (``--router embedded``) counts its ``pdserve_router_*`` metrics."""

    def __init__(self, with_process_registry: bool = False) -> None:
        self.with_process_registry = with_process_registry
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_gateway_requests", "HTTP requests answered",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("pdserve_gateway_request_seconds",
                                 "request latency, arrival to last byte", ["endpoint"],
                                 buckets=_LATENCY, registry=r)
        self.ttft = Histogram("pdserve_gateway_ttft_seconds",
                              "time to first token, arrival to first generated token",
                              ["endpoint"], buckets=_LATENCY, registry=r)
        self.tokens = Counter("pdserve_gateway_tokens", "tokens processed", ["kind"], registry=r)
        self.in_flight = Gauge("pdserve_gateway_in_flight", "requests in progress", registry=r)
        self.router_errors = Counter("pdserve_gateway_router_errors",
                                     "router calls that ended with an error status", ["code"],
                                     registry=r)
        self.disconnects = Counter("pdserve_gateway_client_disconnects",
                                   "requests whose client went away (router call cancelled)",
                                   registry=r)
        self._prompt = self.tokens.labels("prompt")
        self._completion = self.tokens.labels("completion")
        # labels() costs microseconds a call: the few children in use are looked up once.
        self._children: dict[tuple[str, int], tuple[Any, Any, Any]] = {}

    def record(self, endpoint: str, status: int, seconds: float) -> None:
        """One finished request (also leaves the in-flight count)."""
        children = self._children.get((endpoint, status))
        if children is None:
            children = (self.requests.labels(endpoint, str(status)),
                        self.latency.labels(endpoint), self.ttft.labels(endpoint))
            self._children[(endpoint, status)] = children
        children[0].inc()
        children[1].observe(seconds)
        self.in_flight.dec()

    def observe_ttft(self, endpoint: str, seconds: float) -> None:
        children = self._children.get((endpoint, 200))
        ttft = children[2] if children is not None else self.ttft.labels(endpoint)
        ttft.observe(seconds)

    def count_tokens(self, prompt: int, completion: int) -> None:
        self._prompt.inc(prompt)
        self._completion.inc(completion)

    def exposition(self) -> bytes:
        own = generate_latest(self.registry)
        return own + generate_latest(REGISTRY) if self.with_process_registry else own
