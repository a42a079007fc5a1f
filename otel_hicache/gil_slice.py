"""Cooperative GIL slices (``OTEL_HICACHE_GIL_SLICE_US``): otel-hicache's threads hold the
GIL a bounded time, then step aside.

A thread that holds the GIL delays every thread that wakes up meanwhile (SGLang's scheduler
back from a device wait, a socket, a sleep) by the rest of its hold, up to the switch interval
(``sys.getswitchinterval()``, 5 ms). A release that does not sleep (``time.sleep(0)``) rarely
hands the GIL over: the releasing thread takes it back before the waiter, woken by the OS, runs.

So, when enabled, otel-hicache's threads that do Python work in bulk (the completion worker,
the span export helper's writer) work in *turns*: one at a time (a lock shared by them, waited
for with the GIL released), and one that has held the GIL for the budget since its turn began
or it last paused sleeps :data:`PAUSE_S`, keeping its turn, so that the GIL goes to a thread
that is not otel-hicache's. Each pause costs the pausing thread a wake-up (a timed sleep): the
trade is measured in ``docs/performance.md`` ("Cooperative GIL slices").
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from . import fork

# Long enough for a thread the OS has just woken to take the GIL (tens of us); the kernel's
# default timer slack (50 us) makes the sleep itself 60-100 us.
PAUSE_S = 10e-6
# A turn is waited for at most this long: no thread stalls behind one that is stuck.
_TURN_WAIT_S = 0.05

_turn = threading.Lock()


def _new_turn() -> None:
    global _turn
    _turn = threading.Lock()  # the parent's may have been held by one of its threads at fork


fork.after_fork_in_child(_new_turn)


def _nothing() -> None:
    return None


class GilSlice:
    """One per thread. ``begin()``/``end()`` around a turn of work, ``check()`` between two
    units of it: past the budget, a pause. A budget of 0 (the default) makes all three no-ops;
    so does ``begin(sliced=False)`` for one turn (a backlog to catch up on)."""

    __slots__ = ("budget_ns", "pauses", "check", "_since", "_held")

    def __init__(self, budget_us: float) -> None:
        self.budget_ns = int(budget_us * 1000)
        self.pauses = 0  # pauses taken (tests, benchmarks)
        self.check: Callable[[], None] = _nothing
        self._since = 0
        self._held: threading.Lock | None = None

    def begin(self, sliced: bool = True) -> None:
        if self.budget_ns <= 0 or not sliced:
            self.check = _nothing
            return
        turn = _turn
        self._held = turn if turn.acquire(timeout=_TURN_WAIT_S) else None
        self._since = time.monotonic_ns()
        self.check = self._check

    def end(self) -> None:
        self.check = _nothing
        held, self._held = self._held, None
        if held is not None:
            held.release()

    def _check(self) -> None:
        if time.monotonic_ns() - self._since >= self.budget_ns:
            time.sleep(PAUSE_S)
            self.pauses += 1
            self._since = time.monotonic_ns()
