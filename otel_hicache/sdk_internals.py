"""Every private OpenTelemetry SDK/API attribute otel-hicache touches, in one place.

The fast paths (:mod:`.spans`, :mod:`.metrics_fast_path`, the context read of
:mod:`.telemetry`) and the batch span processor's queue use SDK internals
that any minor release may rename or re-type. So the SDK's shape is checked
once (each part on its first use: :func:`available`; all of it: :func:`report`):
its version is in the range these accesses were checked against, and the
classes have the attributes and signatures relied on. Each accessor below
returns None (or does nothing) when its part of the check failed, and the
caller takes the public API, whose output is the same (only slower, or
without the queue-full count).

Two kinds of access:

* version-gated (``context``, ``spans``, ``metrics``, ``batch_queue``): a
  wrong guess would silently change what is exported, so they are used only on
  a known SDK version whose shape passed the check;
* value-checked writes (the metric reader's exporter and shutdown event after
  fork): used on any version, because the value replaced is itself checked (a
  ``MetricExporter``, an ``Event``) and there is no public equivalent to fall
  back to.
"""

from __future__ import annotations

import inspect
import re
import threading
from typing import Any, Callable, Mapping, NamedTuple

# SDK (major, minor) releases whose internals these accesses were checked
# against: [first, last]. A newer minor release uses the public API until checked.
KNOWN_SDK = ((1, 45), (1, 45))

AREAS = ("context", "spans", "metrics", "batch_queue", "threads")


class Report(NamedTuple):
    """The result of the one shape check."""

    sdk_version: str | None
    known_version: bool
    problems: Mapping[str, tuple[str, ...]]  # area -> what did not match (empty: usable)

    def available(self, area: str) -> bool:
        return self.known_version and not self.problems.get(area)

    def summary(self) -> str:
        bad = "; ".join(f"{a}: {', '.join(p)}" for a, p in self.problems.items() if p)
        if not self.known_version:
            first, last = (f"{major}.{minor}.x" for major, minor in KNOWN_SDK)
            checked = first if first == last else f"{first} to {last}"
            return (f"opentelemetry-sdk {self.sdk_version} is outside the checked range {checked}: "
                    f"public API only" + (f" ({bad})" if bad else ""))
        return bad or "all fast paths available"


_report: Report | None = None
_areas: dict[str, tuple[str, ...]] = {}  # each area checked on its first use (an import of otel_hicache stays light)
_version: tuple[str | None, bool] | None = None
# No lock around the checks: they are pure and idempotent (two threads may both run one, the
# same result is stored twice), and a lock held by the worker while the host forks would stay
# held in the child forever (tests/test_faults.py's forked multiprocessing child hung on it).


def report() -> Report:
    """The SDK's shape: every area, each checked once."""
    global _report
    if _report is None:
        version, known = _sdk_version()
        _report = Report(version, known, {area: _area(area) for area in AREAS})
    return _report


def available(area: str) -> bool:
    """Whether the accessors of ``area`` may be used (the version known, the area's shape as expected)."""
    if _report is not None:  # set by report() (or a test)
        return _report.available(area)
    return _sdk_version()[1] and not _area(area)


def _version_tuple(version: str) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else ()


def _sdk_version() -> tuple[str | None, bool]:
    global _version
    if _version is None:
        try:
            from opentelemetry.sdk.version import __version__ as version
        except Exception:  # no SDK: nothing internal to use
            _version = (None, False)
        else:
            first, last = KNOWN_SDK
            _version = (version, first <= _version_tuple(version)[:2] <= last)
    return _version


def _area(area: str) -> tuple[str, ...]:
    found = _areas.get(area)
    if found is None:
        check = {"context": _check_context, "spans": _check_spans, "metrics": _check_metrics,
                 "batch_queue": _check_batch_queue, "threads": _check_threads}[area]
        try:
            found = tuple(check())
        except Exception as exc:  # an import or signature that changed
            found = (f"{type(exc).__name__}: {exc}",)
        _areas[area] = found
    return found


def _has_params(function: Any, *names: str) -> bool:
    return set(names) <= set(inspect.signature(function).parameters)


def _lacks(obj: Any, *needed: str) -> list[str]:
    """Which of ``needed`` the source of ``obj`` does not mention (none when there is no
    source to read, e.g. a .pyc-only install: then only the accessors' own checks guard)."""
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError):
        return []
    return [n for n in needed if n not in source]


# -- the current context: the runtime's ContextVar (opentelemetry/context/contextvars_context.py) -----

def _check_context() -> list[str]:
    from contextvars import ContextVar

    from opentelemetry import context as otel_context
    from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext

    runtime = getattr(otel_context, "_RUNTIME_CONTEXT", None)
    if type(runtime) is not ContextVarsRuntimeContext:  # OTEL_PYTHON_CONTEXT chose another one
        return ["_RUNTIME_CONTEXT is not the ContextVarsRuntimeContext"]
    if not isinstance(getattr(runtime, "_current_context", None), ContextVar):
        return ["ContextVarsRuntimeContext._current_context is not a ContextVar"]
    return []


def context_getter() -> Callable[[], Any] | None:
    """The ContextVar's own ``get`` (half the cost of ``context.get_current()``), or None."""
    if not available("context"):
        return None
    from opentelemetry import context as otel_context

    getter = otel_context._RUNTIME_CONTEXT._current_context.get  # pylint: disable=protected-access
    try:
        getter()
    except LookupError:  # no default value: get_current() handles that
        return None
    return getter


# -- the span fast path: an SDK Tracer's parts (opentelemetry/sdk/trace/__init__.py, Tracer) -----------

class TracerParts(NamedTuple):
    sampler: Any
    id_generator: Any
    resource: Any
    span_processor: Any
    scope: Any
    limits: Any
    is_enabled: Callable[[], bool]
    # the tracer's otel.sdk.span.* self-metrics (opentelemetry/sdk/trace/_tracer_metrics.py):
    # start_span(parent_span_context, sampling_decision) -> the callback to call when the span
    # ends; None when they are off (NoOpTracerMetrics, OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED unset)
    metrics: Any


def _check_spans() -> list[str]:
    from opentelemetry import trace
    from opentelemetry.attributes import BoundedAttributes
    from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits, Tracer, _Span
    from opentelemetry.sdk.trace.id_generator import IdGenerator
    from opentelemetry.sdk.util import BoundedList

    problems = []
    try:
        from opentelemetry.sdk.trace import _tracer_metrics
    except ImportError:
        problems.append("opentelemetry.sdk.trace._tracer_metrics")
    else:
        for name in ("NoOpTracerMetrics", "TracerMetrics"):
            cls = getattr(_tracer_metrics, name, None)
            if cls is None or not _has_params(cls.start_span, "parent_span_context", "sampling_decision"):
                problems.append(f"_tracer_metrics.{name}.start_span(parent_span_context, sampling_decision)")
    # the API path: one start_span() per span after sampling, its callback called by Span.end()
    if _lacks(Tracer.__init__, "self._tracer_metrics = "):
        problems.append("Tracer._tracer_metrics")
    if _lacks(Tracer.start_span, "self._tracer_metrics.start_span(parent_span_context, sampling_result.decision)"):
        problems.append("Tracer.start_span: _tracer_metrics.start_span(parent_span_context, decision)")
    if _lacks(_Span.end, "self._record_end_metrics()"):
        problems.append("_Span.end: its record_end_metrics callback")
    if not _has_params(Tracer.__init__, "sampler", "resource", "span_processor", "id_generator",
                       "instrumentation_info", "span_limits", "instrumentation_scope"):
        problems.append("Tracer.__init__ parameters")
    if not callable(getattr(Tracer, "_is_enabled", None)):
        problems.append("Tracer._is_enabled")
    if not hasattr(IdGenerator, "is_trace_id_random") or not hasattr(trace.TraceFlags, "RANDOM_TRACE_ID"):
        problems.append("random trace id flag (IdGenerator.is_trace_id_random, TraceFlags.RANDOM_TRACE_ID)")
    if not _has_params(ReadableSpan.__init__, "name", "context", "parent", "resource", "attributes", "events",
                       "kind", "status", "start_time", "end_time", "instrumentation_scope"):
        problems.append("ReadableSpan.__init__ parameters")
    if not _has_params(Event.__init__, "name", "attributes", "timestamp"):
        problems.append("Event.__init__ parameters")
    if not _has_params(BoundedAttributes.__init__, "maxlen", "attributes", "immutable", "max_value_len"):
        problems.append("BoundedAttributes.__init__ parameters")
    if not callable(getattr(BoundedList, "from_seq", None)):
        problems.append("BoundedList.from_seq")
    limits = SpanLimits()
    if not all(hasattr(limits, a) for a in ("max_span_attributes", "max_span_attribute_length", "max_events", "max_links")):
        problems.append("SpanLimits attributes")
    return problems


def tracer_parts(tracer: Any) -> TracerParts | None:
    """What the span fast path needs of an SDK ``Tracer``, or None (any other tracer, or an SDK not checked)."""
    if not available("spans"):
        return None
    from opentelemetry.sdk.trace import Tracer
    from opentelemetry.sdk.trace._tracer_metrics import NoOpTracerMetrics

    if not isinstance(tracer, Tracer):
        return None
    try:
        metrics = tracer._tracer_metrics  # pylint: disable=protected-access
        if isinstance(metrics, NoOpTracerMetrics):
            metrics = None  # resolved once: no call per span while the SDK's own metrics are off
        elif not callable(getattr(metrics, "start_span", None)):
            return None  # the API path would record them somehow: not the fast path's to guess
        return TracerParts(
            tracer.sampler, tracer.id_generator, tracer.resource, tracer.span_processor,
            tracer._instrumentation_scope,  # pylint: disable=protected-access
            tracer._span_limits,  # pylint: disable=protected-access
            tracer._is_enabled,  # pylint: disable=protected-access
            metrics,
        )
    except AttributeError:
        return None


# -- the histogram fast path: a MeterProvider's aggregations ---------------------------------------------
# (opentelemetry/sdk/metrics/_internal/{__init__,measurement_consumer,metric_reader_storage,
#  _view_instrument_match,aggregation,measurement}.py)

class MeterParts(NamedTuple):
    # reader -> MetricReaderStorage, the measurement consumer's dict of the moment: add_metric_reader()
    # and remove_metric_reader() replace it (copy-on-write), so it is read again, never kept
    reader_storages: Callable[[], Mapping[Any, Any]]
    exemplar_filter: Any
    hash_attributes: Callable[[Mapping[str, Any]], Any]
    # Measurement's own cleaning of an attribute set (what Histogram.record's measurements carry)
    clean_attributes: Callable[[Any, Mapping[str, Any] | None], Any]
    # Measurement(value, time_unix_nano, instrument, context, attributes), the attributes cleaned
    # already (by clean_attributes, once per attribute set): not cleaned again per value
    measurement: Callable[[float, int, Any, Any, Any], Any]


def _check_metrics() -> list[str]:
    import dataclasses

    from opentelemetry.sdk.metrics._internal import _view_instrument_match, aggregation, measurement_consumer
    from opentelemetry.sdk.metrics._internal._view_instrument_match import _ViewInstrumentMatch
    from opentelemetry.sdk.metrics._internal.measurement import Measurement
    from opentelemetry.sdk.metrics._internal.metric_reader_storage import MetricReaderStorage

    problems = []
    if not callable(getattr(_view_instrument_match, "_hash_attributes", None)):
        problems.append("_view_instrument_match._hash_attributes")
    fields = [f.name for f in dataclasses.fields(Measurement)] if dataclasses.is_dataclass(Measurement) else []
    if fields != ["value", "time_unix_nano", "instrument", "context", "attributes"]:
        problems.append("Measurement fields")
    # __post_init__ only cleans the attributes (what clean_attributes does once, and measurement skips)
    post_init = getattr(Measurement, "__post_init__", None)
    if post_init is None:
        problems.append("Measurement.__post_init__")
    elif _lacks(post_init, "_clean_attribute_value("):
        problems.append("Measurement.__post_init__ (_clean_attribute_value)")
    consumer = getattr(measurement_consumer, "SynchronousMeasurementConsumer", None)
    if consumer is None:
        problems.append("measurement_consumer.SynchronousMeasurementConsumer")
    else:
        # every measurement to every reader's storage; a reader added or removed: a new dict
        for method, needed in (("consume_measurement", "self._reader_storages.values()"),
                               ("add_metric_reader", "self._reader_storages = "),
                               ("remove_metric_reader", "self._reader_storages = ")):
            if not callable(getattr(consumer, method, None)) or _lacks(getattr(consumer, method), needed):
                problems.append(f"SynchronousMeasurementConsumer.{method} (_reader_storages, copy-on-write)")
    if not callable(getattr(MetricReaderStorage, "_get_or_init_view_instrument_match", None)):
        problems.append("MetricReaderStorage._get_or_init_view_instrument_match")
    problems += [f"_ViewInstrumentMatch{n[4:]}" for n in _lacks(
        _ViewInstrumentMatch.__init__, "self._attributes_aggregation", "self._reset_on_collect", "self._view")]
    # what BoundHistogram mirrors of Histogram.record before it consumes a measurement
    from opentelemetry.sdk.metrics._internal.instrument import Histogram, _Synchronous

    if not callable(getattr(_Synchronous, "_is_enabled", None)):
        problems.append("instrument._Synchronous._is_enabled")
    problems += [f"Histogram.record ({n})" for n in _lacks(
        Histogram.record, "if not self._is_enabled():", "if not math.isfinite(amount):", "if amount < 0:",
        "self._measurement_consumer.consume_measurement(")]
    if not _has_params(aggregation._Aggregation.aggregate,  # pylint: disable=protected-access
                       "measurement", "should_sample_exemplar"):
        problems.append("_Aggregation.aggregate(measurement, should_sample_exemplar)")
    # what histogram_adder() does for many values at once, statement for statement
    explicit = getattr(aggregation, "_ExplicitBucketHistogramAggregation", None)
    if explicit is None:
        problems.append("aggregation._ExplicitBucketHistogramAggregation")
    else:
        problems += [f"_ExplicitBucketHistogramAggregation.aggregate ({n})" for n in _lacks(
            explicit.aggregate, "with self._lock:", "if self._value is None:",
            "self._value = self._get_empty_bucket_counts()", "self._sum += measurement_value",
            "if self._record_min_max:", "self._min = min(self._min, measurement_value)",
            "self._max = max(self._max, measurement_value)",
            "self._value[bisect_left(self._boundaries, measurement_value)] += 1",
            "self._sample_exemplar(measurement, should_sample_exemplar)")]
        problems += [f"_ExplicitBucketHistogramAggregation._sample_exemplar ({n})" for n in _lacks(
            explicit._sample_exemplar, "if should_sample_exemplar:", "self._reservoir.offer(",  # pylint: disable=protected-access
            "measurement.value,", "measurement.time_unix_nano,", "measurement.attributes,", "measurement.context,")]
    # what exemplar_offer() relies on: the aligned reservoir keeps each bucket's last offer
    from opentelemetry.sdk.metrics._internal.exemplar import exemplar_reservoir

    for name, method, needed in (
            ("AlignedHistogramBucketExemplarReservoir", "_find_bucket_index",
             ("for index, boundary in enumerate(self._boundaries):", "if value <= boundary:", "return index",
              "return len(self._boundaries)")),
            ("FixedSizeExemplarReservoirABC", "offer",
             ("with self._lock:", "self._reservoir_storage[index].offer(value, time_unix_nano, attributes, context)")),
            ("ExemplarBucket", "offer", ("self.__value = value", "self.__time_unix_nano = time_unix_nano",
                                         "self.__attributes = attributes", "self.__offered = True"))):
        cls = getattr(exemplar_reservoir, name, None)
        if cls is None or not callable(getattr(cls, method, None)):
            problems.append(f"exemplar_reservoir.{name}.{method}")
        else:
            problems += [f"{name}.{method} ({n})" for n in _lacks(getattr(cls, method), *needed)]
    return problems


_cleaned_measurement: Any = None


def _cleaned_measurement_class() -> Any:
    """A ``Measurement`` whose ``__post_init__`` leaves its (already cleaned) attributes as they are."""
    global _cleaned_measurement
    if _cleaned_measurement is None:
        from opentelemetry.sdk.metrics._internal.measurement import Measurement

        class CleanedMeasurement(Measurement):
            def __post_init__(self) -> None:
                pass

        _cleaned_measurement = CleanedMeasurement
    return _cleaned_measurement


def meter_parts(meter_provider: Any) -> MeterParts | None:
    """The reader storages, exemplar filter and measurements of an SDK ``MeterProvider``, or None."""
    if not available("metrics"):
        return None
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics._internal._view_instrument_match import _hash_attributes
    from opentelemetry.sdk.metrics._internal.measurement import Measurement
    from opentelemetry.sdk.metrics._internal.measurement_consumer import SynchronousMeasurementConsumer

    if not isinstance(meter_provider, MeterProvider):
        return None
    try:
        consumer = meter_provider._measurement_consumer  # pylint: disable=protected-access
        exemplar_filter = meter_provider._sdk_config.exemplar_filter  # pylint: disable=protected-access
    except AttributeError:
        return None
    if type(consumer) is not SynchronousMeasurementConsumer or not isinstance(
            getattr(consumer, "_reader_storages", None), Mapping):
        return None

    def reader_storages() -> Mapping[Any, Any]:
        return consumer._reader_storages  # pylint: disable=protected-access

    def clean_attributes(instrument: Any, attributes: Mapping[str, Any] | None) -> Any:
        return Measurement(0, 0, instrument, None, attributes).attributes  # type: ignore[arg-type]

    return MeterParts(reader_storages, exemplar_filter, _hash_attributes, clean_attributes,
                      _cleaned_measurement_class())


def view_matches(storage: Any, instrument: Any) -> list[Any]:
    """The ``_ViewInstrumentMatch``es an instrument's measurements go to in one reader's storage."""
    return storage._get_or_init_view_instrument_match(instrument)  # pylint: disable=protected-access


def resets_on_collect(match: Any) -> bool:
    """True with delta temporality: the SDK drops the match's aggregations at each collection."""
    return bool(match._reset_on_collect)  # pylint: disable=protected-access


def view_attribute_keys(match: Any) -> Any:
    """The attribute keys the match's view keeps (None: all)."""
    return match._view._attribute_keys  # pylint: disable=protected-access


def instrument_enabled(instrument: Any) -> bool:
    """Whether an SDK instrument's meter is enabled (its ``record()`` no-ops otherwise)."""
    enabled = getattr(instrument, "_is_enabled", None)
    return enabled() if enabled is not None else True


def aggregation_of(match: Any, key: Any) -> Any:
    """The aggregation the match keeps for one attribute hash (None when it has none)."""
    return match._attributes_aggregation.get(key)  # pylint: disable=protected-access


def histogram_adder(aggregation: Any) -> Callable[[list[float]], None] | None:
    """``add(values)``: what ``aggregate(measurement, should_sample_exemplar=False)`` does for each
    value (no exemplar: its sample call is a no-op then), for many values under one lock; None
    for any aggregation but the explicit-bucket histogram's (then each value is aggregated)."""
    from bisect import bisect_left

    from opentelemetry.sdk.metrics._internal.aggregation import _ExplicitBucketHistogramAggregation

    if type(aggregation) is not _ExplicitBucketHistogramAggregation:  # pylint: disable=unidiomatic-typecheck
        return None
    agg = aggregation

    def add(values: list[float]) -> None:
        # pylint: disable=protected-access
        with agg._lock:
            if agg._value is None:
                agg._value = agg._get_empty_bucket_counts()
            counts, bounds, total = agg._value, agg._boundaries, agg._sum
            for value in values:  # summed in order, as one aggregate() each would
                total += value
                counts[bisect_left(bounds, value)] += 1
            agg._sum = total
            if agg._record_min_max:
                agg._min = min(agg._min, min(values))
                agg._max = max(agg._max, max(values))

    return add


def exemplar_offer(aggregation: Any) -> Callable[[list[float], list[tuple[int, int, Any]], Any], None] | None:
    """``offer(values, candidates, attributes)``: the exemplar sampling of ``aggregate(measurement,
    should_sample_exemplar=True)`` for each ``values[i]`` of ``candidates`` ``(i, time_unix_nano,
    context)`` (in record order; the measurements' attributes are ``attributes``), after
    :func:`histogram_adder` added the values. The aligned-bucket reservoir (the explicit-bucket
    histogram's default) keeps each bucket's last offer, so only the last candidate of each bucket is
    offered: the same exemplars, one offer per bucket instead of one per value. None for any other
    reservoir (a view's own ``exemplar_reservoir_factory``: then each candidate is aggregated)."""
    from bisect import bisect_left

    from opentelemetry.sdk.metrics._internal.exemplar.exemplar_reservoir import (
        AlignedHistogramBucketExemplarReservoir)

    reservoir = getattr(aggregation, "_reservoir", None)
    if type(reservoir) is not AlignedHistogramBucketExemplarReservoir:  # pylint: disable=unidiomatic-typecheck
        return None
    bounds = tuple(reservoir._boundaries)  # pylint: disable=protected-access

    def offer(values: list[float], candidates: list[tuple[int, int, Any]], attributes: Any) -> None:
        seen: set[int] = set()
        for index, time_unix_nano, context in reversed(candidates):
            value = values[index]
            bucket = bisect_left(bounds, value)  # its _find_bucket_index for a finite value (the only kind kept)
            if bucket not in seen:
                seen.add(bucket)
                reservoir.offer(value, time_unix_nano, attributes, context)

    return offer


# -- the batch span processor's queue (opentelemetry/sdk/_shared_internal/__init__.py, BatchProcessor) ---

def _check_batch_queue() -> list[str]:
    from opentelemetry.sdk import _shared_internal
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    problems = []
    batch_processor = getattr(_shared_internal, "BatchProcessor", None)
    if batch_processor is None:
        problems.append("opentelemetry.sdk._shared_internal.BatchProcessor")
    else:
        problems += [f"BatchProcessor {n}" for n in _lacks(batch_processor, "self._queue")]
    problems += [f"BatchSpanProcessor{n[4:]}" for n in _lacks(BatchSpanProcessor.__init__, "self._batch_processor")]
    return problems


def batch_queue_size(processor: Any) -> Callable[[], int] | None:
    """The number of spans waiting in an SDK ``BatchSpanProcessor``'s queue (for the exit
    report: the SDK's own ``otel.sdk.processor.span.queue.size`` is not exported any more
    then), or None."""
    if not available("batch_queue"):
        return None
    import collections

    from opentelemetry.sdk._shared_internal import BatchProcessor

    batch = getattr(processor, "_batch_processor", None)
    queue = getattr(batch, "_queue", None) if isinstance(batch, BatchProcessor) else None
    return (lambda: len(queue)) if isinstance(queue, collections.deque) else None


# -- the export threads of a tracer and a meter provider (otel_hicache.export.cpu_time) -----------------
# (opentelemetry/sdk/trace/__init__.py: TracerProvider, SynchronousMultiSpanProcessor;
#  opentelemetry/sdk/_shared_internal/__init__.py: BatchProcessor; opentelemetry/sdk/metrics/_internal/
#  export/__init__.py: PeriodicExportingMetricReader; the meter provider's readers as in "metrics")

def _check_threads() -> list[str]:
    from opentelemetry.sdk import _shared_internal
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import ConcurrentMultiSpanProcessor, SynchronousMultiSpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    problems = [f"TracerProvider{n[4:]}" for n in _lacks(TracerProvider.__init__, "self._active_span_processor")]
    for cls in (SynchronousMultiSpanProcessor, ConcurrentMultiSpanProcessor):
        problems += [f"{cls.__name__}{n[4:]}" for n in _lacks(cls.__init__, "self._span_processors")]
    problems += [f"BatchSpanProcessor{n[4:]}" for n in _lacks(BatchSpanProcessor.__init__, "self._batch_processor")]
    batch_processor = getattr(_shared_internal, "BatchProcessor", None)
    if batch_processor is None:
        problems.append("opentelemetry.sdk._shared_internal.BatchProcessor")
    else:
        problems += [f"BatchProcessor{n[4:]}" for n in _lacks(batch_processor.__init__, "self._worker_thread")]
    problems += [f"PeriodicExportingMetricReader{n[4:]}"
                 for n in _lacks(PeriodicExportingMetricReader.__init__, "self._daemon_thread")]
    return problems


def export_threads(tracer_provider: Any, meter_provider: Any) -> dict[str, list[threading.Thread]]:
    """The live threads that export for these providers: ``span_processor`` (each
    ``BatchSpanProcessor``'s worker) and ``metric_reader`` (each
    ``PeriodicExportingMetricReader``'s); empty lists for what cannot be read. Also
    ``export_process``: the ``ProcessSpanExporter`` of each processor that feeds a helper
    process (:mod:`otel_hicache.span_export_process`), whose CPU is read from ``/proc``."""
    found: dict[str, list[Any]] = {"span_processor": [], "metric_reader": [], "export_process": []}
    if not available("threads"):
        return found
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if isinstance(tracer_provider, TracerProvider):
        active = getattr(tracer_provider, "_active_span_processor", None)
        for processor in getattr(active, "_span_processors", ()) or ():
            if isinstance(processor, BatchSpanProcessor):
                thread = getattr(getattr(processor, "_batch_processor", None), "_worker_thread", None)
                if isinstance(thread, threading.Thread) and thread.is_alive():
                    found["span_processor"].append(thread)
                helper = getattr(processor, "helper", None)  # a ProcessSpanProcessor's own attribute
                if callable(getattr(helper, "helper_cpu_s", None)):
                    found["export_process"].append(helper)
    parts = meter_parts(meter_provider)
    for reader in list(parts.reader_storages()) if parts is not None else ():
        if isinstance(reader, PeriodicExportingMetricReader):
            thread = getattr(reader, "_daemon_thread", None)
            if isinstance(thread, threading.Thread) and thread.is_alive():
                found["metric_reader"].append(thread)
    return found


# -- value-checked writes, on any SDK version ---------------------------------------------------------------

def discarding_metric_exporter() -> Any:
    """A ``MetricExporter`` that accepts every export and sends nothing."""
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

    class Discard(MetricExporter):
        def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> Any:
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            return None

    return Discard()


def stop_reader_in_fork_child(reader: Any) -> None:
    """A periodic metric reader inherited from the parent: its exporter replaced by one that
    discards (the parent's frozen points are not exported again) and the thread the SDK
    restarted at fork stopped (PeriodicExportingMetricReader._at_fork_reinit)."""
    from opentelemetry.sdk.metrics.export import MetricExporter

    if isinstance(getattr(reader, "_exporter", None), MetricExporter):
        reader._exporter = discarding_metric_exporter()  # pylint: disable=protected-access
    event = getattr(reader, "_shutdown_event", None)
    if isinstance(event, threading.Event):
        event.set()


def _free_if_held(owner: Any, name: str) -> int:
    """``owner.<name>`` replaced by a free lock of its kind when it cannot be taken: in a forked
    child's at-fork callback only a parent thread, which does not exist here, can hold it."""
    lock = getattr(owner, name, None)
    for kind in (threading.Lock, threading.RLock):
        if isinstance(lock, type(kind())):
            if lock.acquire(blocking=False):
                lock.release()
                return 0
            setattr(owner, name, kind())
            return 1
    return 0


def reinit_metric_locks_in_fork_child(meter_provider: Any) -> int:
    """In a forked child, the locks of ``meter_provider`` that a parent thread held at fork
    replaced by free ones: each periodic reader's export lock (an export in flight), and the
    collection's, aggregations' and exemplar reservoirs' locks (a collection, or a measurement,
    in progress). The
    SDK's ``_at_fork_reinit`` resets only the provider's own two locks and restarts the reader's
    thread, so every later collection or measurement (its thread's, a flush's, its exit's, a
    counter's ``add``) waited on them forever. Called from an at-fork callback, where no thread
    of the child can hold one yet. Returns how many were replaced."""
    replaced = 0
    for reader in getattr(meter_provider, "_metric_readers", None) or ():
        replaced += _free_if_held(reader, "_export_lock")
    consumer = getattr(meter_provider, "_measurement_consumer", None)
    if consumer is None:
        return replaced
    replaced += _free_if_held(consumer, "_lock")
    for storage in dict(getattr(consumer, "_reader_storages", None) or {}).values():
        replaced += _free_if_held(storage, "_lock")
        matches = getattr(storage, "_instrument_view_instrument_matches", None) or {}
        for match in (m for ms in dict(matches).values() for m in ms):
            replaced += _free_if_held(match, "_lock")
            for aggregation in dict(getattr(match, "_attributes_aggregation", None) or {}).values():
                replaced += _free_if_held(aggregation, "_lock")
                replaced += _free_if_held(getattr(aggregation, "_reservoir", None), "_lock")  # its exemplars
    return replaced
