import random

from otel_hicache.busy_time import BusyTimeTracker


def test_overlapping_intervals_count_once():
    tracker = BusyTimeTracker()
    assert tracker.add(0, 10) == 10
    assert tracker.add(5, 15) == 5
    assert tracker.add(20, 30) == 10
    assert tracker.add(0, 40) == 15  # fills the gaps [15,20) and [30,40)
    assert tracker.add(1, 2) == 0
    assert len(tracker) == 1


def test_out_of_order_arrival_matches_a_brute_force_union():
    rng = random.Random(7)
    tracker = BusyTimeTracker()
    intervals = []
    total = 0
    for _ in range(500):
        start = rng.randrange(0, 10_000)
        end = start + rng.randrange(0, 300)
        intervals.append((start, end))
        total += tracker.add(start, end)
    covered = set()
    for start, end in intervals:
        covered.update(range(start, end))
    assert total == len(covered)


def test_empty_and_reversed_intervals_add_nothing():
    tracker = BusyTimeTracker()
    assert tracker.add(5, 5) == 0
    assert tracker.add(9, 3) == 0
    assert len(tracker) == 0


def test_old_intervals_are_forgotten_beyond_the_horizon():
    tracker = BusyTimeTracker(horizon_ns=100)
    tracker.add(0, 10)
    tracker.add(1000, 1010)
    assert len(tracker) == 1


def test_forget_before_is_lazy_and_bulk():
    tracker = BusyTimeTracker()
    for i in range(3000):
        tracker.add(i * 10, i * 10 + 5)
    tracker.forget_before(10 * 500)  # 500 expired of 3000: kept until they are half the list or 1024
    assert len(tracker) == 3000
    tracker.forget_before(10 * 1024)
    assert len(tracker) == 3000 - 1024
    assert tracker.add(0, 5) == 5  # forgotten: an interval overlapping them counts in full
    assert tracker.add(20_000, 20_005) == 0  # still known: no double count


def test_steady_state_add_costs_what_a_fresh_add_costs():
    """A long-lived tracker (200k intervals of history) used to pay a one-by-one
    delete from the front of its lists on every add."""
    import time

    def per_add(tracker, start, n=20_000):
        t0 = time.perf_counter()
        for i in range(n):
            tracker.add(start + i * 588, start + i * 588 + 60)
        return (time.perf_counter() - t0) / n

    fresh = per_add(BusyTimeTracker(horizon_ns=120_000_000), 0)
    old = BusyTimeTracker(horizon_ns=120_000_000)
    per_add(old, 0, n=204_000)  # 120 "s" of history at one op per 588 "ns"
    steady = per_add(old, 204_000 * 588)
    assert steady < 3 * fresh, (steady, fresh)
