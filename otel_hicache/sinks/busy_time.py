"""Busy time: the union of device-busy intervals. Total bytes over the sum of durations is wrong
when transfers overlap; ``rate(bytes) / rate(busy_time)`` is the throughput while busy."""

from __future__ import annotations

from bisect import bisect_left, bisect_right

_BULK = 1024  # forgotten intervals are deleted together, once this many or half the list


class BusyTimeTracker:
    """Disjoint sorted intervals. Those ending ``horizon_ns`` before the newest or before a
    :meth:`forget_before` cutoff are forgotten (one overlapping them later counts in full)."""

    __slots__ = ("_starts", "_ends", "_horizon_ns", "latest_end")

    def __init__(self, horizon_ns: int = 120 * 10**9) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._horizon_ns = horizon_ns
        self.latest_end: int | None = None

    def add(self, start_ns: int, end_ns: int) -> int:
        """Record ``[start_ns, end_ns)`` in any order; return how many ns it adds to the union."""
        if end_ns <= start_ns:
            return 0
        starts, ends = self._starts, self._ends
        lo, hi = bisect_left(ends, start_ns), bisect_right(starts, end_ns)  # the intervals it touches
        added = end_ns - start_ns - sum(max(0, min(e, end_ns) - max(s, start_ns))
                                        for s, e in zip(starts[lo:hi], ends[lo:hi]))
        merged = (min(start_ns, starts[lo]), max(end_ns, ends[hi - 1])) if lo < hi else (start_ns, end_ns)
        starts[lo:hi], ends[lo:hi] = [merged[0]], [merged[1]]
        if self.latest_end is None or end_ns > self.latest_end:
            self.latest_end = end_ns
            self.forget_before(end_ns - self._horizon_ns)
        return added

    def forget_before(self, cutoff_ns: int) -> None:
        """Forget intervals ending before ``cutoff_ns`` (lazily, in bulk)."""
        ends = self._ends
        if ends and ends[0] < cutoff_ns:
            n = bisect_left(ends, cutoff_ns)
            if n >= _BULK or 2 * n >= len(ends):
                del self._starts[:n], ends[:n]

    def __len__(self) -> int:
        return len(self._starts)
