"""Histogram points straight into an SDK ``MeterProvider``'s aggregations.

``Histogram.record()`` re-validates and re-hashes the attribute dict on every
call (about 0.8 us per attribute on a 2-core server CPU; 4 histograms with
rank labels cost ~40 us per op). Our attribute sets are fixed and built once,
so a :class:`BoundHistogram` resolves, once per attribute set, the aggregation
objects the SDK itself would route a measurement to (one per reader and
matching view), and afterwards hands each value to them directly: the same
aggregation code, the same exemplar filter and reservoir, no attribute work.

It is used only where it is exactly equivalent:

* an SDK ``MeterProvider`` whose internals look as expected (checked once, by
  :mod:`.sdk_internals`; anything unexpected falls back to ``Histogram.record``
  for good);
* values ``Histogram.record`` takes (finite, non-negative; the others go to it,
  which drops them with its warning), from an enabled meter (re-checked with the
  binding);
* aggregations that survive collection (cumulative temporality, the default):
  with delta temporality the SDK discards aggregations on collect, so the
  public API is used;
* the first value of each attribute set goes through ``Histogram.record`` (it
  creates the aggregation), and the binding is re-checked before values reach
  an aggregation (:meth:`BoundHistogram.revalidate`: at every metrics flush, and
  every worker cycle for a binding that aggregates some values at once): an
  aggregation the SDK replaced, or a reader added or removed
  (``add_metric_reader``: from then on, the new reader gets every value, as it
  does from ``Histogram.record``).

Each bound value is the ``Measurement`` ``Histogram.record`` would make, its
attributes included (cleaned once per attribute set, not per value): the
exemplar reservoir keeps them, and a view that drops attribute keys exports the
dropped ones as the exemplar's ``filtered_attributes``.

With the default trace-based exemplar filter and explicit-bucket aggregations,
values are kept in a list and added in bulk at the worker's next metrics flush
(at most 50 ms later, as the counters are, and on every ``force_flush``), what
``aggregate()`` does for them under one lock for all of them
(``sdk_internals.histogram_adder``). On a 2-core VM the three histogram values
of an op cost ~17 us of worker CPU one by one (``benchmarks/overhead.py``). An
exemplar candidate (a sampled span's context) is kept with its time and context:
the bucket-aligned reservoir (the default) keeps each bucket's last offer, so at
the flush only each bucket's last candidate is offered
(``sdk_internals.exemplar_offer``), the exemplars ``Histogram.record`` would
leave. With another reservoir each candidate is aggregated at once.

``OTEL_HICACHE_SPAN_FAST_PATH=false`` turns this off together with the span
fast path.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from . import sdk_internals

_INF = float("inf")


class _Resolver:
    """What is shared by the bound histograms of one MeterProvider."""

    def __init__(self, meter_provider: Any) -> None:
        from opentelemetry.sdk.metrics import TraceBasedExemplarFilter

        parts = sdk_internals.meter_parts(meter_provider)
        if parts is None:
            raise TypeError("not an SDK MeterProvider, or an SDK whose internals were not checked")
        self.reader_storages = parts.reader_storages
        self.exemplar_filter = parts.exemplar_filter
        # With the default trace-based filter the answer is known without asking:
        # we pass a context only when the op's span is sampled.
        self.trace_based = type(self.exemplar_filter) is TraceBasedExemplarFilter
        self.hash_attributes = parts.hash_attributes
        self.clean_attributes = parts.clean_attributes
        self.measurement = parts.measurement

    def aggregations(self, instrument: Any, attributes: Any, storages: Mapping[Any, Any]) -> list[Any] | None:
        """The aggregations Histogram.record routes ``attributes`` (cleaned) to in ``storages``, or
        None (delta temporality, an aggregation not there: the public API for good)."""
        found = []
        for storage in list(storages.values()):
            for match in sdk_internals.view_matches(storage, instrument):
                if sdk_internals.resets_on_collect(match):
                    return None
                keys = sdk_internals.view_attribute_keys(match)
                attrs = dict(attributes or {})
                if keys is not None:
                    attrs = {k: v for k, v in attrs.items() if k in keys}
                key = self.hash_attributes(attrs)
                aggregation = sdk_internals.aggregation_of(match, key)
                if aggregation is None:
                    return None
                found.append((match, key, aggregation))
        return found


class BoundHistogram:
    """``record(value, context)`` for one histogram and one attribute set."""

    __slots__ = ("_instrument", "_attributes", "_resolver", "_bound", "_cleaned", "_storages", "_adders", "_offers",
                 "_values", "_candidates", "bulk")

    def __init__(self, instrument: Any, attributes: Mapping[str, Any], resolver: _Resolver | None) -> None:
        self._instrument = instrument
        self._attributes = attributes
        self._resolver = resolver
        self._bound: list[Any] | None = None
        self._cleaned: Any = None  # the attributes as Histogram.record's Measurement carries them
        self._storages: Any = None  # the reader storages the binding covers
        self._adders: list[Any] | None = None  # bulk adds into the bound aggregations (None: value by value)
        self._offers: list[Any] | None = None  # their exemplar offers in bulk (None: candidates value by value)
        self._values: list[float] = []  # values waiting for flush_values()
        self._candidates: list[tuple[int, int, Any]] = []  # of them, the exemplar candidates: (index, time, context)
        # every value waits for flush_values() (none reaches an aggregation before): the binding
        # needs checking only there, not every cycle (TransferMetrics.revalidate). A slot, not a
        # property of _bound and _offers: read for every binding every cycle (~1 us a cycle more)
        self.bulk = False

    def record(self, value: float, context: Any) -> None:
        """``context``: the op's span context when it is sampled (an exemplar
        candidate), else None."""
        bound = self._bound
        if bound is None:
            resolver = self._resolver
            # read before the record: a reader added in between is caught by revalidate()
            storages = resolver.reader_storages() if resolver is not None else None
            self._instrument.record(value, self._attributes, context=context)
            if resolver is not None:
                try:
                    cleaned = resolver.clean_attributes(self._instrument, self._attributes)
                    self._bound = resolver.aggregations(self._instrument, cleaned, storages)
                    self._cleaned, self._storages = cleaned, storages
                    adders = [sdk_internals.histogram_adder(a) for _m, _k, a in self._bound or ()]
                    self._adders = adders if resolver.trace_based and None not in adders else None
                    offers = [sdk_internals.exemplar_offer(a) for _m, _k, a in self._bound or ()]
                    self._offers = offers if self._adders is not None and None not in offers else None
                    self.bulk = self._bound is not None and self._offers is not None
                except Exception:
                    self._bound = None
                if self._bound is None:
                    self._resolver = None  # delta temporality or unexpected internals: public API for good
            return
        if not 0 <= value < _INF:  # what Histogram.record ignores (and warns of): NaN, infinite, negative
            self._instrument.record(value, self._attributes, context=context)
            return
        if self._adders is not None:  # added in bulk (flush_values)
            if context is None:
                self._values.append(value)
                return
            if self._offers is not None:  # an exemplar candidate: offered in bulk too
                values = self._values
                self._candidates.append((len(values), time.time_ns(), context))
                values.append(value)
                return
        resolver = self._resolver
        now = time.time_ns()
        # the measurement Histogram.record makes (its attributes: the exemplars' filtered_attributes)
        measurement = resolver.measurement(value, now, self._instrument, context, self._cleaned)
        if resolver.trace_based:
            sample = context is not None
        else:
            sample = resolver.exemplar_filter.should_sample(value, now, self._cleaned, context)
        for _match, _key, aggregation in bound:
            aggregation.aggregate(measurement, sample)

    def flush_values(self) -> None:
        """Add the values kept since the last flush to the bound aggregations (after revalidate())."""
        values = self._values
        if not values:
            return
        candidates = self._candidates
        self._values, self._candidates = [], []
        adders, offers = self._adders, self._offers
        if self._bound is None or adders is None:  # unbound since: as Histogram.record would have
            contexts = {index: context for index, _time, context in candidates}
            for index, value in enumerate(values):
                self._instrument.record(value, self._attributes, context=contexts.get(index))
            return
        for add in adders:
            add(values)
        if candidates and offers is not None:
            for offer in offers:
                offer(values, candidates, self._cleaned)

    def revalidate(self) -> None:
        """Drop the binding if the SDK replaced an aggregation, or a reader was added or removed
        (checked once per cycle): the next value goes through Histogram.record and binds again,
        and so do the values kept until then (to where the SDK now routes them)."""
        bound = self._bound
        if bound is None:
            return
        stale = self._resolver.reader_storages() is not self._storages or any(
            sdk_internals.aggregation_of(match, key) is not aggregation for match, key, aggregation in bound
        ) or not sdk_internals.instrument_enabled(self._instrument)  # a meter disabled since: record() no-ops
        if stale:
            self._bound = self._adders = self._offers = None
            self.bulk = False
            self.flush_values()


def resolver_for(meter_provider: Any, enabled: bool) -> _Resolver | None:
    if not enabled:
        return None
    try:
        return _Resolver(meter_provider)
    except Exception:
        return None
