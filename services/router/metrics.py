"""Prometheus metrics of the router (one set per process)."""

from __future__ import annotations

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
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TTFT = Histogram("pdserve_router_ttft_seconds", "Arrival to the first token sent to the client",
                 buckets=_LATENCY)
ITL = Histogram("pdserve_router_inter_token_seconds", "Between two messages with tokens sent "
                "to one client", buckets=_LATENCY)
# Time from the request's arrival to its first outbound engine call: the router's own cost.
ADDED_LATENCY = Histogram(
    "pdserve_router_added_latency_seconds", "Router time before the first engine call",
    buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0))
BUSY_WAITS = Counter("pdserve_router_busy_waits",
                     "Waits before trying busy engines again (all answered RESOURCE_EXHAUSTED)")
QUEUED = Gauge("pdserve_router_admission_queued", "Requests waiting in the admission queue")
QUEUE_WAIT = Histogram("pdserve_router_admission_wait_seconds",
                       "Time from arrival to admission (prepared, then queued)",
                       buckets=_LATENCY)
DOWN_WAITS = Counter("pdserve_router_down_waits",
                     "Waits for an instance to come back while none of a role is healthy "
                     "(restarting)")
