"""otel_hicache.sinks.bounded_flush: flush and shutdown within a time bound, and a shutdown behind a
blocked flush is still done once that flush returns (not waited for)."""

from __future__ import annotations

import threading
import time

from otel_hicache.sinks import bounded_flush
class Provider:
    """force_flush blocks until ``release`` is set; calls are noted."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[str] = []
        self.shut = threading.Event()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        self.calls.append("force_flush")
        self.release.wait(30)
        return True

    def shutdown(self, timeout_millis: int = 30_000) -> None:
        self.calls.append("shutdown")
        self.shut.set()


def test_a_shutdown_behind_a_blocked_flush_runs_once_the_flush_returns():
    tracer, meter = Provider(), Provider()
    meter.release.set()  # only the tracer provider's flush blocks (a stalled collector)
    assert bounded_flush.bounded("force_flush", tracer, meter, 0.05) is False  # given up on
    started = time.monotonic()
    assert bounded_flush.bounded("shutdown", tracer, meter, 0.05) is False
    assert time.monotonic() - started < 1.0  # not waited for
    assert not tracer.shut.is_set()  # not while the flush is blocked
    tracer.release.set()
    assert tracer.shut.wait(5) and meter.shut.wait(5)  # then done, on its own
    assert tracer.calls == ["force_flush", "shutdown"]


def test_a_flush_behind_a_blocked_flush_is_skipped():
    tracer, meter = Provider(), Provider()
    meter.release.set()
    assert bounded_flush.bounded("force_flush", tracer, meter, 0.05) is False
    assert bounded_flush.bounded("force_flush", tracer, meter, 0.05) is False
    tracer.release.set()
    time.sleep(0.2)
    assert tracer.calls == ["force_flush"]  # the second was never run


def test_an_unblocked_call_returns_its_result():
    tracer, meter = Provider(), Provider()
    tracer.release.set()
    meter.release.set()
    assert bounded_flush.bounded("force_flush", tracer, meter, 5.0) is True
    assert bounded_flush.bounded("shutdown", tracer, meter, 5.0) is True
    assert tracer.shut.is_set() and meter.shut.is_set()
