"""OpenTelemetry tracing shared by every service.

Spans cross process boundaries as W3C ``traceparent`` entries in gRPC metadata: a client calls
``outbound_metadata()`` and passes the result as ``metadata=``; every servicer's handler runs in
a server span continuing the caller's trace (``pdserve.rpc.rpc_handler``). With
``PDSERVE_OTEL_ENDPOINT`` set, spans are exported over OTLP/gRPC; without it they are created
(ids still propagate into logs) but not exported.
"""

from __future__ import annotations

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

_initialised = False


def init_tracing(service: str, endpoint: str = "", exporter: SpanExporter | None = None) -> None:
    """Install the process's tracer provider once; ``exporter`` overrides OTLP (tests)."""
    global _initialised
    if _initialised:
        return
    provider = TracerProvider(resource=Resource.create({"service.name": f"pdserve-{service}"}))
    if exporter is None and endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True)
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _initialised = True


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def outbound_metadata(extra: tuple[tuple[str, str], ...] = ()) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the current span's context."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return (*carrier.items(), *extra)
