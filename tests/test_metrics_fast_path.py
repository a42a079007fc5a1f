"""Unit tests of otel_hicache.metrics_fast_path: ``BoundHistogram`` values straight
into an SDK MeterProvider's aggregations, checked against the same values recorded
through ``Histogram.record`` on a twin provider (InMemoryMetricReader), and the
fallbacks to ``Histogram.record``."""

from __future__ import annotations

import pytest
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.metrics import (AlwaysOffExemplarFilter, AlwaysOnExemplarFilter, Histogram, MeterProvider,
                                       TraceBasedExemplarFilter)
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from opentelemetry.trace.propagation import set_span_in_context

from otel_hicache.metrics_fast_path import BoundHistogram, resolver_for

ATTRS = {"tp_rank": 0, "hicache.direction": "onboard"}
BUCKETS = (0.001, 0.01, 0.1, 1.0, 10.0)
VALUES = [0.003, 0.02, 7.0, 0.0004, 0.003, 12.5]
TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C


def sampled(span_id):
    """The exemplar context metrics.py passes for a sampled span."""
    return set_span_in_context(NonRecordingSpan(SpanContext(TRACE_ID, span_id, False,
                                                            TraceFlags(TraceFlags.SAMPLED))))


def delta_reader():
    return InMemoryMetricReader(preferred_temporality={Histogram: AggregationTemporality.DELTA})


class Rig:
    """An SDK MeterProvider with one histogram; notes the values that went through Histogram.record."""

    def __init__(self, *readers, views=(), exemplar_filter=None):
        self.readers = list(readers) or [InMemoryMetricReader()]
        kwargs = {} if exemplar_filter is None else {"exemplar_filter": exemplar_filter}
        self.provider = MeterProvider(metric_readers=self.readers, views=list(views), shutdown_on_exit=False,
                                      **kwargs)
        self.histogram = self.provider.get_meter("unit").create_histogram(
            "h", unit="s", explicit_bucket_boundaries_advisory=BUCKETS)
        self.via_record = []
        record = self.histogram.record

        def spy(value, attributes=None, context=None):
            self.via_record.append(value)
            record(value, attributes, context=context)

        self.histogram.record = spy

    def bound(self, attributes=ATTRS, enabled=True):
        return BoundHistogram(self.histogram, attributes, resolver_for(self.provider, enabled))

    def points(self, reader=None, name="h"):
        data = (reader or self.readers[0]).get_metrics_data()
        return [p for rm in (data.resource_metrics if data else ()) for sm in rm.scope_metrics
                for m in sm.metrics if m.name == name for p in m.data.data_points]

    def summary(self, reader=None, name="h"):
        return [(dict(p.attributes), p.count, p.sum, p.min, p.max, list(p.bucket_counts))
                for p in self.points(reader, name)]


def through_record(values, contexts=None, **rig_kwargs):
    """What Histogram.record alone makes of ``values``: the reference."""
    rig = Rig(**rig_kwargs)
    for value, context in zip(values, contexts or [None] * len(values)):
        rig.histogram.record(value, ATTRS, context=context)
    return rig


def record_all(bound, values, contexts=None):
    """Record, then flush the values kept for the bulk add, as the worker's metrics flush does."""
    for value, context in zip(values, contexts or [None] * len(values)):
        bound.record(value, context)
    bound.flush_values()


# -- resolver ---------------------------------------------------------------------------------

def test_a_resolver_only_for_an_sdk_meter_provider_with_the_fast_path_on():
    provider = Rig().provider
    assert resolver_for(provider, False) is None
    assert resolver_for(NoOpMeterProvider(), True) is None
    assert resolver_for(object(), True) is None
    assert resolver_for(provider, True).trace_based is True  # the default filter: no per-value call needed
    assert resolver_for(Rig(exemplar_filter=AlwaysOnExemplarFilter()).provider, True).trace_based is False


# -- the bound path ------------------------------------------------------------------------------

def test_the_first_value_goes_through_record_the_rest_straight_to_the_aggregation():
    rig = Rig()
    record_all(rig.bound(), VALUES)
    assert rig.via_record == VALUES[:1]
    # the same point as Histogram.record makes: count, sum (same additions, same order), min, max, buckets
    assert rig.summary() == through_record(VALUES).summary()
    assert rig.summary()[0][1:] == (6, sum(VALUES), 0.0004, 12.5, [1, 2, 1, 0, 1, 1])


def test_with_the_fast_path_off_every_value_goes_through_record():
    rig = Rig()
    record_all(rig.bound(enabled=False), VALUES)
    assert rig.via_record == VALUES
    assert rig.summary() == through_record(VALUES).summary()


def test_every_reader_and_every_matching_view_gets_each_value():
    views = [View(instrument_name="h"), View(instrument_name="h", name="h.copy")]
    rig = Rig(InMemoryMetricReader(), InMemoryMetricReader(), views=views)
    record_all(rig.bound(), VALUES)
    assert rig.via_record == VALUES[:1]
    expected = through_record(VALUES).summary()
    for reader in rig.readers:
        assert rig.summary(reader, "h") == rig.summary(reader, "h.copy") == expected


def test_a_view_keeping_some_attribute_keys_binds_the_series_it_makes():
    rig = Rig(views=[View(instrument_name="h", attribute_keys={"hicache.direction"})])
    record_all(rig.bound(ATTRS), VALUES)
    record_all(rig.bound({**ATTRS, "tp_rank": 1}), VALUES)  # the same series once tp_rank is dropped
    assert rig.via_record == VALUES[:1] * 2
    [(attributes, count, total, *_)] = rig.summary()
    assert (attributes, count, total) == ({"hicache.direction": "onboard"}, 12, sum(VALUES + VALUES))


@pytest.mark.parametrize("readers", [lambda: [delta_reader()], lambda: [InMemoryMetricReader(), delta_reader()]],
                         ids=["delta", "cumulative-and-delta"])
def test_delta_temporality_keeps_every_value_on_record(readers):
    # the SDK discards delta aggregations on collect: a bound value would land in a dead one
    rig = Rig(*readers())
    bound = rig.bound()
    record_all(bound, VALUES[:4])
    first = [rig.summary(reader) for reader in rig.readers]
    record_all(bound, VALUES[4:])
    second = [rig.summary(reader) for reader in rig.readers]
    assert rig.via_record == VALUES
    assert [s[0][1] for s in first] == [4] * len(rig.readers)
    assert [s[0][1] for s in second] == [6, 2][-len(rig.readers):]  # cumulative 6, delta the 2 new ones


def test_revalidate_keeps_a_live_binding():
    rig = Rig()
    bound = rig.bound()
    bound.revalidate()  # nothing bound yet: a no-op
    record_all(bound, VALUES[:2])
    bound.revalidate()
    record_all(bound, VALUES[2:])
    assert rig.via_record == VALUES[:1]
    assert rig.summary()[0][1] == 6


def test_revalidate_rebinds_once_the_sdk_replaced_the_aggregation():
    rig = Rig()
    bound = rig.bound()
    record_all(bound, VALUES[:2])
    for match, key, _aggregation in bound._bound:  # the SDK drops the aggregation (as on a delta collect)
        del match._attributes_aggregation[key]
    bound.revalidate()
    record_all(bound, VALUES[2:4])
    assert rig.via_record == [VALUES[0], VALUES[2]]  # the first after the drop recreates it through record
    # only the two values after the drop; without revalidate() both would have gone to the dropped one
    assert rig.summary()[0][1:3] == (2, VALUES[2] + VALUES[3])


def test_values_without_an_exemplar_wait_for_the_flush_then_add_as_record_would():
    rig = Rig()
    bound = rig.bound()
    for value in VALUES:
        bound.record(value, None)
    assert rig.summary()[0][1] == 1  # the first went through record; the rest are kept
    bound.flush_values()
    assert rig.summary() == through_record(VALUES).summary()  # count, sum (same order), min, max, buckets
    bound.flush_values()  # nothing kept: nothing added twice
    assert rig.summary()[0][1] == 6


def test_a_sampled_value_waits_for_the_flush_with_its_exemplar():
    rig = Rig()
    bound = rig.bound()
    record_all(bound, VALUES[:1])
    bound.record(0.02, sampled(7))  # an exemplar candidate: kept with its time and context
    bound.record(0.03, None)
    assert rig.via_record == VALUES[:1] and rig.summary()[0][1] == 1
    bound.flush_values()
    [point] = rig.points()  # (a collection resets the exemplars: read once)
    assert point.count == 3 and [(e.value, e.span_id) for e in point.exemplars] == [(0.02, 7)]


def test_many_candidates_leave_what_record_leaves_value_for_value():
    # interleaved sampled and unsampled values over every bucket, two readers: the same counts,
    # sums (added in record order), min, max and exemplars (each bucket's last sampled value)
    # (and the values record() drops with a warning: infinite, NaN, negative go to it)
    dropped = [float("inf"), float("nan"), -1.0]
    values = [(i * 7919 % 1000) / 37.0 for i in range(400)] + [0.0, 10.0, 0.001, 0.005] + dropped
    contexts = [sampled(i + 1) if i % 3 else None for i in range(len(values))]
    rig = Rig(InMemoryMetricReader(), InMemoryMetricReader())
    record_all(rig.bound(), values, contexts)
    reference = through_record(values, contexts)
    assert rig.via_record == values[:1] + dropped
    expected = exemplars(reference)
    assert len(expected) == len(BUCKETS) + 1
    for reader in rig.readers:
        [point] = rig.points(reader)  # (a collection resets the exemplars: read once)
        assert [(e.value, e.span_id, e.trace_id, e.filtered_attributes or None, e.time_unix_nano > 0)
                for e in point.exemplars] == [x + (True,) for x in expected]
        assert rig.summary(reader) == reference.summary()


def test_with_another_reservoir_each_candidate_is_aggregated_at_once():
    view = View(instrument_name="h", exemplar_reservoir_factory=lambda _aggregation: lambda **_: _simple_reservoir())
    rig = Rig(views=[view])
    bound = rig.bound()
    record_all(bound, VALUES[:1])
    bound.record(0.02, sampled(7))
    bound.record(0.03, None)  # no exemplar: still added in bulk
    [point] = rig.points()
    assert point.count == 2 and [e.span_id for e in point.exemplars] == [7]
    bound.flush_values()
    assert rig.points()[0].count == 3


def test_kept_values_go_through_record_when_the_binding_goes_stale():
    rig = Rig()
    bound = rig.bound()
    record_all(bound, VALUES[:1])
    for value in VALUES[1:4]:
        bound.record(value, None)  # kept for the flush
    bound.record(0.02, sampled(9))  # a candidate: kept with its context
    late = InMemoryMetricReader()
    rig.provider.add_metric_reader(late)
    bound.revalidate()  # stale: the kept values go where the SDK routes them now, the new reader too
    assert rig.via_record == VALUES[:4] + [0.02]
    [point] = rig.points(late)  # (a collection resets the exemplars: read once)
    assert point.count == 4 and [e.span_id for e in point.exemplars] == [9]  # its exemplar kept
    assert rig.summary()[0][1] == 5


@pytest.mark.parametrize("rig", [lambda: Rig(exemplar_filter=AlwaysOnExemplarFilter()),
                                 lambda: Rig(views=[View(instrument_name="h",
                                                         aggregation=ExponentialBucketHistogramAggregation())])],
                         ids=["every-value-a-candidate", "exponential-histogram"])
def test_no_values_are_kept_where_each_may_be_an_exemplar_or_the_aggregation_is_another(rig):
    rig = rig()
    bound = rig.bound()
    for value in VALUES:
        bound.record(value, None)
    assert rig.points()[0].count == 6  # each aggregated at once


@pytest.mark.parametrize("failure", ["raises", "no-aggregation"])
def test_unexpected_internals_fall_back_to_record_for_good(failure):
    rig = Rig()
    resolver = resolver_for(rig.provider, True)
    asked = []

    def aggregations(instrument, attributes, storages):
        asked.append(dict(attributes))
        if failure == "raises":
            raise AttributeError("_attributes_aggregation")
        return None

    resolver.aggregations = aggregations
    record_all(BoundHistogram(rig.histogram, ATTRS, resolver), VALUES)
    assert asked == [ATTRS]  # asked once, then never again
    assert rig.via_record == VALUES
    assert rig.summary() == through_record(VALUES).summary()


def test_an_attribute_set_past_the_cardinality_limit_stays_on_record():
    rig = Rig(views=[View(instrument_name="h", aggregation_cardinality_limit=1)])
    record_all(rig.bound(ATTRS), VALUES)
    record_all(rig.bound({**ATTRS, "tp_rank": 1}), VALUES)  # lands in the overflow point
    assert rig.via_record == VALUES[:1] + VALUES
    by_attributes = {tuple(sorted(attrs.items())): count for attrs, count, *_ in rig.summary()}
    assert by_attributes == {tuple(sorted(ATTRS.items())): 6, (("otel.metric.overflow", True),): 6}


# -- exemplars ----------------------------------------------------------------------------------

# the unsampled value (7.0) is alone in its bucket: the SDK's reservoir keeps a bucket's
# last span id when a value without a span replaces its value
CONTEXTS = [sampled(1), sampled(2), None, sampled(3), sampled(5), sampled(4)]

EXPECTED_EXEMPLARS = {  # (value, span id) per bucket, the bucket's last sampled value
    "trace-based": [(0.0004, 3), (0.003, 5), (0.02, 2), (12.5, 4)],
    "always-on": [(0.0004, 3), (0.003, 5), (0.02, 2), (7.0, None), (12.5, 4)],
    "always-off": [],
}
FILTERS = {"trace-based": TraceBasedExemplarFilter, "always-on": AlwaysOnExemplarFilter,
           "always-off": AlwaysOffExemplarFilter}


def exemplars(rig):
    """The point's exemplars (a collection resets them: read once)."""
    [point] = rig.points()
    return [(e.value, e.span_id, e.trace_id, e.filtered_attributes or None) for e in point.exemplars]


@pytest.mark.parametrize("name", FILTERS)
def test_exemplars_are_those_record_would_keep(name):
    rig = Rig(exemplar_filter=FILTERS[name]())
    record_all(rig.bound(), VALUES, CONTEXTS)
    assert rig.via_record == VALUES[:1]
    kept = exemplars(rig)
    assert kept == exemplars(through_record(VALUES, CONTEXTS, exemplar_filter=FILTERS[name]()))
    assert [(value, span_id) for value, span_id, *_ in kept] == EXPECTED_EXEMPLARS[name]
    assert [trace_id for _, span_id, trace_id, _ in kept if span_id is not None] == [TRACE_ID] * sum(
        1 for _, span_id in EXPECTED_EXEMPLARS[name] if span_id is not None)


def test_exemplars_keep_the_attributes_a_view_dropped():
    # a bound value's Measurement carries the attribute set, as Histogram.record's does: the exemplar
    # exports the keys the view dropped ({'tp_rank': 0}) as its filtered_attributes
    view = [View(instrument_name="h", attribute_keys={"hicache.direction"})]
    rig = Rig(views=view)
    record_all(rig.bound(), VALUES, CONTEXTS)
    assert exemplars(rig) == exemplars(through_record(VALUES, CONTEXTS, views=view))


def test_a_reader_added_later_gets_the_bound_values():
    # add_metric_reader() replaces the consumer's reader storages (copy-on-write): revalidate() sees
    # the new dict and drops the binding, the next value goes through Histogram.record and binds again
    rig = Rig()
    bound = rig.bound()
    record_all(bound, VALUES[:1])
    late = InMemoryMetricReader()
    rig.provider.add_metric_reader(late)
    bound.revalidate()  # what the worker does every cycle
    record_all(bound, VALUES[1:])
    assert rig.summary(late) == through_record(VALUES[1:]).summary()  # all it could see


def _transfer_metrics(monkeypatch, views=()):
    """TransferMetrics on an SDK MeterProvider, its duration histogram bound for offloads, and
    the BoundHistogram.revalidate calls from then on."""
    from otel_hicache.metrics import TransferMetrics

    provider = MeterProvider(metric_readers=[InMemoryMetricReader()], views=list(views), shutdown_on_exit=False)
    metrics = TransferMetrics(provider, {"tp_rank": 0})
    bound = metrics._histogram(metrics.duration, metrics._by_direction["offload"])  # pylint: disable=protected-access
    bound.record(0.003, None)  # binds
    checked = []
    revalidate = BoundHistogram.revalidate
    monkeypatch.setattr(BoundHistogram, "revalidate", lambda self: (checked.append(self), revalidate(self))[1])
    return provider, metrics, bound, checked


def test_bulk_bindings_are_checked_at_the_flush_not_every_cycle(monkeypatch):
    # every value of a bulk binding waits for the flush, so the worker's per-cycle re-check
    # skips it; the flush re-checks it before the values go in (a reader added in between
    # gets them, through Histogram.record)
    from otel_hicache import semconv as sc

    provider, metrics, bound, checked = _transfer_metrics(monkeypatch)
    assert bound.bulk
    metrics.revalidate()  # a worker cycle
    assert checked == []
    bound.record(0.02, sampled(7))
    late = InMemoryMetricReader()
    provider.add_metric_reader(late)
    metrics.flush()
    assert checked == [bound]
    [point] = [p for rm in late.get_metrics_data().resource_metrics for sm in rm.scope_metrics
               for m in sm.metrics if m.name == sc.TRANSFER_DURATION[0] for p in m.data.data_points]
    assert point.count == 1 and [e.span_id for e in point.exemplars] == [7]


def test_a_binding_that_aggregates_at_once_is_checked_every_cycle(monkeypatch):
    from otel_hicache import semconv as sc

    view = View(instrument_name=sc.TRANSFER_DURATION[0],
                exemplar_reservoir_factory=lambda _aggregation: lambda **_: _simple_reservoir())
    _provider, metrics, bound, checked = _transfer_metrics(monkeypatch, [view])
    assert not bound.bulk  # its exemplar candidates are aggregated at once
    metrics.revalidate()
    assert checked == [bound]


def _simple_reservoir():
    from opentelemetry.sdk.metrics._internal.exemplar import SimpleFixedSizeExemplarReservoir

    return SimpleFixedSizeExemplarReservoir()
