"""Busy time: the union of the ops' intervals (summed durations overcount overlapping ones)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right

_BULK = 1024  # forgotten intervals are deleted once this many or half the list
HORIZON_NS = 120 * 10**9


class BusyTimeTracker:
    """Disjoint sorted intervals, forgotten ``HORIZON_NS`` before the newest end."""

    __slots__ = ("_starts", "_ends", "latest_end")

    def __init__(self) -> None:
        self._starts, self._ends, self.latest_end = [], [], None

    def add(self, start_ns: int, end_ns: int) -> int:
        if end_ns <= start_ns:
            return 0
        starts, ends = self._starts, self._ends
        lo, hi = bisect_left(ends, start_ns), bisect_right(starts, end_ns)
        added = end_ns - start_ns - sum(max(0, min(e, end_ns) - max(s, start_ns))
                                        for s, e in zip(starts[lo:hi], ends[lo:hi]))
        if lo < hi:
            start_ns, end_ns = min(start_ns, starts[lo]), max(end_ns, ends[hi - 1])
        starts[lo:hi], ends[lo:hi] = [start_ns], [end_ns]
        if self.latest_end is None or end_ns > self.latest_end:
            self.latest_end = end_ns
            self.forget_before(end_ns - HORIZON_NS)
        return added

    def forget_before(self, cutoff_ns: int) -> None:
        n = bisect_left(self._ends, cutoff_ns)
        if n and (n >= _BULK or 2 * n >= len(self._ends)):
            del self._starts[:n], self._ends[:n]
