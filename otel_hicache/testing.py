"""Simulated ``torch.cuda.Event``s on the wall clock, for benchmarks (tests/simulated.py's: on a clock of their own)."""

from __future__ import annotations

import time
from typing import Any


class SimulatedEvent:
    def __init__(self, device: WallClockDevice) -> None:
        self._device, self.at_ns = device, None

    def record(self, stream: Any = None, at_ns: float | None = None) -> SimulatedEvent:
        self.at_ns = self._device.time_ns() if at_ns is None else at_ns
        return self

    def query(self) -> bool:
        return self.at_ns is not None and self._device.time_ns() >= self.at_ns

    def synchronize(self) -> None:  # an anchor's: on the wall clock, it has happened
        pass

    def elapsed_time(self, end: SimulatedEvent) -> float:
        return (end.at_ns - self.at_ns) / 1e6

    def anchor_factory(self) -> Any:
        return self._device.anchor_event


class WallClockDevice:
    time_ns = staticmethod(time.time_ns)

    def event(self) -> SimulatedEvent:
        return SimulatedEvent(self)

    def copy(self, start_ns: float, duration_ms: float) -> tuple[Any, Any]:
        return self.event().record(at_ns=start_ns), self.event().record(at_ns=start_ns + int(round(duration_ms * 1e6)))

    def anchor_event(self) -> SimulatedEvent:
        return self.event().record()
