"""Prometheus metrics and OpenTelemetry tracing of the router (one set per process)."""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("pdserve_router_requests", "Generate requests by final status code", ["code"])
DECISIONS = Counter("pdserve_router_routing_decisions",
                    "Placements by policy and chosen instances",
                    ["policy", "prefill", "decode"])
RETRIES = Counter("pdserve_router_retries", "Attempts moved to another instance", ["phase"])
PREFIX_HIT_BLOCKS = Counter("pdserve_router_prefix_hit_blocks",
                            "Prompt blocks already held by the chosen prefill node")
PROMPT_BLOCKS = Counter("pdserve_router_prompt_blocks", "Full prompt blocks routed")
IN_FLIGHT = Gauge("pdserve_router_requests_in_flight", "Generate requests in flight")
INDEX_AVAILABLE = Gauge("pdserve_router_index_available",
                        "1 while the Redis prefix index answers, 0 while routing by load only")
HEALTHY_INSTANCES = Gauge("pdserve_router_healthy_instances", "Healthy instances by role",
                          ["role"])
# Time from the request's arrival to its first outbound engine call: the router's own cost.
ADDED_LATENCY = Histogram(
    "pdserve_router_added_latency_seconds", "Router time before the first engine call",
    buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0))

tracer = trace.get_tracer("pdserve.router")


def trace_metadata(span: trace.Span) -> tuple[tuple[str, str], ...]:
    """W3C ``traceparent`` of ``span``, as gRPC metadata for the calls made on its behalf."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def extract_context(metadata: Sequence[tuple[str, str | bytes]] | None) -> Context:
    """The caller's trace context from incoming gRPC metadata (a new trace if absent)."""
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)
