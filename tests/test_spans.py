"""Unit tests of otel_hicache.sinks.spans: the attribute set, and ``SpanBuilder`` on an
SDK TracerProvider with an InMemorySpanExporter, on ops as the consumer hands them to it
(``consumer.Op``, made from a ``record.OP`` message) with their timing set by hand."""

from __future__ import annotations

import inspect

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, Decision, Sampler, SamplingResult
from opentelemetry.trace import SpanContext, SpanKind, StatusCode, TraceFlags, TraceState

from otel_hicache import semconv as sc
from otel_hicache.record import DEVICE_EVENT, DIRECT, MERGED_OP, OP, OP_FIELDS, context_tuple
from otel_hicache.sinks.consumer import Op
from otel_hicache.capture.attributes import call_attributes, limits
from otel_hicache.sinks.spans import SpanBuilder, span_attributes
from otel_hicache.version import __version__

RANDOM_TRACE_ID = 0x02  # W3C Trace Context level 2's random trace-id flag (TraceFlags names it on newer APIs)
# SDK releases that know it set it on the spans whose trace ids they draw, and keep it in children;
# older ones (the oldest pyproject.toml allows) set the sampled flag alone
LEVEL_2 = hasattr(TraceFlags, "RANDOM_TRACE_ID")
SDK_SPAN_METRICS = "meter_provider" in inspect.signature(TracerProvider).parameters


def sdk_flags(flags: int) -> TraceFlags:
    return TraceFlags(flags if LEVEL_2 else flags & TraceFlags.SAMPLED)

SUBMIT = 1_767_225_600_000_000_000
START = SUBMIT + 200_000
DURATION = 6_781_000
END = START + DURATION
STATIC = {"tp_rank": 0, "model": "qwen3"}

# what the standard record's span carries before the ack fields, in order: static
# attributes, then the measured ones (16 in all)
MEASURED = [
    ("tp_rank", 0), ("model", "qwen3"),
    ("hicache.direction", "onboard"), ("hicache.src_tier", "L2"), ("hicache.dst_tier", "L1"),
    ("hicache.origin", "merged_op"), ("hicache.cause", "other"), ("hicache.tokens", 1408), ("hicache.blocks", 22),
    ("hicache.bytes", 161_480_704), ("hicache.page_size", 64), ("hicache.pool.names", ("kv", "swa")),
    ("hicache.pool.tokens", (1408, 64)), ("hicache.io_backend", "kernel"), ("hicache.timing_source", "device_event"),
    ("hicache.queue_wait_us", 200.0), ("hicache.bandwidth_bytes_per_second", 161_480_704 * 1e9 / DURATION),
]
MEASURED_DIRECT = [(k, "direct" if k == "hicache.origin" else v) for k, v in MEASURED]  # expect_ack=False


def record(direction="onboard", expect_ack=True, ack_ns=None, error=None, parent=None, attributes=None,
           duration_ns=DURATION, queue_wait_ns=200_000, io_backend="kernel"):
    """The standard op (1408 + 64 tokens of two pools) as the span builder gets it: a ``consumer.Op``
    made from the ``record.OP`` message the poller sends. ``parent``: the SpanContext current at
    submit (sent as ids), or None."""
    fields = dict(
        seq=1, direction=direction, origin=MERGED_OP if expect_ack else DIRECT, cause=sc.CAUSE_OTHER,
        cause_parts=None, tokens=1408, blocks=22, pool_names=("kv", "swa"), pool_tokens=(1408, 64),
        num_bytes=161_480_704, page_size=64, io_backend=io_backend, attributes=dict(attributes) if attributes else None,
        timing_source=DEVICE_EVENT, placement=None, start_ns=START, end_ns=START + duration_ns,
        duration_ns=duration_ns, queue_wait_ns=queue_wait_ns, error=error, submit_ns=SUBMIT, ack_ns=ack_ns,
        expect_ack=expect_ack, parent=context_tuple(parent), request_links=(), request_links_dropped=0)
    assert tuple(fields) == OP_FIELDS
    return Op((OP, *fields.values()))


class Recorder(SpanProcessor):
    """Every span a processor sees, sampled or not."""

    def __init__(self):
        self.started, self.ended = [], []

    def on_start(self, span, parent_context=None):
        self.started.append(span.name)

    def on_end(self, span):
        self.ended.append(span)


class FixedSampler(Sampler):
    """One decision for every span; adds ``extra`` attributes and ``trace_state``. Notes what it was asked."""

    def __init__(self, decision, extra=None, trace_state=None):
        self.decision, self.extra, self.trace_state = decision, extra or {}, trace_state
        self.asked = []

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None):
        self.asked.append((trace_id, name, kind, dict(attributes or {})))
        attrs = {**(attributes or {}), **self.extra} if self.decision.is_recording() else None
        return SamplingResult(self.decision, attrs, self.trace_state)

    def get_description(self):
        return "FixedSampler"


class Rig:
    def __init__(self, sampler=None, limits=None, **provider_kwargs):
        self.exporter = InMemorySpanExporter()
        self.recorder = Recorder()
        self.provider = TracerProvider(sampler=sampler, span_limits=limits, shutdown_on_exit=False,
                                       resource=Resource.create({"service.name": "unit"}), **provider_kwargs)
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.provider.add_span_processor(self.recorder)
        self.builder = SpanBuilder(self.provider, STATIC)

    def emit(self, r):
        """The spans begin() and finish() export."""
        before = len(self.exporter.get_finished_spans())
        state = self.builder.begin(r)
        assert len(self.exporter.get_finished_spans()) == before  # nothing leaves before finish
        self.builder.finish(r, state)
        return list(self.exporter.get_finished_spans())[before:]

    def span(self, r):
        [span] = self.emit(r)
        return span


def parent_context(flags=TraceFlags.SAMPLED, remote=False, trace_state=None):
    return SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0x00F067AA0BA902B7, is_remote=remote,
                       trace_flags=TraceFlags(flags), trace_state=trace_state)


def snapshot(span):
    """Everything an exporter reads from a span, ids aside."""
    return {
        "name": span.name, "kind": span.kind, "start": span.start_time, "end": span.end_time,
        "attributes": list(span.attributes.items()), "dropped_attributes": span.dropped_attributes,
        "events": [(e.name, e.timestamp, dict(e.attributes or {})) for e in span.events],
        "dropped_events": span.dropped_events, "status": (span.status.status_code, span.status.description),
        "parent": span.parent, "flags": span.context.trace_flags, "trace_state": span.context.trace_state,
        "resource": dict(span.resource.attributes), "links": list(span.links),
        "scope": (span.instrumentation_scope.name, span.instrumentation_scope.version),
    }


# -- span_attributes -----------------------------------------------------------------------------

def test_span_attributes_static_first_then_the_measured_ones():
    attrs = span_attributes(record(), STATIC)
    assert list(attrs.items()) == MEASURED


def test_per_call_attributes_are_kept_only_when_otel_can_carry_them():
    extra = {"ok": 1, "f": 1.5, "b": True, "s": "x", "t": ("a", "b"), "l": [1, 2], "": "empty key", 5: "int key",
             "none": None, "d": {"x": 1}, "with_none": ["a", None], "obj": object(), "nested": [[1]],
             "surrogate": "a\ud800", "big": 2**64}
    assert call_attributes(extra, 128, None) == {"ok": 1, "f": 1.5, "b": True, "s": "x", "t": ("a", "b"),
                                                 "l": [1, 2]}
    assert call_attributes(["not", "a", "mapping"], 128, None) is None


def test_per_call_attributes_obey_the_sdks_limits_before_they_are_queued(monkeypatch):
    """OTEL_SPAN_ATTRIBUTE_* over OTEL_ATTRIBUTE_*, as the SDK reads them; the SDK's defaults."""
    for name in ("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "OTEL_ATTRIBUTE_COUNT_LIMIT",
                 "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT"):
        monkeypatch.delenv(name, raising=False)
    assert limits() == (128, None)
    monkeypatch.setenv("OTEL_ATTRIBUTE_COUNT_LIMIT", "5")
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "9")
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "2")
    assert limits() == (2, 9)
    big = {"a": "x" * 200_000, "b": ["y" * 20, 3], "c": "kept out"}
    assert call_attributes(big, *limits()) == {"a": "x" * 9, "b": ["y" * 9, 3]}


def test_an_adapters_same_dict_is_checked_once_and_again_when_it_changed(monkeypatch):
    import numpy as np
    from otel_hicache.capture import attributes as module

    checked, real = [], module.call_attributes
    monkeypatch.setattr(module, "call_attributes", lambda *args: checked.append(1) or real(*args))
    calls = module.CallAttributes()
    given = {"hicache.controller": "C", "n": 1}
    assert calls(given) == calls(given) == given and len(checked) == 1
    given["n"] = 2  # changed in place: checked again
    assert calls(given) == {"hicache.controller": "C", "n": 2} and len(checked) == 2
    assert calls(dict(given)) == given and len(checked) == 3  # another dict, however equal
    listed = {"l": [1]}  # a mutable value is never cached
    assert calls(listed) == calls(listed) and len(checked) == 5
    last = {"a": "x"}
    calls(last)
    last["a"] = np.arange(3)  # a value that cannot compare: checked again, never raised
    calls(last)
    assert len(checked) == 7


def test_a_per_call_attribute_overrides_a_static_one_never_a_measured_one():
    attrs = span_attributes(record(attributes={"tp_rank": 7, "hicache.bytes": 1, "hicache.timing_source": "x"}),
                            STATIC)
    assert (attrs["tp_rank"], attrs["hicache.bytes"], attrs["hicache.timing_source"]) == (7, 161_480_704,
                                                                                          "device_event")
    assert list(attrs)[:2] == ["tp_rank", "model"]  # the static key keeps its place


def test_optional_attributes_appear_only_when_known():
    attrs = span_attributes(record(io_backend=None, queue_wait_ns=None, duration_ns=0), STATIC)
    assert not {"hicache.io_backend", "hicache.queue_wait_us", "hicache.bandwidth_bytes_per_second",
                "error.type"} & set(attrs)
    assert span_attributes(record(io_backend=3, queue_wait_ns=1_500), {})["hicache.io_backend"] == "3"
    assert span_attributes(record(queue_wait_ns=1_500), {})["hicache.queue_wait_us"] == 1.5


def test_a_failed_record_carries_its_error_type_and_no_bandwidth():
    attrs = span_attributes(record(error="transfer_timeout"), {})
    assert attrs["error.type"] == "transfer_timeout"
    assert "hicache.bandwidth_bytes_per_second" not in attrs


def test_span_attributes_leave_the_static_mapping_alone():
    static = dict(STATIC)
    first = span_attributes(record(attributes={"tp_rank": 9}), static)
    first["x"] = 1
    assert static == STATIC
    assert "x" not in span_attributes(record(), static)


# -- the span builder: the span -----------------------------------------------------------------

def test_one_span_with_the_copys_times_events_attributes_and_scope():
    rig = Rig()
    r = record(ack_ns=END + 5_750_000_000)
    span = rig.span(r)
    assert snapshot(span) == {
        "name": "hicache.onboard", "kind": SpanKind.INTERNAL, "start": START, "end": END,
        "attributes": MEASURED + [("hicache.acked", True), ("hicache.ack_delay_us", 5_750_000.0)],
        "dropped_attributes": 0,
        "events": [], "dropped_events": 0,
        "status": (StatusCode.UNSET, None), "parent": None,
        "flags": sdk_flags(TraceFlags.SAMPLED | RANDOM_TRACE_ID), "trace_state": TraceState(),
        "resource": {**Resource.create({"service.name": "unit"}).attributes}, "links": [],
        "scope": ("otel_hicache", __version__),
    }
    assert span.context == r.span_context
    # sampled: metrics recorded with the exemplar context link to this span
    assert trace.get_current_span(r.exemplar_context).get_span_context() == span.context


@pytest.mark.parametrize("direction, name", [("offload", "hicache.offload"), ("onboard", "hicache.onboard")])
def test_the_span_name_says_the_direction(direction, name):
    assert Rig().span(record(direction=direction)).name == name


@pytest.mark.parametrize("late", [False, True], ids=["ack-known-at-start", "ack-after-the-start"])
@pytest.mark.parametrize("expect_ack, ack_ns, fields", [
    (True, END + 1_500, [("hicache.acked", True), ("hicache.ack_delay_us", 1.5)]),
    (True, END - 10, [("hicache.acked", True), ("hicache.ack_delay_us", 0.0)]),
    (True, None, [("hicache.acked", False)]),
    (False, None, []),
    (False, END + 1_000, [("hicache.acked", True), ("hicache.ack_delay_us", 1.0)]),
], ids=["acked", "acked-before-the-end", "ack-timed-out", "direct", "direct-acked-anyway"])
def test_ack_fields_last_and_no_events(expect_ack, ack_ns, fields, late):
    late = late and expect_ack  # (a direct copy's span ends at once: no ack comes after its start)
    rig, r = Rig(), record(expect_ack=expect_ack, ack_ns=None if late else ack_ns)
    span, waits = state = rig.builder.begin(r)
    assert waits is (expect_ack and r.ack_ns is None)  # set at the start unless it waits for them
    assert list(span.attributes.items()) == (MEASURED if expect_ack else MEASURED_DIRECT) + ([] if waits else fields)
    r.ack_ns = ack_ns
    rig.builder.finish(r, state)
    [span] = rig.exporter.get_finished_spans()
    assert list(span.attributes.items()) == (MEASURED if expect_ack else MEASURED_DIRECT) + fields
    assert list(span.events) == []  # submit and ack times are in queue_wait_us and ack_delay_us


def test_a_failed_record_is_an_error_span():
    span = Rig().span(record(expect_ack=False, error="event_error"))
    assert (span.status.status_code, span.status.description) == (StatusCode.ERROR, "event_error")
    assert span.attributes["error.type"] == "event_error"


@pytest.mark.parametrize("flags", [TraceFlags.SAMPLED, TraceFlags.SAMPLED | RANDOM_TRACE_ID],
                         ids=["parent-flags-sampled", "parent-flags-random"])
@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_a_child_of_the_context_current_at_submit(flags, remote):
    parent = parent_context(flags, remote)
    rig = Rig()
    r = record(parent=parent)
    span = rig.span(r)
    assert span.parent == parent and span.parent.is_remote is remote
    assert span.context.trace_id == parent.trace_id and span.context.span_id != parent.span_id
    assert span.context.trace_flags == sdk_flags(flags)  # sampled; random-trace-id only if the parent's is
    assert not span.context.is_remote


def test_a_child_of_a_span_started_through_the_tracer_api():
    rig = Rig()
    with rig.provider.get_tracer("request").start_as_current_span("request") as request:
        # submit() sends the span context current then, as ids
        r = record(parent=trace.get_current_span().get_span_context())
    [span] = rig.emit(r)
    assert span.parent == request.get_span_context()


def test_a_dropped_span_is_not_recorded_and_has_no_exemplar():
    rig = Rig(sampler=ALWAYS_OFF)
    r = record(ack_ns=END)
    assert rig.emit(r) == []
    assert rig.recorder.ended == []
    assert r.span_context.is_valid and not r.span_context.trace_flags.sampled
    assert r.exemplar_context is None


def test_an_unsampled_parent_is_followed_by_the_default_sampler():
    parent = parent_context(flags=TraceFlags.DEFAULT)
    rig = Rig()  # ParentBased(ALWAYS_ON)
    r = record(parent=parent)
    assert rig.emit(r) == []
    assert r.span_context.trace_id == parent.trace_id and not r.span_context.trace_flags.sampled
    assert r.exemplar_context is None


def test_record_only_reaches_the_processors_but_not_a_sampled_only_exporter():
    rig = Rig(sampler=FixedSampler(Decision.RECORD_ONLY))
    r = record(ack_ns=END)
    assert rig.emit(r) == []  # SimpleSpanProcessor exports sampled spans only
    [seen] = rig.recorder.ended
    assert list(seen.attributes.items()) == MEASURED + [("hicache.acked", True), ("hicache.ack_delay_us", 0.0)]
    assert not seen.context.trace_flags.sampled
    assert r.exemplar_context is None  # no exemplar links to a span nobody exports


def test_the_sampler_sees_the_span_and_adds_its_attributes_and_trace_state():
    parent = parent_context()
    sampler = FixedSampler(Decision.RECORD_AND_SAMPLE, extra={"sampler.rule": "r1"},
                           trace_state=TraceState([("vendor", "v1")]))
    rig = Rig(sampler=sampler)
    span = rig.span(record(parent=parent, ack_ns=END))
    acked = [("hicache.acked", True), ("hicache.ack_delay_us", 0.0)]
    assert sampler.asked == [(parent.trace_id, "hicache.onboard", SpanKind.INTERNAL, dict(MEASURED + acked))]
    assert list(span.attributes.items()) == MEASURED + acked + [("sampler.rule", "r1")]
    assert span.context.trace_state == TraceState([("vendor", "v1")])


@pytest.mark.skipif(not hasattr(sdk_trace, "_disable_tracer_configurator"),
                    reason="this SDK release has no tracer configurator (a tracer cannot be disabled at runtime)")
def test_a_tracer_disabled_at_runtime_emits_nothing():
    rig = Rig()
    assert len(rig.emit(record())) == 1
    rig.provider._set_tracer_configurator(tracer_configurator=sdk_trace._disable_tracer_configurator)
    r = record()
    rig.builder.finish(r, rig.builder.begin(r))  # the builder asks the tracer per span, not once
    assert len(rig.exporter.get_finished_spans()) == 1 and len(rig.recorder.ended) == 1
    assert r.exemplar_context is None


def test_processors_see_the_span_start_and_end():
    rig = Rig()
    rig.emit(record())
    assert (rig.recorder.started, len(rig.recorder.ended)) == (["hicache.onboard"], 1)


# -- span limits: the provider's SpanLimits -------------------------------------------------------------

def test_attribute_count_limit_drops_the_oldest_attributes():
    fits = Rig(limits=SpanLimits(max_span_attributes=19)).span(record(ack_ns=END))
    assert (len(fits.attributes), fits.dropped_attributes) == (19, 0)
    short = Rig(limits=SpanLimits(max_span_attributes=18)).span(record(ack_ns=END))
    assert list(short.attributes) == [k for k, _ in MEASURED[1:]] + ["hicache.acked", "hicache.ack_delay_us"]
    assert short.dropped_attributes == 1
    # a direct copy takes no ack fields: 17 attributes fit under a limit of 18
    direct = Rig(limits=SpanLimits(max_span_attributes=18)).span(record(expect_ack=False))
    assert (list(direct.attributes.items()), direct.dropped_attributes) == (MEASURED_DIRECT, 0)


def test_value_length_limit_truncates_strings_only():
    span = Rig(limits=SpanLimits(max_span_attribute_length=3)).span(record(ack_ns=END))
    a = span.attributes
    assert (a["model"], a["hicache.direction"], a["hicache.timing_source"]) == ("qwe", "onb", "dev")
    assert a["hicache.pool.names"] == ("kv", "swa") and a["hicache.pool.tokens"] == (1408, 64)
    assert (a["hicache.bytes"], a["hicache.acked"]) == (161_480_704, True)


UNLIMITED = {
    "attribute-count-unset": lambda mp: SpanLimits(max_span_attributes=SpanLimits.UNSET),
    "event-count-unset": lambda mp: SpanLimits(max_events=SpanLimits.UNSET),
    # an empty variable means "no limit" to the SDK
    "empty-env-variable": lambda mp: mp.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "") or SpanLimits(),
}


# A limit left unset is None in SpanLimits (SpanLimits.UNSET, or OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT= set
# empty): nothing is dropped.
@pytest.mark.parametrize("limits", UNLIMITED.values(), ids=UNLIMITED.keys())
def test_unlimited_limits(monkeypatch, limits):
    span = Rig(limits=limits(monkeypatch)).span(record(ack_ns=END))
    assert (len(span.attributes), len(span.events), span.dropped_attributes, span.dropped_events) == (19, 0, 0, 0)


# -- the SDK's own span metrics (otel.sdk.span.started / otel.sdk.span.live) -----------------------------

class ScriptedSampler(Sampler):
    """The next decision of ``decisions`` for each span, in turn."""

    def __init__(self, decisions):
        self.decisions = list(decisions)

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None):
        decision = self.decisions.pop(0)
        return SamplingResult(decision, attributes if decision.is_recording() else None)

    def get_description(self):
        return "ScriptedSampler"


DECISIONS = [Decision.RECORD_AND_SAMPLE, Decision.RECORD_ONLY, Decision.DROP]
PARENTS = {"none": lambda: None, "local": parent_context, "remote": lambda: parent_context(remote=True)}


def metered_rig(monkeypatch, enabled):
    """A Rig whose TracerProvider has a MeterProvider, built with the SDK's own metrics on or off
    (the Tracer reads OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED when it is made)."""
    if enabled:
        monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
    else:
        monkeypatch.delenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", raising=False)
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    sampler = ScriptedSampler(DECISIONS * len(PARENTS))
    return Rig(sampler=sampler, meter_provider=meter_provider), reader


def self_metrics(reader):
    """Every otel.sdk.span.* point: (name, attributes, value)."""
    data = reader.get_metrics_data()
    return sorted((m.name, tuple(sorted(p.attributes.items())), p.value)
                  for rm in (data.resource_metrics if data else ()) for sm in rm.scope_metrics
                  for m in sm.metrics if m.name.startswith("otel.sdk.span.") for p in m.data.data_points)


def emit_metered(monkeypatch, enabled):
    """Each parent origin with each decision: the points once every span began, and once all finished."""
    rig, reader = metered_rig(monkeypatch, enabled)
    begun = []
    for parent in PARENTS.values():
        for _decision in DECISIONS:
            r = record(parent=parent(), ack_ns=END)
            begun.append((r, rig.builder.begin(r)))
    live = self_metrics(reader)
    for r, state in begun:
        rig.builder.finish(r, state)
    return live, self_metrics(reader), len(rig.recorder.ended)


@pytest.mark.skipif(not SDK_SPAN_METRICS, reason="this SDK release records no span metrics of its own")
def test_the_sdks_span_metrics_are_recorded(monkeypatch):
    live, ended, recorded = emit_metered(monkeypatch, True)
    assert recorded == 6  # record-and-sample and record-only, for each parent
    started = [("otel.sdk.span.started", (("otel.span.parent.origin", origin),
                                          ("otel.span.sampling_result", decision.name)), 1)
               for origin in PARENTS for decision in DECISIONS]
    assert live == sorted(started + [
        ("otel.sdk.span.live", (("otel.span.sampling_result", "RECORD_AND_SAMPLE"),), 3),
        ("otel.sdk.span.live", (("otel.span.sampling_result", "RECORD_ONLY"),), 3)])
    assert ended == sorted(started + [
        ("otel.sdk.span.live", (("otel.span.sampling_result", "RECORD_AND_SAMPLE"),), 0),
        ("otel.sdk.span.live", (("otel.span.sampling_result", "RECORD_ONLY"),), 0)])


@pytest.mark.skipif(not SDK_SPAN_METRICS, reason="this SDK release records no span metrics of its own")
def test_no_sdk_span_metrics_unless_enabled(monkeypatch):
    assert emit_metered(monkeypatch, False) == ([], [], 6)


# -- any provider ------------------------------------------------------------------------------

def test_the_builder_works_on_any_provider():
    builder = SpanBuilder(trace.NoOpTracerProvider(), STATIC)
    r = record(ack_ns=END)
    builder.finish(r, builder.begin(r))  # nothing to record, nothing raised
    assert not r.span_context.is_valid and r.exemplar_context is None
