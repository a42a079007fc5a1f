"""Unit tests of otel_hicache.spans: the attribute set, and both span builders
(``ApiSpanBuilder``, ``FastSpanBuilder``) on an SDK TracerProvider with an
InMemorySpanExporter, on records whose timing is set by hand. Most builder tests
run on both builders; the fast one must give the API one's result."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider, _disable_tracer_configurator
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, Decision, Sampler, SamplingResult
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags, TraceState
from opentelemetry.trace.propagation import set_span_in_context

from otel_hicache.records import DEVICE_EVENT, S_ACK_NS, TransferRecord, submission, validate
from otel_hicache.spans import ApiSpanBuilder, FastSpanBuilder, make_span_builder, span_attributes
from otel_hicache.version import __version__

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

BUILDERS = pytest.mark.parametrize("builder", [ApiSpanBuilder, FastSpanBuilder], ids=["api", "fast"])


def record(direction="onboard", expect_ack=True, ack_ns=None, error=None, parent_context=None, attributes=None,
           duration_ns=DURATION, queue_wait_ns=200_000, io_backend="kernel"):
    r = TransferRecord(submission(direction, {"kv": 1408, "swa": 64}, 161_480_704, 64, io_backend=io_backend,
                                  attributes=attributes, expect_ack=expect_ack, submit_ns=SUBMIT,
                                  parent_context=parent_context))
    validate(r)
    r.timing_source = DEVICE_EVENT  # as timing.resolve() leaves it
    r.start_ns, r.end_ns, r.duration_ns = START, START + duration_ns, duration_ns
    r.queue_wait_ns = queue_wait_ns
    r.error = error
    r.handle[S_ACK_NS] = ack_ns
    return r


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
    def __init__(self, builder, sampler=None, limits=None, **provider_kwargs):
        self.exporter = InMemorySpanExporter()
        self.recorder = Recorder()
        self.provider = TracerProvider(sampler=sampler, span_limits=limits, shutdown_on_exit=False,
                                       resource=Resource.create({"service.name": "unit"}), **provider_kwargs)
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.provider.add_span_processor(self.recorder)
        self.builder = builder(self.provider, STATIC)

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
    context = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0x00F067AA0BA902B7, is_remote=remote,
                          trace_flags=TraceFlags(flags), trace_state=trace_state)
    return set_span_in_context(NonRecordingSpan(context)), context


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
             "none": None, "d": {"x": 1}, "with_none": ["a", None], "obj": object(), "nested": [[1]]}
    attrs = span_attributes(record(attributes=extra), {})
    assert [(k, v) for k, v in attrs.items() if not k.startswith("hicache.")] == [
        ("ok", 1), ("f", 1.5), ("b", True), ("s", "x"), ("t", ("a", "b")), ("l", [1, 2])]


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


# -- both builders: the span ---------------------------------------------------------------------

@BUILDERS
def test_one_span_with_the_copys_times_events_attributes_and_scope(builder):
    rig = Rig(builder)
    r = record(ack_ns=END + 5_750_000_000)
    span = rig.span(r)
    assert snapshot(span) == {
        "name": "hicache.onboard", "kind": SpanKind.INTERNAL, "start": START, "end": END,
        "attributes": MEASURED + [("hicache.acked", True), ("hicache.ack_delay_us", 5_750_000.0)],
        "dropped_attributes": 0,
        "events": [("submitted", SUBMIT, {}), ("acked", END + 5_750_000_000, {})], "dropped_events": 0,
        "status": (StatusCode.UNSET, None), "parent": None,
        "flags": TraceFlags(TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID), "trace_state": TraceState(),
        "resource": {**Resource.create({"service.name": "unit"}).attributes}, "links": [],
        "scope": ("otel_hicache", __version__),
    }
    assert span.context == r.span_context
    # sampled: metrics recorded with the exemplar context link to this span
    assert trace.get_current_span(r.exemplar_context).get_span_context() == span.context


@BUILDERS
@pytest.mark.parametrize("direction, name", [("offload", "hicache.offload"), ("onboard", "hicache.onboard")])
def test_the_span_name_says_the_direction(builder, direction, name):
    assert Rig(builder).span(record(direction=direction)).name == name


@BUILDERS
@pytest.mark.parametrize("expect_ack, ack_ns, fields, events", [
    (True, END + 1_500, [("hicache.acked", True), ("hicache.ack_delay_us", 1.5)], ["submitted", "acked"]),
    (True, END - 10, [("hicache.acked", True), ("hicache.ack_delay_us", 0.0)], ["submitted", "acked"]),
    (True, None, [("hicache.acked", False)], ["submitted"]),
    (False, None, [], ["submitted"]),
    (False, END + 1_000, [("hicache.acked", True), ("hicache.ack_delay_us", 1.0)], ["submitted", "acked"]),
], ids=["acked", "acked-before-the-end", "ack-timed-out", "direct", "direct-acked-anyway"])
def test_ack_fields_at_finish(builder, expect_ack, ack_ns, fields, events):
    span = Rig(builder).span(record(expect_ack=expect_ack, ack_ns=ack_ns))
    # set last, after the measured ones
    assert list(span.attributes.items()) == (MEASURED if expect_ack else MEASURED_DIRECT) + fields
    assert [e.name for e in span.events] == events


@BUILDERS
def test_a_failed_record_is_an_error_span(builder):
    span = Rig(builder).span(record(expect_ack=False, error="event_error"))
    assert (span.status.status_code, span.status.description) == (StatusCode.ERROR, "event_error")
    assert span.attributes["error.type"] == "event_error"


@BUILDERS
@pytest.mark.parametrize("flags", [TraceFlags.SAMPLED, TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID],
                         ids=["parent-flags-sampled", "parent-flags-random"])
@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_a_child_of_the_context_current_at_submit(builder, flags, remote):
    context, parent = parent_context(flags, remote)
    rig = Rig(builder)
    r = record(parent_context=context)
    span = rig.span(r)
    assert span.parent == parent and span.parent.is_remote is remote
    assert span.context.trace_id == parent.trace_id and span.context.span_id != parent.span_id
    assert span.context.trace_flags == flags  # sampled; random-trace-id only if the parent's is
    assert not span.context.is_remote


@BUILDERS
def test_a_child_of_a_span_started_through_the_tracer_api(builder):
    rig = Rig(builder)
    with rig.provider.get_tracer("request").start_as_current_span("request") as request:
        r = record(parent_context=trace.set_span_in_context(request))
    [span] = rig.emit(r)
    assert span.parent == request.get_span_context()


@BUILDERS
def test_a_dropped_span_is_not_recorded_and_has_no_exemplar(builder):
    rig = Rig(builder, sampler=ALWAYS_OFF)
    r = record(ack_ns=END)
    assert rig.emit(r) == []
    assert rig.recorder.ended == []
    assert r.span_context.is_valid and not r.span_context.trace_flags.sampled
    assert r.exemplar_context is None


@BUILDERS
def test_an_unsampled_parent_is_followed_by_the_default_sampler(builder):
    context, parent = parent_context(flags=TraceFlags.DEFAULT)
    rig = Rig(builder)  # ParentBased(ALWAYS_ON)
    r = record(parent_context=context)
    assert rig.emit(r) == []
    assert r.span_context.trace_id == parent.trace_id and not r.span_context.trace_flags.sampled
    assert r.exemplar_context is None


@BUILDERS
def test_record_only_reaches_the_processors_but_not_a_sampled_only_exporter(builder):
    rig = Rig(builder, sampler=FixedSampler(Decision.RECORD_ONLY))
    r = record(ack_ns=END)
    assert rig.emit(r) == []  # SimpleSpanProcessor exports sampled spans only
    [seen] = rig.recorder.ended
    assert list(seen.attributes.items()) == MEASURED + [("hicache.acked", True), ("hicache.ack_delay_us", 0.0)]
    assert not seen.context.trace_flags.sampled
    assert r.exemplar_context is None  # no exemplar links to a span nobody exports


@BUILDERS
def test_the_sampler_sees_the_span_and_adds_its_attributes_and_trace_state(builder):
    context, parent = parent_context()
    sampler = FixedSampler(Decision.RECORD_AND_SAMPLE, extra={"sampler.rule": "r1"},
                           trace_state=TraceState([("vendor", "v1")]))
    rig = Rig(builder, sampler=sampler)
    span = rig.span(record(parent_context=context, ack_ns=END))
    assert sampler.asked == [(parent.trace_id, "hicache.onboard", SpanKind.INTERNAL, dict(MEASURED))]
    assert list(span.attributes.items()) == MEASURED + [("sampler.rule", "r1"), ("hicache.acked", True),
                                                         ("hicache.ack_delay_us", 0.0)]
    assert span.context.trace_state == TraceState([("vendor", "v1")])


@BUILDERS
def test_a_tracer_disabled_at_runtime_emits_nothing(builder):
    rig = Rig(builder)
    assert len(rig.emit(record())) == 1
    rig.provider._set_tracer_configurator(tracer_configurator=_disable_tracer_configurator)
    r = record()
    rig.builder.finish(r, rig.builder.begin(r))  # the builder asks the tracer per span, not once
    assert len(rig.exporter.get_finished_spans()) == 1 and len(rig.recorder.ended) == 1
    assert r.exemplar_context is None


def test_only_the_api_builder_calls_on_start():
    # documented: the fast path hands finished spans to on_end only
    api, fast = Rig(ApiSpanBuilder), Rig(FastSpanBuilder)
    api.emit(record())
    fast.emit(record())
    assert (api.recorder.started, len(api.recorder.ended)) == (["hicache.onboard"], 1)
    assert (fast.recorder.started, len(fast.recorder.ended)) == ([], 1)


# -- span limits: the provider's SpanLimits, both builders alike ------------------------------------------

LIMITS = {
    "exact-fit": dict(max_span_attributes=19),  # 17 + the two ack fields
    "one-short": dict(max_span_attributes=17),
    "value-length": dict(max_span_attribute_length=3),
    "one-event": dict(max_events=1),
    "no-events": dict(max_events=0),
    "everything": dict(max_span_attributes=4, max_span_attribute_length=5, max_events=1),
}


@pytest.mark.parametrize("limits", LIMITS.values(), ids=LIMITS.keys())
@pytest.mark.parametrize("kind", ["acked", "direct"])
def test_the_fast_builder_applies_limits_as_the_api_does(limits, kind):
    def emit(builder):
        r = record(ack_ns=END + 1_000) if kind == "acked" else record(expect_ack=False)
        return snapshot(Rig(builder, limits=SpanLimits(**limits)).span(r))

    assert emit(FastSpanBuilder) == emit(ApiSpanBuilder)


@BUILDERS
def test_attribute_count_limit_drops_the_oldest_attributes(builder):
    fits = Rig(builder, limits=SpanLimits(max_span_attributes=19)).span(record(ack_ns=END))
    assert (len(fits.attributes), fits.dropped_attributes) == (19, 0)
    short = Rig(builder, limits=SpanLimits(max_span_attributes=18)).span(record(ack_ns=END))
    assert list(short.attributes) == [k for k, _ in MEASURED[1:]] + ["hicache.acked", "hicache.ack_delay_us"]
    assert short.dropped_attributes == 1
    # a direct copy takes no ack fields: 17 attributes fit under a limit of 18
    direct = Rig(builder, limits=SpanLimits(max_span_attributes=18)).span(record(expect_ack=False))
    assert (list(direct.attributes.items()), direct.dropped_attributes) == (MEASURED_DIRECT, 0)


@BUILDERS
def test_value_length_limit_truncates_strings_only(builder):
    span = Rig(builder, limits=SpanLimits(max_span_attribute_length=3)).span(record(ack_ns=END))
    a = span.attributes
    assert (a["model"], a["hicache.direction"], a["hicache.timing_source"]) == ("qwe", "onb", "dev")
    assert a["hicache.pool.names"] == ("kv", "swa") and a["hicache.pool.tokens"] == (1408, 64)
    assert (a["hicache.bytes"], a["hicache.acked"]) == (161_480_704, True)


@BUILDERS
@pytest.mark.parametrize("max_events, kept, dropped", [(1, [("acked", END + 7)], 1), (0, [], 2)])
def test_event_count_limit_keeps_the_newest_events(builder, max_events, kept, dropped):
    span = Rig(builder, limits=SpanLimits(max_events=max_events)).span(record(ack_ns=END + 7))
    assert ([(e.name, e.timestamp) for e in span.events], span.dropped_events) == (kept, dropped)


UNLIMITED = {
    "attribute-count-unset": lambda mp: SpanLimits(max_span_attributes=SpanLimits.UNSET),
    "event-count-unset": lambda mp: SpanLimits(max_events=SpanLimits.UNSET),
    # an empty variable means "no limit" to the SDK
    "empty-env-variable": lambda mp: mp.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "") or SpanLimits(),
}


@pytest.mark.parametrize("limits", UNLIMITED.values(), ids=UNLIMITED.keys())
def test_unlimited_limits_on_the_api_builder(monkeypatch, limits):
    span = Rig(ApiSpanBuilder, limits=limits(monkeypatch)).span(record(ack_ns=END))
    assert (len(span.attributes), len(span.events), span.dropped_attributes, span.dropped_events) == (19, 2, 0, 0)


# A limit left unset is None in SpanLimits (SpanLimits.UNSET, or OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT= set
# empty): the fast builder once compared counts with it and raised TypeError, so every record was
# dropped as internal_error (no span, no transfer metrics).
@pytest.mark.parametrize("limits", UNLIMITED.values(), ids=UNLIMITED.keys())
def test_unlimited_limits_on_the_fast_builder(monkeypatch, limits):
    span = Rig(FastSpanBuilder, limits=limits(monkeypatch)).span(record(ack_ns=END))
    assert (len(span.attributes), len(span.events), span.dropped_attributes, span.dropped_events) == (19, 2, 0, 0)


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
PARENTS = {"none": lambda: None, "local": lambda: parent_context()[0],
           "remote": lambda: parent_context(remote=True)[0]}


def metered_rig(builder, monkeypatch, enabled):
    """A Rig whose TracerProvider has a MeterProvider, built with the SDK's own metrics on or off
    (the Tracer reads OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED when it is made)."""
    if enabled:
        monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
    else:
        monkeypatch.delenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", raising=False)
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    sampler = ScriptedSampler(DECISIONS * len(PARENTS))
    return Rig(builder, sampler=sampler, meter_provider=meter_provider), reader


def self_metrics(reader):
    """Every otel.sdk.span.* point: (name, attributes, value)."""
    data = reader.get_metrics_data()
    return sorted((m.name, tuple(sorted(p.attributes.items())), p.value)
                  for rm in (data.resource_metrics if data else ()) for sm in rm.scope_metrics
                  for m in sm.metrics if m.name.startswith("otel.sdk.span.") for p in m.data.data_points)


def emit_metered(builder, monkeypatch, enabled):
    """Each parent origin with each decision: the points once every span began, and once all finished."""
    rig, reader = metered_rig(builder, monkeypatch, enabled)
    begun = []
    for parent in PARENTS.values():
        for _decision in DECISIONS:
            r = record(parent_context=parent(), ack_ns=END)
            begun.append((r, rig.builder.begin(r)))
    live = self_metrics(reader)
    for r, state in begun:
        rig.builder.finish(r, state)
    return live, self_metrics(reader), len(rig.recorder.ended)


def test_the_fast_builder_records_the_sdks_span_metrics_as_the_api_does(monkeypatch):
    fast, api = emit_metered(FastSpanBuilder, monkeypatch, True), emit_metered(ApiSpanBuilder, monkeypatch, True)
    assert fast == api
    live, ended, recorded = fast
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


@BUILDERS
def test_no_sdk_span_metrics_unless_enabled(builder, monkeypatch):
    assert emit_metered(builder, monkeypatch, False) == ([], [], 6)


# -- choosing a builder --------------------------------------------------------------------------

@pytest.mark.parametrize("provider, fast_path, expected", [
    (lambda: TracerProvider(shutdown_on_exit=False), True, FastSpanBuilder),
    (lambda: TracerProvider(shutdown_on_exit=False), False, ApiSpanBuilder),
    (trace.NoOpTracerProvider, True, ApiSpanBuilder),
], ids=["sdk", "sdk-fast-path-off", "noop"])
def test_make_span_builder_uses_the_fast_path_only_on_an_sdk_provider(provider, fast_path, expected):
    assert type(make_span_builder(provider(), STATIC, fast_path)) is expected


def test_the_api_builder_works_on_any_provider():
    builder = ApiSpanBuilder(trace.NoOpTracerProvider(), STATIC)
    r = record(ack_ns=END)
    builder.finish(r, builder.begin(r))  # nothing to record, nothing raised
    assert not r.span_context.is_valid and r.exemplar_context is None
