"""What the kvd measures beyond its counters (``servicer.KvdCollector`` reads those from
``Kvd.stats()`` at scrape time): how long each transfer takes, and a span for it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from prometheus_client import Histogram

TRANSFER_SECONDS = Histogram(
    "pdserve_kvd_transfer_seconds", "One transfer's blocks over UCX, from the first byte "
    "posted to the last one verified (in) or sent (out)", ["node", "direction"],
    buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0, 5.0))
_tracer = trace.get_tracer("pdserve.kvd")


def sent_same_host(node: str, peer: str, num_blocks: int, num_bytes: int,
                   start: float, start_ns: int) -> None:
    """A push the same-host receiver copied from this pool: its ``kvd.send`` span and time,
    from the announce (``perf_counter`` ``start``, wall clock ``start_ns``) to its answer."""
    span = _tracer.start_span("kvd.send", start_time=start_ns)
    span.set_attributes({"pdserve.kvd.peer": peer, "pdserve.kvd.blocks": num_blocks,
                         "pdserve.kvd.bytes": num_bytes, "pdserve.kvd.same_host": True})
    span.end()
    TRANSFER_SECONDS.labels(node, "out").observe(time.perf_counter() - start)


@contextmanager
def transfer(node: str, direction: str, peer: str, num_blocks: int,
             num_bytes: int) -> Iterator[trace.Span]:
    """Time one transfer and trace it (``kvd.send`` / ``kvd.receive``, a child of the call
    that started it), with its peer, blocks and bytes."""
    name = "kvd.send" if direction == "out" else "kvd.receive"
    start = time.perf_counter()
    with _tracer.start_as_current_span(name) as span:
        span.set_attributes({"pdserve.kvd.peer": peer, "pdserve.kvd.blocks": num_blocks,
                             "pdserve.kvd.bytes": num_bytes})
        yield span
    TRANSFER_SECONDS.labels(node, direction).observe(time.perf_counter() - start)
