"""OpenTelemetry tracing shared by every service.

Spans cross process boundaries as W3C ``traceparent`` entries in gRPC metadata: a client calls
``outbound_metadata()`` and passes the result as ``metadata=``; every servicer's handler runs in
a server span continuing the caller's trace (``pdserve.rpc.rpc_handler``). With
``PDSERVE_OTEL_ENDPOINT`` set, spans are exported over OTLP/gRPC; without it spans carry ids
(new span ids, the caller's trace id, trace flags and trace state, as the SDK's sampler sets
them: its default, or the one ``OTEL_TRACES_SAMPLER`` names) and record nothing: the trace
still propagates across every hop, at a fraction of a recording span's cost per request.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import Sampler, _get_from_env_or_default

SAMPLER_VAR = "OTEL_TRACES_SAMPLER"

_initialised = False


def init_tracing(service: str, endpoint: str = "", exporter: SpanExporter | None = None) -> None:
    """Install the process's tracer provider once; ``exporter`` overrides OTLP (tests)."""
    global _initialised
    if _initialised:
        return
    if exporter is None and endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True)
    if exporter is None:
        trace.set_tracer_provider(_IdsOnlyProvider())
    else:
        provider = TracerProvider(
            resource=Resource.create({"service.name": f"pdserve-{service}"}))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
    _initialised = True


class _IdsOnlyTracer(trace.Tracer):
    """Spans with the ids a recording span would get, and nothing recorded (no exporter).
    ``sampler``: the SDK sampler that sets the flags and trace state; None stands for the
    SDK's default (parent-based, always on), computed here without its per-span objects."""

    _ids = RandomIdGenerator()

    def __init__(self, sampler: Sampler | None = None) -> None:
        self.sampler = sampler

    def start_span(self, name: str, context: otel_context.Context | None = None,
                   kind: trace.SpanKind = trace.SpanKind.INTERNAL, attributes: Any = None,
                   links: Sequence[trace.Link] | None = None, start_time: int | None = None,
                   record_exception: bool = True, set_status_on_exception: bool = True,
                   ) -> trace.Span:
        parent = trace.get_current_span(context).get_span_context()
        # As the SDK's default sampler (parent-based, always on) sets the flags: sampled
        # unless the parent is not; a random trace id (ours are) is flagged too.
        flags = trace.TraceFlags.SAMPLED | trace.TraceFlags.RANDOM_TRACE_ID
        if parent.is_valid:
            trace_id, state = parent.trace_id, parent.trace_state
            flags &= parent.trace_flags
        else:
            trace_id, state = self._ids.generate_trace_id(), trace.TraceState()
        if self.sampler is not None:  # as the SDK's Tracer.start_span applies a sampler
            result = self.sampler.should_sample(context, trace_id, name, kind, attributes,
                                                links)
            random_id = parent.trace_flags.random_trace_id if parent.is_valid else True
            flags = ((trace.TraceFlags.SAMPLED if result.decision.is_sampled() else 0)
                     | (trace.TraceFlags.RANDOM_TRACE_ID if random_id else 0))
            state = result.trace_state or trace.TraceState()
        return trace.NonRecordingSpan(trace.SpanContext(
            trace_id, self._ids.generate_span_id(), is_remote=False,
            trace_flags=trace.TraceFlags(flags),
            trace_state=state))

    @contextmanager
    def start_as_current_span(  # type: ignore[override]
            self, name: str, context: otel_context.Context | None = None,
            kind: trace.SpanKind = trace.SpanKind.INTERNAL, attributes: Any = None,
            links: Sequence[trace.Link] | None = None, start_time: int | None = None,
            record_exception: bool = True, set_status_on_exception: bool = True,
            end_on_exit: bool = True) -> Iterator[trace.Span]:
        span = self.start_span(name, context, kind, attributes, links)
        with trace.use_span(span, end_on_exit=end_on_exit) as current:
            yield current


class _IdsOnlyProvider(trace.TracerProvider):
    def __init__(self) -> None:
        # OTEL_TRACES_SAMPLER (and its _ARG) choose the sampler as they would the SDK's.
        self._tracer = _IdsOnlyTracer(
            _get_from_env_or_default() if os.environ.get(SAMPLER_VAR) else None)

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return self._tracer


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def outbound_metadata(extra: tuple[tuple[str, str], ...] = ()) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the current span's context."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return (*carrier.items(), *extra)
