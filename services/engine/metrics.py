"""Prometheus metrics of the engine services (served on ``--metrics-port``)."""

from __future__ import annotations

import grpc
from prometheus_client import Counter, Histogram

REQUESTS = Counter("pdserve_engine_requests_total", "Requests handled, by rpc and outcome "
                   "(ok or a gRPC status name)", ["rpc", "outcome"])
TOKENS = Counter("pdserve_engine_tokens_total", "Tokens by kind: prompt (computed), cached "
                 "(prompt tokens served from KV blocks), generated", ["kind"])
BLOCKS = Counter("pdserve_engine_kv_blocks_total", "KV blocks moved through the kvd, by "
                 "direction (exported, imported)", ["direction"])
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
PREFILL_SECONDS = Histogram("pdserve_prefill_seconds", "Prefill rpc duration", buckets=_BUCKETS)
KV_WAIT_SECONDS = Histogram("pdserve_decode_kv_wait_seconds", "Decode: waiting for and "
                            "importing the prompt's KV blocks", buckets=_BUCKETS)
TOKEN_GAP_SECONDS = Histogram("pdserve_decode_inter_token_seconds", "Decode: time between "
                              "streamed tokens", buckets=_BUCKETS)


def count_rpc(rpc: str, code: grpc.StatusCode) -> None:
    """``rpc_handler``'s hook: one count per Prefill/Decode call and its final status."""
    REQUESTS.labels(rpc, "ok" if code == grpc.StatusCode.OK else code.name).inc()
