"""Union of device-busy intervals, for throughput that is right under overlap.

``total bytes / sum of durations`` under-reports bandwidth by the concurrency
factor when transfers overlap, and ``rate(bytes)`` alone includes idle time.
:class:`BusyTimeTracker` adds to a counter only the part of each new interval
not already covered, so ``rate(bytes) / rate(busy_time)`` is the throughput
while the link was busy. Intervals may arrive in any order; those ending more
than ``horizon_ns`` before the newest one are forgotten (an interval arriving
that late is counted in full), and so are those ending before the cutoff the
consumer passes to :meth:`BusyTimeTracker.forget_before` (no interval
still to come can start before it). Forgetting is lazy: expired intervals are
deleted in bulk once they are half the list, so each costs O(1) amortized (a
one-by-one delete from the front of a list of 200k intervals, 120 s at 1,700
ops/s, cost 46 us per op).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right


_BULK = 1024  # expired intervals deleted together at the latest


class BusyTimeTracker:
    __slots__ = ("_starts", "_ends", "_horizon_ns", "_latest_end")

    def __init__(self, horizon_ns: int = 120 * 10**9) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._horizon_ns = horizon_ns
        self._latest_end = 0

    def add(self, start_ns: int, end_ns: int) -> int:
        """Record ``[start_ns, end_ns)``; return how many ns it adds to the union."""
        if end_ns <= start_ns:
            return 0
        starts, ends = self._starts, self._ends
        # merged intervals are disjoint and sorted; find those touching [start, end]
        lo = bisect_left(ends, start_ns)
        hi = bisect_right(starts, end_ns)
        covered = 0
        new_start, new_end = start_ns, end_ns
        for i in range(lo, hi):
            s, e = starts[i], ends[i]
            covered += min(e, end_ns) - max(s, start_ns) if min(e, end_ns) > max(s, start_ns) else 0
            if s < new_start:
                new_start = s
            if e > new_end:
                new_end = e
        starts[lo:hi] = [new_start]
        ends[lo:hi] = [new_end]
        if end_ns > self._latest_end:
            self._latest_end = end_ns
            self._prune()
        return (end_ns - start_ns) - covered

    @property
    def latest_end(self) -> int | None:
        """The end of the newest interval, or None before the first."""
        return self._latest_end or None

    def _prune(self) -> None:
        self.forget_before(self._latest_end - self._horizon_ns)

    def forget_before(self, cutoff_ns: int) -> None:
        """Forget intervals ending before ``cutoff_ns`` (lazily, in bulk): an
        interval added later that overlaps them is counted in full."""
        ends = self._ends
        if ends and ends[0] < cutoff_ns:
            n = bisect_left(ends, cutoff_ns)
            if n >= _BULK or 2 * n >= len(ends):
                del self._starts[:n]
                del ends[:n]

    def __len__(self) -> int:
        return len(self._starts)
