"""The sinks on the poller thread, on the caller's providers or configure()'s."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping

from .bounded_flush import bounded
from .consumer import Consumer


class EmbeddedChannel:
    def __init__(self, tracer_provider: Any, meter_provider: Any, hello: Mapping,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self._providers = tracer_provider, meter_provider
        self._lock = threading.Lock()  # stop() comes from another thread than write()
        self.consumer = Consumer(tracer_provider, meter_provider, {**hello, "embedded": True}, clock)

    def write(self, batch: list, ops: int) -> None:
        with self._lock:
            self.consumer.apply(batch)

    def flush(self, timeout_s: float) -> bool:
        return bounded("force_flush", *self._providers, timeout_s)

    def stop(self, timeout_s: float, export_s: float | None = None) -> bool:
        """The providers stay up."""
        with self._lock:
            self.consumer.close()
        return self.flush(timeout_s)

    def forget_in_child(self) -> None:
        """A forked child opens its own."""
