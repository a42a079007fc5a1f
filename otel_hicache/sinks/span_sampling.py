"""Source-side outlier sampling: which transfer spans are kept whatever the sampler says.

With ``OTEL_HICACHE_SPAN_SAMPLING=outliers`` the sinks, which know an
op's duration and error state before its span exists, decides in this order:

1. ``error``: the op failed (an error span) -> kept;
2. ``slow``: it took longer than ``OTEL_HICACHE_SPAN_KEEP_SLOWER_THAN_MS``, or its
   duration lies above the running ``OTEL_HICACHE_SPAN_KEEP_SLOWER_THAN_QUANTILE``
   of the recent ops of its direction -> kept;
3. ``parent``: the op's parent context (the caller's span at ``submit()``) is
   sampled -> kept, so a sampled trace keeps its transfers;
4. ``request``: the op is linked to a sampled request (``submit(requests=...)``,
   :mod:`.request_links`) -> kept, so a traced request's transfers can be found;
5. ``base``: the tracer provider's sampler (``OTEL_TRACES_SAMPLER``/``_ARG``)
   decides, as for any span.

The first four are forced: the span builder (:mod:`.spans`) starts the span on a
tracer whose sampler keeps it. Kept spans carry ``hicache.sampling.reason``. With the default ``all`` the
sampler decides every span, as before, and every decision counts as ``base``.
Either way each decision is counted in ``otel_hicache.spans{decision, reason}``.

The relative threshold is :class:`RecentQuantile`, one per direction: a fixed
histogram of durations with 8 log-spaced buckets per octave (~9% wide), counts
halved once they sum to twice :data:`WINDOW` (so it follows the last 16k to 32k ops
of its direction), the quantile's bucket looked up every :data:`REFRESH` ops. An op
is slow when its bucket lies above the quantile's: at most ``1 - quantile`` of the
recent ops are. Cost per op: one ``bisect`` and one list increment.
"""

from __future__ import annotations

import copy
import math
from bisect import bisect_right
from typing import Any

from .. import environment_variables as ev
from .. import semconv as sc
from ..record import DIRECTIONS
from ..settings import env_choice, env_float, env_fraction

MODE_ALL = "all"
MODE_OUTLIERS = "outliers"
MODES = (MODE_ALL, MODE_OUTLIERS)

BUCKETS_PER_OCTAVE = 8
BOUNDS_NS = tuple(int(round(1_000 * 2 ** (i / BUCKETS_PER_OCTAVE))) for i in range(28 * BUCKETS_PER_OCTAVE + 1))
"""Bucket bounds, 1 us to ~268 s: bucket ``i`` holds ``BOUNDS_NS[i-1] <= duration < BOUNDS_NS[i]``."""
WINDOW = 16_384
REFRESH = 128


class RecentQuantile:
    """The running ``quantile`` of one direction's recent durations (see the module docstring)."""

    __slots__ = ("quantile", "warmup", "_counts", "_seen", "_until_refresh", "_threshold")

    def __init__(self, quantile: float) -> None:
        self.quantile = quantile
        self.warmup = math.ceil(10 / (1 - quantile))  # ops seen before the quantile means something
        self._counts = [0.0] * (len(BOUNDS_NS) + 1)
        self._seen = 0
        self._until_refresh = REFRESH
        self._threshold = len(BOUNDS_NS)  # the last bucket: none above it until warmed up

    def above(self, duration_ns: int) -> bool:
        """Count one duration; True when it lies above the quantile of the ops before it."""
        index = bisect_right(BOUNDS_NS, duration_ns)
        self._counts[index] += 1.0
        self._until_refresh -= 1
        if self._until_refresh <= 0:
            self._refresh()
        return index > self._threshold

    def threshold_ns(self) -> int | None:
        """The upper bound of the quantile's bucket: ops this slow or slower are above it.
        None before warm-up (or while the quantile is in the last, unbounded bucket)."""
        if self._threshold >= len(BOUNDS_NS):
            return None
        return BOUNDS_NS[self._threshold]

    def _refresh(self) -> None:
        self._until_refresh = REFRESH
        self._seen += REFRESH
        counts = self._counts
        total = sum(counts)
        if total >= 2 * WINDOW:  # forget: the older half of what was counted weighs half
            counts = self._counts = [c * 0.5 for c in counts]
            total *= 0.5
        if self._seen < self.warmup:
            return
        target = self.quantile * total
        cumulative = 0.0
        for index, count in enumerate(counts):
            cumulative += count
            if cumulative >= target:
                self._threshold = index
                return


class OutlierPolicy:
    """Which op's span is kept whatever the sampler says (:meth:`keep_reason`)."""

    __slots__ = ("slower_than_ns", "quantiles")

    def __init__(self, slower_than_ns: int, quantile: float, static: Any = None) -> None:
        self.slower_than_ns = slower_than_ns  # 0: off
        self.quantiles = {d: RecentQuantile(quantile) for d in DIRECTIONS} if quantile > 0 else None

    def keep_reason(self, record: Any, parent: Any) -> str | None:
        """``error``, ``slow``, ``parent``, ``request`` or None (the sampler decides). ``parent``: the
        op's valid parent span context, or None. Every successful op's duration is
        counted in its direction's quantile, kept or not."""
        if record.error is not None:
            return sc.SPAN_REASON_ERROR
        duration = record.duration_ns
        quantiles = self.quantiles
        slow = quantiles is not None and quantiles[record.direction].above(duration)
        if slow or (self.slower_than_ns and duration > self.slower_than_ns):
            return sc.SPAN_REASON_SLOW
        if parent is not None and parent.trace_flags.sampled:
            return sc.SPAN_REASON_PARENT
        if record.request_links:  # only sampled requests are linked
            return sc.SPAN_REASON_REQUEST
        return None


class SpanSamplingSettings:
    """``OTEL_HICACHE_SPAN_SAMPLING`` and its thresholds; the defaults are the documented ones."""

    __slots__ = ("mode", "slower_than_ms", "quantile")

    def __init__(
        self,
        mode: str = ev.DEFAULTS[ev.OTEL_HICACHE_SPAN_SAMPLING],
        slower_than_ms: float = ev.DEFAULTS[ev.OTEL_HICACHE_SPAN_KEEP_SLOWER_THAN_MS],
        quantile: float = ev.DEFAULTS[ev.OTEL_HICACHE_SPAN_KEEP_SLOWER_THAN_QUANTILE],
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"span sampling mode {mode!r}: one of {', '.join(MODES)}")
        if not 0.0 <= quantile < 1.0:
            raise ValueError(f"quantile {quantile!r}: >= 0 and < 1")
        if not slower_than_ms >= 0.0:
            raise ValueError(f"slower_than_ms {slower_than_ms!r}: >= 0")
        self.mode = mode
        self.slower_than_ms = slower_than_ms
        self.quantile = quantile

    @classmethod
    def from_environment(cls) -> "SpanSamplingSettings":
        """From the ``OTEL_HICACHE_SPAN_*`` variables (malformed ones: warned, the default used)."""
        return cls(
            mode=env_choice(ev.OTEL_HICACHE_SPAN_SAMPLING, MODES),
            slower_than_ms=env_float(ev.OTEL_HICACHE_SPAN_KEEP_SLOWER_THAN_MS),
            quantile=env_fraction(ev.OTEL_HICACHE_SPAN_KEEP_SLOWER_THAN_QUANTILE),
        )

    def values(self) -> tuple[str, float, float]:
        """As plain values, for the hello (read in the serving process, at construction)."""
        return (self.mode, self.slower_than_ms, self.quantile)

    def policy(self, static: Any = None) -> OutlierPolicy | None:
        """A fresh policy (its own quantiles) for one span builder; None with ``all``."""
        if self.mode != MODE_OUTLIERS:
            return None
        return OutlierPolicy(int(self.slower_than_ms * 1e6), self.quantile, static)


def keeping_tracer(tracer: Any) -> Any:
    """For the API path: a copy of an SDK ``Tracer`` whose sampler samples every span
    (``ALWAYS_ON``: the parent's trace state, no attributes of its own), for the spans
    the policy keeps. The copy shares the original's processors, resource, ids, limits
    and self-metrics (``get_tracer`` returns one cached tracer per scope: that one is
    never changed), and its tracer configuration as it was when copied (the SDK's
    experimental tracer configurator, changed later, is not followed). None for any
    other tracer: its own sampler then decides."""
    try:
        from opentelemetry.sdk.trace import Tracer
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON
    except ImportError:  # pragma: no cover - the SDK is a dependency
        return None
    if not isinstance(tracer, Tracer) or not hasattr(tracer, "sampler"):
        return None
    keeping = copy.copy(tracer)
    keeping.sampler = ALWAYS_ON
    return keeping
