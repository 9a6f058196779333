"""Spans without an exporter (``pdserve.telemetry``): ids only, as the SDK would set them."""

from __future__ import annotations

import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider

from pdserve.telemetry import _IdsOnlyProvider

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.mark.parametrize("parent", [None, f"00-{TRACE}-00f067aa0ba902b7-01",
                                    f"00-{TRACE}-00f067aa0ba902b7-00"])
def test_ids_only_spans_carry_what_a_recording_span_would(parent: str | None) -> None:
    context = propagate.extract({"traceparent": parent, "tracestate": "k=v"} if parent else {})
    span = _IdsOnlyProvider().get_tracer("t").start_span("x", context=context)
    sdk = TracerProvider().get_tracer("t").start_span("x", context=context)
    ours, theirs = span.get_span_context(), sdk.get_span_context()
    assert not span.is_recording() and ours.is_valid
    assert ours.trace_flags == theirs.trace_flags
    assert ours.trace_state == theirs.trace_state
    assert ours.span_id not in (theirs.span_id, 0x00f067aa0ba902b7)  # a span id of its own
    if parent:
        assert format(ours.trace_id, "032x") == TRACE == format(theirs.trace_id, "032x")
    else:
        assert ours.trace_id != theirs.trace_id  # a new trace each


def test_ids_only_current_span_propagates() -> None:
    tracer = _IdsOnlyProvider().get_tracer("t")
    with tracer.start_as_current_span("outer") as outer:
        assert trace.get_current_span() is outer
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        inner = tracer.start_span("inner")
    ids = outer.get_span_context()
    flags = f"{ids.trace_flags:02x}"
    assert carrier["traceparent"] == f"00-{ids.trace_id:032x}-{ids.span_id:016x}-{flags}"
    assert ids.trace_flags.sampled
    assert inner.get_span_context().trace_id == ids.trace_id
    assert trace.get_current_span() is not outer


@pytest.mark.parametrize(("sampler", "arg"), [
    ("always_off", None), ("parentbased_always_off", None), ("traceidratio", "0.5"),
    ("parentbased_traceidratio", "0.25"), ("always_on", None)])
@pytest.mark.parametrize("parent", [None, f"00-{TRACE}-00f067aa0ba902b7-01",
                                    f"00-{TRACE}-00f067aa0ba902b7-00"])
def test_ids_only_spans_follow_the_sampler_the_environment_names(
        sampler: str, arg: str | None, parent: str | None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """OTEL_TRACES_SAMPLER sets the flags a span propagates also when nothing exports: the
    SDK's decision for the same trace id, for 200 root traces and for a remote parent."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    if arg is None:
        monkeypatch.delenv("OTEL_TRACES_SAMPLER_ARG", raising=False)
    else:
        monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
    ours_tracer = _IdsOnlyProvider().get_tracer("t")
    sdk_tracer = TracerProvider().get_tracer("t")  # reads the same variables
    context = propagate.extract({"traceparent": parent} if parent else {})
    decisions = set()
    for _ in range(200 if parent is None else 1):
        ours = ours_tracer.start_span("x", context=context).get_span_context()
        # The SDK's sampler on our trace id: a ratio sampler decides by the id's low bits.
        expect = sdk_tracer.sampler.should_sample(context, ours.trace_id, "x")
        assert ours.trace_flags.sampled == expect.decision.is_sampled()
        assert ours.trace_flags.random_trace_id == (parent is None)
        decisions.add(ours.trace_flags.sampled)
    if parent is None and "ratio" in sampler:
        assert decisions == {True, False}  # some of 200 each way at 0.25 or 0.5
