"""A simulated device for tests and CPU-only runs: timing events on a clock you control.

``SimulatedDevice`` keeps one timeline in nanoseconds that serves both as the
host wall clock (pass ``device.time_ns`` as ``TransferTelemetry(clock=...)``)
and as the device clock. Events behave like ``torch.cuda.Event``:

* ``record(at_ns=None)`` enqueues the event to complete at ``at_ns`` (default: now);
* ``query()`` is True once the clock reached that time;
* ``synchronize()`` blocks, i.e. advances the clock to it;
* ``elapsed_time(end)`` returns milliseconds and raises, as CUDA does, if either
  event has not completed or was created without ``enable_timing=True``.

Faults for tests: ``raise_on_query``, ``never_completes``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

_NEVER = float("inf")


class SimulatedEvent:
    def __init__(self, device: "SimulatedDevice", enable_timing: bool = True) -> None:
        self._device = device
        self.enable_timing = enable_timing
        self.at_ns: float | None = None
        self.raise_on_query: BaseException | None = None

    def record(self, stream: Any = None, at_ns: float | None = None) -> "SimulatedEvent":
        self.at_ns = self._device.time_ns() if at_ns is None else at_ns
        return self

    def never_completes(self) -> "SimulatedEvent":
        self.at_ns = _NEVER
        return self

    def query(self) -> bool:
        if self.raise_on_query is not None:
            raise self.raise_on_query
        return self.at_ns is not None and self._device.time_ns() >= self.at_ns

    def synchronize(self) -> None:
        if self.at_ns is None:
            return
        if self.at_ns == _NEVER:
            raise RuntimeError("simulated event never completes")
        self._device.advance_to(int(self.at_ns))

    def elapsed_time(self, end: "SimulatedEvent") -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if not (self.query() and end.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return (end.at_ns - self.at_ns) / 1e6

    def anchor_factory(self) -> Any:
        return self._device.anchor_event


class SimulatedStream:
    """Records its timing events at the device's current time."""

    def __init__(self, device: "SimulatedDevice") -> None:
        self._device = device

    def timing_event_pair(self) -> tuple[SimulatedEvent, SimulatedEvent]:
        return self._device.event(), self._device.event()


class SimulatedDevice:
    def __init__(self, start_ns: int = 1_767_225_600_000_000_000) -> None:  # 2026-01-01T00:00:00Z
        self._now = start_ns
        self._lock = threading.Lock()
        self.anchors_taken = 0

    def time_ns(self) -> int:
        return self._now

    def advance(self, seconds: float = 0.0, ms: float = 0.0, us: float = 0.0, ns: int = 0) -> int:
        with self._lock:
            self._now += int(round(seconds * 1e9 + ms * 1e6 + us * 1e3)) + ns
            return self._now

    def advance_to(self, at_ns: int) -> None:
        with self._lock:
            if at_ns > self._now:
                self._now = at_ns

    def event(self, enable_timing: bool = True) -> SimulatedEvent:
        return SimulatedEvent(self, enable_timing)

    def copy(self, start_ns: float, duration_ms: float, enable_timing: bool = True) -> tuple[SimulatedEvent, SimulatedEvent]:
        """A start/finish event pair for a copy running ``[start_ns, start_ns + duration)``."""
        start = self.event(enable_timing).record(at_ns=start_ns)
        finish = self.event(enable_timing).record(at_ns=start_ns + int(round(duration_ms * 1e6)))
        return start, finish

    def anchor_event(self) -> SimulatedEvent:
        self.anchors_taken += 1
        return self.event().record()

    def stream(self) -> SimulatedStream:
        return SimulatedStream(self)


class WallClockDevice(SimulatedDevice):
    """A simulated device whose clock is the host wall clock (so ``query()`` of an
    event placed in the past is True, and spans land at the real time): benchmarks."""

    time_ns = staticmethod(time.time_ns)  # type: ignore[assignment]


class DuckEvent:
    """A duck-typed timing event without anchor support: ``record``/``query``/``synchronize``/
    ``elapsed_time`` only (no ``anchor_factory()``, not a ``torch.<backend>.Event``), delegated
    to a :class:`SimulatedEvent`. What a back-end otel-hicache does not know brings."""

    def __init__(self, inner: SimulatedEvent) -> None:
        self._inner = inner

    def record(self, stream: Any = None) -> None:
        self._inner.record(stream)

    def query(self) -> bool:
        return self._inner.query()

    def synchronize(self) -> None:
        self._inner.synchronize()

    def elapsed_time(self, end: "DuckEvent") -> float:
        return self._inner.elapsed_time(end._inner)


class OneStreamEvent(DuckEvent):
    """A back-end whose events compare only with events recorded on their own stream."""

    def __init__(self, inner: SimulatedEvent, stream: Any) -> None:
        super().__init__(inner)
        self.stream = stream

    def elapsed_time(self, end: "DuckEvent") -> float:
        if getattr(end, "stream", None) != self.stream:
            raise RuntimeError("events of different streams cannot be compared")
        return super().elapsed_time(end)
