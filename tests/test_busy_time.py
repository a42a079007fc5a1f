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
