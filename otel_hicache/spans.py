"""Spans for transfer records, built on the completion worker.

A span is begun when the transfer's completion is observed (so metrics recorded
then can carry its span context as an exemplar) and finished when its ack
arrives, its ack wait times out, or right away when no ack is expected. Span
start/end are the copy's own times (device time placed on the wall clock), so
the span duration is the DMA time however late the ack is.

Two builders share one attribute set:

* :class:`FastSpanBuilder` (default with an SDK ``TracerProvider`` whose
  internals :mod:`.sdk_internals` checked): runs the
  provider's sampler and id generator itself and hands a finished
  ``ReadableSpan`` to the provider's span processors. It skips the ``Tracer``
  API's per-span overhead (mostly attribute re-validation: our attributes are
  built here with known types); processors' ``on_start`` is not called. The
  tracer's span limits (``OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT``, the value-length and
  event limits, or the provider's own ``SpanLimits``) apply as on the API path:
  the same bounded containers, filled in the same order. So do the SDK's own
  ``otel.sdk.span.started``/``otel.sdk.span.live`` metrics (with
  ``OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED=true``): recorded at begin, the
  live count taken back at finish, as ``Tracer.start_span`` and ``Span.end`` do.
* :class:`ApiSpanBuilder`: the public ``Tracer`` API, for any other provider or
  with ``OTEL_HICACHE_SPAN_FAST_PATH=false``.

Both take the outlier policy of ``OTEL_HICACHE_SPAN_SAMPLING=outliers``
(:mod:`.span_sampling`): the spans it keeps (errors, slow ops, a sampled parent's
children) are sampled whatever the provider's sampler says, and carry
``hicache.sampling.reason``; the sampler decides the others. The fast path asks
the sampler before building anything, so a span it skips costs a parent lookup, a
trace id and the sampler call. Both count each decision through ``count(decision,
reason)`` (``otel_hicache.spans``); with the default ``all`` every span is the
sampler's, ``reason=base``.
"""

from __future__ import annotations

import reprlib
from typing import Any, Callable, Mapping

from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation import set_span_in_context

from . import sdk_internals
from . import semconv as sc
from .host_residence import OFFLOAD_LINK_ATTRIBUTES
from .diagnostics import warn_once
from .records import INT64_MAX, ONBOARD, TIERS, TransferRecord, encodes
from .request_links import REQUEST_LINK_ATTRIBUTES, trace_id_hex
from .span_sampling import OutlierPolicy, keeping_tracer
from .version import __version__

SPAN_NAMES = {"offload": sc.SPAN_OFFLOAD, ONBOARD: sc.SPAN_ONBOARD}
_ACK_ATTRIBUTES = 2  # hicache.acked and hicache.ack_delay_us, set at finish
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_KEPT, _SKIPPED, _BASE = sc.SPAN_KEPT, sc.SPAN_SKIPPED, sc.SPAN_REASON_BASE
Count = Callable[[str, str], None]  # (decision, reason): otel_hicache.spans


def span_attributes(record: TransferRecord, static: Mapping[str, Any]) -> dict[str, Any]:
    """Everything a transfer span carries, ack fields aside.

    Static attributes first, then the call's own, then the ``hicache.*`` ones:
    a caller's attribute never overwrites what otel-hicache measured."""
    src, dst = TIERS[record.direction]
    attrs: dict[str, Any] = dict(static)
    extra = record.attributes
    if extra:
        for key, value in extra.items():
            if isinstance(key, str) and key and _encodable(key) and _valid_value(value):
                attrs[key] = value
            else:
                warn_once(f"attribute:{type(value).__name__}", "otel-hicache: a span attribute OTLP cannot encode "
                          "was left out (%s, a %s)", reprlib.repr(key), type(value).__name__)
    attrs[sc.DIRECTION] = record.direction
    attrs[sc.SRC_TIER] = src
    attrs[sc.DST_TIER] = dst
    attrs[sc.ORIGIN] = record.origin
    attrs[sc.CAUSE] = record.cause
    if record.cause_parts is not None:
        attrs[sc.CAUSES_ATTR] = tuple(part[0] for part in record.cause_parts)
    attrs[sc.TOKENS] = record.tokens
    attrs[sc.BLOCKS] = record.blocks
    attrs[sc.BYTES] = record.num_bytes
    attrs[sc.PAGE_SIZE] = record.page_size
    attrs[sc.POOL_NAMES] = record.pool_names
    attrs[sc.POOL_TOKENS] = record.pool_tokens
    if record.io_backend is not None:
        attrs[sc.IO_BACKEND] = str(record.io_backend)
    attrs[sc.TIMING_SOURCE] = record.timing_source
    if record.placement is not None:
        attrs[sc.PLACEMENT_SOURCE] = record.placement
    if record.queue_wait_ns is not None:
        attrs[sc.QUEUE_WAIT_US] = record.queue_wait_ns / 1e3
    if record.duration_ns > 0 and record.error is None:
        attrs[sc.BANDWIDTH] = record.num_bytes * 1e9 / record.duration_ns
    if record.error is not None:
        attrs[sc.ERROR_TYPE] = record.error
    reuse = record.reuse
    if reuse is not None:
        if reuse.min_ns is not None:
            attrs[sc.RESIDENCE_MIN_US] = reuse.min_ns / 1e3
            attrs[sc.RESIDENCE_MAX_US] = reuse.max_ns / 1e3
        if reuse.unknown_pages:
            attrs[sc.UNKNOWN_PAGES] = reuse.unknown_pages
    if record.links_dropped:
        attrs[sc.LINKS_DROPPED] = record.links_dropped
    if record.request_links_dropped:
        attrs[sc.REQUEST_LINKS_DROPPED] = record.request_links_dropped
    return attrs


def span_links(record: TransferRecord) -> tuple[Any, ...]:
    """A span's links: for a load-back, the sampled offload spans that wrote its pages
    (newest first, at most ``host_residence.MAX_LINKS``); then the requests it served or
    wrote (:mod:`.request_links`). Each says what it points to in ``hicache.link_to``."""
    links, requests = record.links, record.request_links
    if not links:
        return tuple([Link(context, REQUEST_LINK_ATTRIBUTES) for context in requests]) if requests else ()
    return (*[Link(SpanContext(trace_id, span_id, is_remote=False, trace_flags=_SAMPLED), OFFLOAD_LINK_ATTRIBUTES)
              for trace_id, span_id in links],
            *[Link(context, REQUEST_LINK_ATTRIBUTES) for context in requests])


_ABSENT = object()


def _encodable(value: Any) -> bool:
    """A scalar OTLP can encode: an int64, a float, a bool, or a string without lone surrogates
    (anything else would make every span of its export batch fail)."""
    if isinstance(value, str):
        return encodes(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return -INT64_MAX - 1 <= value <= INT64_MAX
    return isinstance(value, (bool, float))


def _valid_value(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_encodable(v) for v in value)
    return _encodable(value)


def _ack_attributes(record: TransferRecord, attrs: dict[str, Any]) -> None:
    if record.ack_ns is not None:
        attrs[sc.ACKED] = True
        attrs[sc.ACK_DELAY_US] = max(0, record.ack_ns - record.end_ns) / 1e3
    elif record.expect_ack:
        attrs[sc.ACKED] = False


def _events(record: TransferRecord, make_event: Any) -> list[Any]:
    """``make_event(name, timestamp, attributes or None)`` for each of the span's events."""
    events = [make_event(sc.EVENT_SUBMITTED, record.submit_ns, None)]
    for context in record.request_links:  # the way back from a request, in Jaeger's search
        events.append(make_event(sc.EVENT_REQUEST, record.submit_ns, {sc.REQUEST_TRACE_ID: trace_id_hex(context)}))
    if record.ack_ns is not None:
        events.append(make_event(sc.EVENT_ACKED, record.ack_ns, None))
    return events


def _status(record: TransferRecord) -> Status:
    if record.error is None:
        return Status(StatusCode.UNSET)
    return Status(StatusCode.ERROR, record.error)


class ApiSpanBuilder:
    """Spans through the public Tracer API (any TracerProvider)."""

    def __init__(self, tracer_provider: Any, static: Mapping[str, Any], policy: OutlierPolicy | None = None,
                 count: Count | None = None) -> None:
        self._tracer = tracer_provider.get_tracer(sc.SCOPE_NAME, __version__)
        self._static = static
        self._policy = policy
        self._count = count
        # the spans the policy keeps start here: the same tracer, its sampler ALWAYS_ON (SDK
        # tracers; with any other, None: its own sampler decides those too, and is counted so)
        self._keeping = keeping_tracer(self._tracer) if policy is not None else None

    def begin(self, record: TransferRecord) -> Any:
        tracer = self._tracer
        attributes = span_attributes(record, self._static)
        reason = _BASE
        policy = self._policy
        if policy is not None:
            parent = trace.get_current_span(record.parent_context).get_span_context()
            forced = policy.keep_reason(record, parent if parent.is_valid else None)
            if forced is not None:
                reason = forced
                if self._keeping is not None:
                    tracer = self._keeping
            attributes[sc.SAMPLING_REASON] = reason
        span = tracer.start_span(
            SPAN_NAMES[record.direction],
            context=record.parent_context,
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            links=span_links(record),
            start_time=record.start_ns,
        )
        record.span_context = span.get_span_context()
        if record.span_context.trace_flags.sampled:
            record.exemplar_context = set_span_in_context(span)
        if self._count is not None:  # kept: a span was made and sampled (a disabled tracer makes none)
            self._count(_KEPT if span.is_recording() and record.span_context.trace_flags.sampled else _SKIPPED,
                        reason)
        return span

    def finish(self, record: TransferRecord, span: Any) -> None:
        if not span.is_recording():
            return
        attrs: dict[str, Any] = {}
        _ack_attributes(record, attrs)
        if attrs:
            span.set_attributes(attrs)
        _events(record, lambda name, timestamp, attributes: span.add_event(name, attributes, timestamp))
        if record.error is not None:
            span.set_status(_status(record))
        span.end(end_time=record.end_ns)


class FastSpanBuilder:
    """Finished ``ReadableSpan``s straight to an SDK provider's processors."""

    def __init__(self, tracer_provider: Any, static: Mapping[str, Any], policy: OutlierPolicy | None = None,
                 count: Count | None = None) -> None:
        from opentelemetry.attributes import BoundedAttributes
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.sdk.trace.sampling import Decision
        from opentelemetry.sdk.util import BoundedList

        tracer = tracer_provider.get_tracer(sc.SCOPE_NAME, __version__)
        parts = sdk_internals.tracer_parts(tracer)  # fail now, not per span
        if parts is None:
            raise TypeError(f"not an SDK tracer, or an SDK whose internals were not checked: {type(tracer).__name__}")
        self._tracer = tracer
        self._sampler = parts.sampler
        self._ids = parts.id_generator
        self._resource = parts.resource
        self._processor = parts.span_processor
        self._scope = parts.scope
        self._limits = parts.limits
        self._bounded_attributes = BoundedAttributes
        self._bounded_list = BoundedList
        self._enabled = parts.is_enabled
        self._tracer_metrics = parts.metrics  # None: the SDK's otel.sdk.span.* metrics are off
        self._event = Event
        self._readable = ReadableSpan
        self._static = static
        self._policy = policy
        self._count = count
        self._forced_decision = Decision.RECORD_AND_SAMPLE

    def begin(self, record: TransferRecord) -> Any:
        count = self._count
        if not self._enabled():
            if count is not None:
                count(_SKIPPED, _BASE)
            return None
        parent_context = record.parent_context
        parent = trace.get_current_span(parent_context).get_span_context()
        if parent.is_valid:
            trace_id = parent.trace_id
            random_trace_id = parent.trace_flags.random_trace_id
        else:
            parent = None
            trace_id = self._ids.generate_trace_id()
            random_trace_id = self._ids.is_trace_id_random()
        name = SPAN_NAMES[record.direction]
        tracer_metrics = self._tracer_metrics
        policy = self._policy
        reason = _BASE
        links = span_links(record)  # built once: for the sampler, and for the span in finish()
        if policy is None:  # OTEL_HICACHE_SPAN_SAMPLING=all: the sampler sees the span's attributes
            attrs = span_attributes(record, self._static)
            result = self._sampler.should_sample(parent_context, trace_id, name, SpanKind.INTERNAL, attrs, links)
            decision, trace_state, extra = result.decision, result.trace_state, result.attributes
        else:
            forced = policy.keep_reason(record, parent)
            if forced is None:  # the base share: the sampler decides before anything is built
                asked = policy.sampler_attributes[record.direction]
                result = self._sampler.should_sample(parent_context, trace_id, name, SpanKind.INTERNAL, asked,
                                                     links)
                decision, trace_state = result.decision, result.trace_state
                if not decision.is_recording():
                    if tracer_metrics is not None:  # otel.sdk.span.started{DROP}, as Tracer.start_span
                        tracer_metrics.start_span(parent, decision)
                    if count is not None:
                        count(_SKIPPED, _BASE)
                    return None
                # what the sampler added (its echo of the attributes it was asked with aside)
                extra = {k: v for k, v in result.attributes.items() if asked.get(k, _ABSENT) is not v}
            else:  # kept whatever the sampler says: sampled, the parent's trace state (as ALWAYS_ON)
                reason = forced
                decision = self._forced_decision
                trace_state = parent.trace_state if parent is not None else None
                extra = None
            attrs = span_attributes(record, self._static)
            attrs[sc.SAMPLING_REASON] = reason
        flags = trace.TraceFlags.SAMPLED if decision.is_sampled() else trace.TraceFlags.DEFAULT
        if random_trace_id:
            flags |= trace.TraceFlags.RANDOM_TRACE_ID
        context = trace.SpanContext(
            trace_id,
            self._ids.generate_span_id(),
            is_remote=False,
            trace_flags=trace.TraceFlags(flags),
            trace_state=trace_state,
        )
        record.span_context = context
        # otel.sdk.span.started/live, as Tracer.start_span records them (the span ends in finish())
        end_metrics = None if tracer_metrics is None else tracer_metrics.start_span(parent, decision)
        if count is not None:
            count(_KEPT if context.trace_flags.sampled else _SKIPPED, reason)
        if not decision.is_recording():
            return None
        if context.trace_flags.sampled:
            record.exemplar_context = set_span_in_context(NonRecordingSpan(context))
        if extra:
            attrs.update(extra)
        limits = self._limits
        count_limit = limits.max_span_attributes  # None: unlimited (SpanLimits.UNSET, an empty variable)
        if limits.max_span_attribute_length is not None or (
                count_limit is not None and len(attrs) + _ACK_ATTRIBUTES > count_limit):
            # limits that bite: the SDK Span's own container (it validates every value,
            # which is what the fast path otherwise saves), so the result is the API path's
            attrs = self._bounded_attributes(limits.max_span_attributes, attrs, immutable=False,
                                             max_value_len=limits.max_span_attribute_length)
        return (parent, attrs, end_metrics, links)

    def _make_event(self, name: str, timestamp: int, attributes: Any) -> Any:
        return self._event(name, attributes, timestamp)

    def finish(self, record: TransferRecord, state: Any) -> None:
        if state is None:
            return
        parent, attrs, end_metrics, links = state
        ack: dict[str, Any] = {}
        _ack_attributes(record, ack)
        for key, value in ack.items():  # one by one, as Span.set_attributes: the oldest give way
            attrs[key] = value
        events = _events(record, self._make_event)
        if self._limits.max_events is not None and len(events) > self._limits.max_events:
            events = self._bounded_list.from_seq(self._limits.max_events, events)
        if links and self._limits.max_links is not None and len(links) > self._limits.max_links:
            links = self._bounded_list.from_seq(self._limits.max_links, links)
        span = self._readable(
            name=SPAN_NAMES[record.direction],
            context=record.span_context,
            parent=parent,
            resource=self._resource,
            attributes=attrs,
            events=events,
            links=links,
            kind=SpanKind.INTERNAL,
            status=_status(record),
            start_time=record.start_ns,
            end_time=record.end_ns,
            instrumentation_scope=self._scope,
        )
        if end_metrics is not None:  # before on_end, as Span.end() does
            end_metrics()
        self._processor.on_end(span)


def make_span_builder(tracer_provider: Any, static: Mapping[str, Any], fast_path: bool,
                      policy: OutlierPolicy | None = None, count: Count | None = None) -> Any:
    """``policy``: the outlier policy (None: ``OTEL_HICACHE_SPAN_SAMPLING=all``), one per
    builder (it holds the running quantiles). ``count(decision, reason)``: each decision."""
    if fast_path:
        try:
            return FastSpanBuilder(tracer_provider, static, policy, count)
        except Exception:  # not an SDK provider, or an SDK we do not know
            pass
    return ApiSpanBuilder(tracer_provider, static, policy, count)
