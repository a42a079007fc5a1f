"""Placing device events on the host wall clock.

Device timing events only measure intervals between each other. To put a
transfer span on the wall clock (so it lines up with request spans in a trace
view) the completion worker keeps an *anchor*: a timing event it records on its
own side stream and synchronizes, bracketed by two host clock readings. The
event ran at about the midpoint of the bracket; the bracket's half-width bounds
the error. Any other completed event ``e`` is then placed at
``anchor_wall_ns + anchor.elapsed_time(e)``.

Anchors are re-taken every ``OTEL_HICACHE_ANCHOR_INTERVAL_S`` (off the hot path,
on the worker thread) so device/host clock drift stays small. A new sample is
kept only when its bracket is not much wider than the best one seen, so an
anchor taken while the device was busy does not replace a good one.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from .diagnostics import logger, warn_once


_FIRST_SAMPLES = 3


class WallClockAnchor:
    """Maps completed device events to host wall-clock nanoseconds."""

    __slots__ = (
        "_factory",
        "_clock",
        "_interval_ns",
        "event",
        "wall_ns",
        "uncertainty_ns",
        "_best_uncertainty_ns",
        "_taken_at_ns",
        "_failed",
    )

    def __init__(
        self,
        factory: Callable[[], Any],
        interval_s: float = 1.0,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self._factory = factory
        self._clock = clock
        self._interval_ns = int(interval_s * 1e9)
        self.event: Any = None
        self.wall_ns = 0
        self.uncertainty_ns = 0
        self._best_uncertainty_ns: int | None = None
        self._taken_at_ns = 0
        self._failed = False

    @property
    def usable(self) -> bool:
        return self.event is not None

    def maybe_refresh(self, now_ns: int) -> None:
        """Take a new anchor sample if the current one is older than the interval."""
        if self._failed:
            return
        if self.event is not None and now_ns - self._taken_at_ns < self._interval_ns:
            return
        self.refresh()

    def refresh(self) -> None:
        # The first sample pays one-time costs between the two host readings (a CUDA
        # factory creates its side stream, the context warms up) and would sit early in
        # its bracket: the first refresh takes a few samples and keeps the narrowest.
        tries = _FIRST_SAMPLES if self.event is None else 1
        try:
            before, event, after = self._sample()
            for _ in range(tries - 1):
                sample = self._sample()
                if sample[2] - sample[0] < after - before:
                    before, event, after = sample
        except Exception as exc:  # never let a device problem stop the worker
            self._failed = self.event is None
            warn_once(
                "anchor",
                "otel-hicache: cannot record a wall-clock anchor event (%r); "
                "device-timed spans are placed from host completion times instead",
                exc,
            )
            return
        half = (after - before) // 2
        best = self._best_uncertainty_ns
        # Keep a sample unless it is much noisier than the best one seen; an old
        # anchor is still replaced eventually (drift), at 4x the best width.
        if self.event is not None and best is not None and half > max(4 * best, 20_000):
            if after - self._taken_at_ns < 8 * self._interval_ns:
                return
        self.event = event
        self.wall_ns = before + half
        self.uncertainty_ns = half
        self._taken_at_ns = after
        if best is None or half < best:
            self._best_uncertainty_ns = half
        if logger.isEnabledFor(5):
            logger.log(5, "otel-hicache anchor wall_ns=%d uncertainty_ns=%d", self.wall_ns, half)

    def _sample(self) -> tuple[int, Any, int]:
        before = self._clock()
        event = self._factory()
        event.synchronize()
        return before, event, self._clock()

    def wall_time_ns(self, event: Any) -> int | None:
        """Wall-clock time of a completed timing event, or None if unknown."""
        if self.event is None:
            return None
        try:
            offset_ms = self.event.elapsed_time(event)
        except Exception:
            return None
        return self.wall_ns + int(round(offset_ms * 1e6))
