"""Source-side outlier sampling (OTEL_HICACHE_SPAN_SAMPLING=outliers): errors and slow ops
always kept, a sampled parent's children kept, the provider's sampler deciding the rest;
metrics exact whatever is dropped, and every decision counted in otel_hicache.spans.

End to end on the simulated device (the ``harness`` fixture), unit tests of the span
builder's forced spans, of the running quantile and of the settings."""

from __future__ import annotations

import inspect
import random

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Decision, Sampler, SamplingResult
from opentelemetry.trace import NonRecordingSpan, SpanContext, StatusCode, TraceFlags

from otel_hicache import environment_variables as ev
from otel_hicache import semconv as sc
from otel_hicache.record import DEVICE_EVENT, DIRECT, OP, OP_FIELDS, context_tuple
from otel_hicache.sinks.consumer import Op
from otel_hicache.sinks.span_sampling import (BOUNDS_NS, REFRESH, WINDOW, OutlierPolicy, RecentQuantile,
                                              SpanSamplingSettings)
from otel_hicache.sinks.spans import SpanBuilder

SPANS = sc.SPANS[0]
BYTES = 1 << 20


def outliers(monkeypatch, slower_than_ms="0", quantile="0", mode="outliers"):
    monkeypatch.setenv(ev.OTEL_HICACHE_SPAN_SAMPLING, mode)
    monkeypatch.setenv(ev.OTEL_HICACHE_SPAN_KEEP_SLOWER_THAN_MS, slower_than_ms)
    monkeypatch.setenv(ev.OTEL_HICACHE_SPAN_KEEP_SLOWER_THAN_QUANTILE, quantile)


def op(h, duration_ms=1.0, direction="onboard", fail=False, tokens=64):
    """One device-timed op whose copy already finished (completed in submit order)."""
    now = h.device.time_ns()
    ev0, ev1 = h.device.copy(now - int(duration_ms * 1e6) - 1_000, duration_ms)
    if fail:
        ev1.raise_on_query = RuntimeError("device lost")
    return h.tel.submit(direction, {"kv": tokens}, BYTES, 64, ev0, ev1, True, expect_ack=False)


def decisions(h):
    """otel_hicache.spans as {(decision, reason): value}."""
    return {(p.attributes[sc.DECISION], p.attributes[sc.REASON]): p.value for p in h.points(SPANS)}


def kept(h):
    return {k[1]: v for k, v in decisions(h).items() if k[0] == sc.SPAN_KEPT and v}


def totals(h):
    """What the transfer metrics say, exemplars aside."""
    out = {}
    for name in ("hicache.transfer.bytes", "hicache.transfer.blocks", "hicache.transfer.tokens",
                 "hicache.transfer.busy_time", "hicache.transfer.inflight", "otel_hicache.records.failed"):
        out[name] = sorted((tuple(sorted(p.attributes.items())), p.value) for p in h.points(name))
    for name in ("hicache.transfer.duration", "hicache.transfer.bandwidth", "hicache.transfer.queue_wait"):
        out[name] = sorted((tuple(sorted(p.attributes.items())), p.count, round(p.sum, 9), tuple(p.bucket_counts))
                           for p in h.points(name))
    return out


def sampled_parent(flags=TraceFlags.SAMPLED):
    context = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0x00F067AA0BA902B7, is_remote=True,
                          trace_flags=TraceFlags(flags))
    return trace.use_span(NonRecordingSpan(context)), context


# -- the default: as before ------------------------------------------------------------------------

def test_the_default_is_all_spans_subject_to_the_sampler(harness):
    settings = SpanSamplingSettings.from_environment()
    assert (settings.mode, settings.slower_than_ms, settings.quantile) == ("all", 50.0, 0.99)
    assert settings.policy() is None
    h = harness()
    for i in range(10):
        op(h, duration_ms=100.0 if i == 3 else 1.0)
    op(h, fail=True)
    spans = h.finished()
    assert len(spans) == 11
    assert all(sc.SAMPLING_REASON not in s.attributes for s in spans)  # the span shape is unchanged
    assert decisions(h) == {("kept", "base"): 11, ("kept", "error"): 0, ("kept", "slow"): 0,
                            ("kept", "parent"): 0, ("kept", "request"): 0, ("skipped", "base"): 0}


def test_by_default_the_sampler_drops_errors_and_slow_ops_too(harness):
    h = harness(sampler=ALWAYS_OFF)
    op(h, duration_ms=100.0)
    op(h, fail=True)
    assert h.finished() == []
    assert decisions(h)[("skipped", "base")] == 2


def test_zero_series_carry_the_static_attributes(harness, monkeypatch):
    outliers(monkeypatch)
    h = harness(attributes={"tp_rank": 3, "pp_rank": 1})
    points = h.points(SPANS)
    assert {(p.attributes[sc.DECISION], p.attributes[sc.REASON]) for p in points} == set(sc.SPAN_DECISION_SERIES)
    assert all(p.value == 0 and p.attributes["tp_rank"] == 3 and p.attributes["pp_rank"] == 1 for p in points)


# -- outliers: what is kept ----------------------------------------------------------------------------

def test_errors_and_slow_ops_are_kept_with_an_always_off_base(harness, monkeypatch):
    outliers(monkeypatch, slower_than_ms="5")
    h = harness(sampler=ALWAYS_OFF)
    for i in range(40):
        op(h, duration_ms=9.0 if i in (7, 30) else 1.0, direction="offload" if i % 2 else "onboard")
    op(h, duration_ms=5.0)  # not slower than 5 ms
    op(h, fail=True)
    spans = h.finished()
    reasons = sorted(s.attributes[sc.SAMPLING_REASON] for s in spans)
    assert reasons == ["error", "slow", "slow"]
    [error] = [s for s in spans if s.attributes[sc.SAMPLING_REASON] == "error"]
    assert error.status.status_code is StatusCode.ERROR and error.attributes["error.type"] == "event_error"
    assert all(s.context.trace_flags.sampled for s in spans)
    assert {s.attributes["hicache.direction"] for s in spans if s.attributes[sc.SAMPLING_REASON] == "slow"} == {
        "offload", "onboard"}
    assert decisions(h) == {("kept", "error"): 1, ("kept", "slow"): 2, ("kept", "parent"): 0, ("kept", "request"): 0,
                            ("kept", "base"): 0, ("skipped", "base"): 39}
    # counters exact: every op counted, whatever span was dropped
    assert h.value("hicache.transfer.bytes") == 41 * BYTES
    assert h.value("hicache.transfer.duration", **{"hicache.direction": "onboard"}).count == 21
    assert h.value("otel_hicache.records.failed", reason="event_error") == 1


def test_slower_than_the_running_quantile_of_its_direction_is_kept(harness, monkeypatch):
    outliers(monkeypatch, quantile="0.99")  # no absolute threshold
    h = harness(sampler=ALWAYS_OFF)
    warmup = RecentQuantile(0.99).warmup
    for i in range(warmup + 2 * REFRESH):  # onboard ~1 ms, offload ~3 ms: each its own quantile
        op(h, duration_ms=1.0 + (i % 100) * 0.001, direction="onboard")
        op(h, duration_ms=3.0 + (i % 100) * 0.003, direction="offload")
    assert h.finished() == []  # nothing slower than the p99 of its own direction
    op(h, duration_ms=3.0, direction="onboard")  # 3x an onboard op (an ordinary offload)
    op(h, duration_ms=3.0, direction="offload")
    op(h, duration_ms=9.0, direction="offload")
    spans = h.finished()
    assert [(s.attributes["hicache.direction"], s.attributes[sc.SAMPLING_REASON], s.end_time - s.start_time)
            for s in spans] == [("onboard", "slow", 3_000_000), ("offload", "slow", 9_000_000)]
    assert kept(h) == {"slow": 2}


def test_no_relative_outliers_before_the_warmup(harness, monkeypatch):
    outliers(monkeypatch, quantile="0.99")
    h = harness(sampler=ALWAYS_OFF)
    for i in range(200):
        op(h, duration_ms=50.0 if i % 10 == 0 else 1.0)
    assert h.finished() == []


def test_a_sampled_parent_keeps_its_children(harness, monkeypatch):
    outliers(monkeypatch)
    h = harness(sampler=ALWAYS_OFF)  # not parent-based: only the policy keeps them
    scope, parent = sampled_parent()
    with scope:
        op(h)
    unsampled_scope, _ = sampled_parent(TraceFlags.DEFAULT)
    with unsampled_scope:
        op(h)
    op(h)
    [span] = h.finished()
    assert span.attributes[sc.SAMPLING_REASON] == "parent"
    assert span.parent.span_id == parent.span_id and span.context.trace_id == parent.trace_id
    assert decisions(h)[("kept", "parent")] == 1 and decisions(h)[("skipped", "base")] == 2


def test_without_outliers_a_sampled_parent_is_the_samplers_business(harness):
    h = harness(sampler=ALWAYS_OFF)
    scope, _ = sampled_parent()
    with scope:
        op(h)
    assert h.finished() == []


def test_the_base_share_follows_otel_traces_sampler(harness, monkeypatch):
    outliers(monkeypatch)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    h = harness()  # the TracerProvider reads the sampler from the environment
    sampler = h.tracer_provider.sampler
    assert sampler.get_description() == "TraceIdRatioBased{0.25}"
    n = 800
    for _ in range(n):
        op(h)
    spans = h.finished()
    assert 100 < len(spans) < 300  # 200 expected
    assert all(s.context.trace_id & sampler.TRACE_ID_LIMIT < sampler.bound for s in spans)
    assert all(s.attributes[sc.SAMPLING_REASON] == "base" for s in spans)
    counted = decisions(h)
    assert counted[("kept", "base")] == len(spans) and counted[("skipped", "base")] == n - len(spans)


def test_always_on_base_keeps_everything_with_the_same_span_as_before(harness, monkeypatch):
    h_all = harness(sampler=ALWAYS_ON)
    outliers(monkeypatch)
    h_outliers = harness(sampler=ALWAYS_ON)
    for h in (h_outliers, h_all):
        op(h)
    [a], [b] = h_outliers.finished(), h_all.finished()
    attrs = dict(a.attributes)
    assert attrs.pop(sc.SAMPLING_REASON) == "base"
    assert list(attrs.items()) == list(b.attributes.items())


# -- metrics exact, decisions counted ---------------------------------------------------------------

def test_metrics_are_the_same_whatever_spans_are_dropped(harness, monkeypatch):
    def workload(h):
        rng = random.Random(7)
        for i in range(300):
            op(h, duration_ms=rng.choice((0.5, 1.0, 2.0, 80.0)), direction="offload" if i % 3 else "onboard",
               tokens=64 * (1 + i % 5), fail=(i % 97 == 0))

    h_all = harness()
    workload(h_all)
    outliers(monkeypatch, slower_than_ms="50", quantile="0.99")
    h_out = harness(sampler=ALWAYS_OFF)
    workload(h_out)
    spans_all, spans_out = h_all.finished(), h_out.finished()
    # exemplars only link to spans that exist (read first: a collection resets them)
    exported = {s.context.span_id for s in spans_out}
    exemplars = {e.span_id for p in h_out.points("hicache.transfer.duration") for e in p.exemplars}
    assert exemplars and exemplars <= exported
    assert totals(h_out) == totals(h_all)
    assert len(spans_all) == 300
    counted = decisions(h_out)
    assert sum(counted.values()) == 300
    assert counted[("kept", "error")] == 4  # i = 0, 97, 194, 291
    assert sum(v for (d, _r), v in counted.items() if d == "kept") == len(spans_out)
    slow_all = sum(1 for s in spans_all if s.end_time - s.start_time > 50_000_000
                   and s.status.status_code is not StatusCode.ERROR)
    assert counted[("kept", "slow")] == slow_all


def test_a_skipped_span_builds_nothing(harness, monkeypatch):
    outliers(monkeypatch)
    h = harness(sampler=ALWAYS_OFF)
    from opentelemetry.sdk.trace import SpanProcessor

    class Seen(SpanProcessor):
        ended = 0

        def on_end(self, span):
            Seen.ended += 1

    h.tracer_provider.add_span_processor(Seen())
    for _ in range(20):
        op(h)
    assert h.finished() == [] and Seen.ended == 0
    assert all(not p.exemplars for p in h.points("hicache.transfer.duration"))


# -- the builder, unit ----------------------------------------------------------------------------------

class AskedSampler(Sampler):
    """Notes the attributes it is asked with; samples nothing, or everything with an attribute of its own."""

    def __init__(self, decision=Decision.DROP):
        self.decision, self.asked = decision, []

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None):
        self.asked.append(dict(attributes or {}))
        attrs = {**(attributes or {}), "sampler.rule": "r1"} if self.decision.is_recording() else None
        return SamplingResult(self.decision, attrs)

    def get_description(self):
        return "AskedSampler"


def record(duration_ns=1_000_000, error=None, parent=None):
    """A direct offload of 64 tokens as the span builder gets it: a ``consumer.Op`` made from the
    ``record.OP`` message the poller sends (``parent``: the SpanContext current at submit, or None)."""
    fields = dict(
        seq=1, direction="offload", origin=DIRECT, cause=sc.CAUSE_OTHER, cause_parts=None, tokens=64, blocks=1,
        pool_names=("kv",), pool_tokens=(64,), num_bytes=BYTES, page_size=64, io_backend=None, attributes=None,
        timing_source=DEVICE_EVENT, placement=None, start_ns=2_000, end_ns=2_000 + duration_ns,
        duration_ns=duration_ns, queue_wait_ns=None, error=error, submit_ns=1_000, ack_ns=None, expect_ack=False,
        parent=context_tuple(parent), request_links=(), request_links_dropped=0)
    assert tuple(fields) == OP_FIELDS
    return Op((OP, *fields.values()))


def rig(sampler, policy, provider=None):
    exporter = InMemorySpanExporter()
    provider = provider or TracerProvider(sampler=sampler, shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    counted = []
    return SpanBuilder(provider, {"tp_rank": 0}, policy, lambda d, r: counted.append((d, r))), exporter, counted


def emit(builder, r):
    builder.finish(r, builder.begin(r))


def test_a_base_span_keeps_the_samplers_own_attributes():
    sampler = AskedSampler(Decision.RECORD_AND_SAMPLE)
    b, exporter, counted = rig(sampler, OutlierPolicy(0, 0.0, {"tp_rank": 0}))
    emit(b, record())
    [span] = exporter.get_finished_spans()
    assert span.attributes["sampler.rule"] == "r1" and span.attributes[sc.SAMPLING_REASON] == "base"
    assert counted == [("kept", "base")]


def test_forced_spans_are_not_asked_and_take_the_parents_trace_state():
    from opentelemetry.trace import TraceState

    sampler = AskedSampler()
    b, exporter, counted = rig(sampler, OutlierPolicy(0, 0.0))
    state = TraceState([("vendor", "x")])
    parent = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED), trace_state=state)
    emit(b, record(parent=parent))
    emit(b, record(error="event_error"))
    spans = exporter.get_finished_spans()
    assert [s.attributes[sc.SAMPLING_REASON] for s in spans] == ["parent", "error"]
    assert spans[0].context.trace_state == state and spans[0].parent.span_id == 0xDEF
    assert spans[1].parent is None and len(spans[1].context.trace_state) == 0
    assert counted == [("kept", "parent"), ("kept", "error")]
    assert sampler.asked == []  # started on the keeping tracer: ALWAYS_ON, not the provider's sampler


def test_forced_spans_leave_the_providers_cached_tracer_alone():
    provider = TracerProvider(sampler=ALWAYS_OFF, shutdown_on_exit=False)
    b, exporter, _ = rig(None, OutlierPolicy(0, 0.0), provider)
    emit(b, record(error="event_error"))
    assert len(exporter.get_finished_spans()) == 1
    assert provider.get_tracer(sc.SCOPE_NAME, b._tracer.instrumentation_info.version).sampler is ALWAYS_OFF


def test_on_a_non_sdk_provider_the_count_says_what_happened():
    counted = []
    b = SpanBuilder(trace.NoOpTracerProvider(), {}, OutlierPolicy(0, 0.0), lambda d, r: counted.append((d, r)))
    emit(b, record(error="event_error"))
    assert counted == [("skipped", "error")]


@pytest.mark.skipif("meter_provider" not in inspect.signature(TracerProvider).parameters,
                    reason="this SDK release records no span metrics of its own")
def test_sdk_span_metrics_count_a_forced_span_as_sampled(monkeypatch):
    monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
    reader = InMemoryMetricReader()
    provider = TracerProvider(sampler=ALWAYS_OFF, shutdown_on_exit=False,
                              meter_provider=MeterProvider(metric_readers=[reader], shutdown_on_exit=False))
    b, _exporter, _ = rig(None, OutlierPolicy(0, 0.0), provider)
    for r in (record(), record(error="event_error"), record()):
        emit(b, r)
    data = reader.get_metrics_data()
    points = sorted((m.name, tuple(sorted(p.attributes.items())), p.value)
                    for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
                    if m.name.startswith("otel.sdk.span.") for p in m.data.data_points)
    started = {dict(a)["otel.span.sampling_result"]: v for n, a, v in points if n == "otel.sdk.span.started"}
    assert started == {"DROP": 2, "RECORD_AND_SAMPLE": 1}


# -- the running quantile ---------------------------------------------------------------------------

def test_quantile_flags_at_most_its_tail():
    rng = random.Random(1)
    q = RecentQuantile(0.99)
    flagged = [q.above(int(1e6 * rng.lognormvariate(0, 0.5))) for _ in range(50_000)]
    share = sum(flagged[q.warmup + REFRESH:]) / len(flagged[q.warmup + REFRESH:])
    assert 0.003 < share <= 0.0125  # the p99, to a bucket (9%)
    assert not any(flagged[:q.warmup])
    assert 1e6 < q.threshold_ns() < 1e6 * 4  # e^(2.33 x 0.5) = 3.2 ms


def test_quantile_forgets_an_old_regime():
    q = RecentQuantile(0.99)
    for _ in range(3 * WINDOW):
        q.above(1_000_000)
    slow = [q.above(3_000_000) for _ in range(3 * WINDOW)]
    assert slow[0] and not any(slow[1_000:])  # the new normal is learnt within a few hundred ops
    assert q.threshold_ns() >= 3_000_000 and len(BOUNDS_NS) == 225


def test_quantile_off_and_absolute_off_keeps_no_slow_op():
    policy = OutlierPolicy(0, 0.0)
    assert policy.quantiles is None
    assert policy.keep_reason(record(duration_ns=10**12), None) is None


# -- settings --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, raw", [
    (ev.OTEL_HICACHE_SPAN_SAMPLING, "sometimes"),
    (ev.OTEL_HICACHE_SPAN_KEEP_SLOWER_THAN_MS, "-1"),
    (ev.OTEL_HICACHE_SPAN_KEEP_SLOWER_THAN_QUANTILE, "1"),
    (ev.OTEL_HICACHE_SPAN_KEEP_SLOWER_THAN_QUANTILE, "99"),
    (ev.OTEL_HICACHE_SPAN_KEEP_SLOWER_THAN_QUANTILE, "nan"),
])
def test_malformed_settings_warn_and_use_the_default(monkeypatch, warnings_log, name, raw):
    monkeypatch.setenv(name, raw)
    settings = SpanSamplingSettings.from_environment()
    assert (settings.mode, settings.slower_than_ms, settings.quantile) == ("all", 50.0, 0.99)
    [message] = [r.getMessage() for r in warnings_log.records]
    assert name in message and repr(raw) in message


def test_settings_values(monkeypatch):
    monkeypatch.setenv(ev.OTEL_HICACHE_SPAN_SAMPLING, " Outliers ")
    monkeypatch.setenv(ev.OTEL_HICACHE_SPAN_KEEP_SLOWER_THAN_MS, "2.5")
    monkeypatch.setenv(ev.OTEL_HICACHE_SPAN_KEEP_SLOWER_THAN_QUANTILE, "0.999")
    settings = SpanSamplingSettings.from_environment()
    assert (settings.mode, settings.slower_than_ms, settings.quantile) == ("outliers", 2.5, 0.999)
    policy = settings.policy({"tp_rank": 1})
    assert policy.slower_than_ns == 2_500_000 and policy.quantiles["offload"].warmup == 10_000
    assert settings.policy() is not settings.policy()  # one per builder: its own quantiles
