"""``otel_hicache.testing``'s simulated device on a clock of its own, with what only tests use: events that fail
or never complete, ``synchronize()``, ``enable_timing``, a stream, and an unknown back-end's event."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from otel_hicache import testing

_NEVER = float("inf")


class SimulatedEvent(testing.SimulatedEvent):
    raise_on_query: BaseException | None = None

    def __init__(self, device: SimulatedDevice, enable_timing: bool = True) -> None:
        super().__init__(device)
        self.enable_timing = enable_timing

    def never_completes(self) -> SimulatedEvent:
        return self.record(at_ns=_NEVER)

    def query(self) -> bool:
        if self.raise_on_query is not None:
            raise self.raise_on_query
        return super().query()

    def synchronize(self) -> None:  # advances the clock to the event
        if self.at_ns == _NEVER:
            raise RuntimeError("simulated event never completes")
        if self.at_ns is not None:
            self._device.advance_to(int(self.at_ns))

    def elapsed_time(self, end: SimulatedEvent) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if not (self.query() and end.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return super().elapsed_time(end)


class SimulatedDevice(testing.WallClockDevice):
    anchors_taken = 0

    def __init__(self, start_ns: int = 1_767_225_600_000_000_000) -> None:  # 2026-01-01T00:00:00Z
        self._now, self._lock = start_ns, threading.Lock()

    def time_ns(self) -> int:  # type: ignore[override]
        return self._now

    def advance(self, seconds: float = 0.0, ms: float = 0.0, ns: int = 0) -> int:
        with self._lock:
            self._now += int(round(seconds * 1e9 + ms * 1e6)) + ns
            return self._now

    def advance_to(self, at_ns: int) -> None:
        with self._lock:
            self._now = max(self._now, at_ns)

    def event(self, enable_timing: bool = True) -> SimulatedEvent:
        return SimulatedEvent(self, enable_timing)

    def anchor_event(self) -> SimulatedEvent:
        self.anchors_taken += 1
        return super().anchor_event()  # type: ignore[return-value]

    def stream(self) -> Any:
        return SimpleNamespace(timing_event_pair=lambda: (self.event(), self.event()))


class DuckEvent:
    """An unknown back-end's event (no ``anchor_factory()``); with a ``stream``, comparable only on it."""

    def __init__(self, inner: SimulatedEvent, stream: Any = None) -> None:
        self._inner, self.stream = inner, stream

    def record(self, stream: Any = None) -> None:
        self._inner.record(stream)

    def query(self) -> bool:
        return self._inner.query()

    def synchronize(self) -> None:
        self._inner.synchronize()

    def elapsed_time(self, end: DuckEvent) -> float:
        if self.stream is not None and getattr(end, "stream", None) != self.stream:
            raise RuntimeError("events of different streams cannot be compared")
        return self._inner.elapsed_time(end._inner)
