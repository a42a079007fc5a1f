"""``ack_watch``: the ack time of ops whose consumer never calls ``ack()``.

Frameworks consume acks in many places (pop, clear, reset). Instead of wrapping
each consumer, an op can name the container its ack sits in; the poller stamps
the ack time when the item is gone from it.
"""

from __future__ import annotations

from collections import deque

import pytest

from otel_hicache.capture.records import DIRECT, MERGED_OP


def _submit(h, queue, item, **kwargs):
    ev0, ev1 = h.device.copy(h.device.time_ns() + 200_000, 6.781)
    return h.tel.submit("onboard", {"kv": 1408}, 161_480_704, page_size=64, start_event=ev0, finish_event=ev1,
                        ack_watch=(queue, item), **kwargs)


@pytest.mark.parametrize("container", [list, deque])
def test_the_ack_time_is_when_the_item_left_its_container(harness, container):
    h = harness()
    item = object()
    queue = container([object(), item, object()])
    _submit(h, queue, item)
    h.device.advance(ms=7)
    assert h.flush()
    assert h.spans.get_finished_spans() == ()  # complete, its ack still queued
    h.device.advance(seconds=5.75)
    queue.remove(item)  # the consumer took it (others stay)
    [span] = h.finished()
    a = span.attributes
    assert a["hicache.acked"] is True
    assert a["hicache.origin"] == MERGED_OP
    # ack observed at the simulated clock's now: 7 ms + 5.75 s after submit
    assert a["hicache.ack_delay_us"] == (7_000_000 + 5_750_000_000 - 6_981_000) / 1e3
    assert span.end_time - span.start_time == 6_781_000  # the ack never lengthens the DMA
    ack = h.value("hicache.transfer.ack_delay", **{"hicache.direction": "onboard"})
    assert ack.count == 1 and ack.sum == pytest.approx(5.750019)


def test_an_ack_taken_before_completion_was_observed_counts_at_completion(harness):
    """A blocking flush synchronizes and clears the queue before the poller polls."""
    h = harness()
    item = object()
    queue = [item]
    _submit(h, queue, item)
    h.device.advance(ms=7)
    queue.clear()
    [span] = h.finished()
    assert span.attributes["hicache.acked"] is True
    assert span.attributes["hicache.ack_delay_us"] == pytest.approx(19.0)  # 7 ms - 6.981 ms


def test_items_that_stay_queued_are_not_acked(harness, monkeypatch):
    monkeypatch.setenv("OTEL_HICACHE_ACK_TIMEOUT_S", "1")
    h = harness()
    queue = []
    items = [object() for _ in range(3)]
    for item in items:
        queue.append(item)
        _submit(h, queue, item)
    h.device.advance(ms=7)
    queue.pop(0)  # only the first is consumed
    spans = h.finished()
    assert [s.attributes["hicache.acked"] for s in spans] == [True]
    h.device.advance(seconds=2)  # the other two time out unacked
    spans = h.finished()
    assert sorted(s.attributes["hicache.acked"] for s in spans) == [False, False, True]


def test_an_explicit_ack_still_wins(harness):
    h = harness()
    item = object()
    queue = [item]
    handle = _submit(h, queue, item)
    h.device.advance(ms=7)
    h.tel.ack(handle)
    [span] = h.finished()
    assert span.attributes["hicache.ack_delay_us"] == pytest.approx(19.0)
    assert queue == [item]


def test_a_malformed_watch_is_ignored_with_one_warning_and_the_op_still_reported(harness, warnings_log):
    h = harness()
    for _ in range(2):
        ev0, ev1 = h.device.copy(h.device.time_ns(), 1.0)
        h.tel.submit("offload", {"kv": 64}, 64, page_size=64, start_event=ev0, finish_event=ev1,
                     ack_watch="not a tuple")
    h.device.advance(ms=2)
    h.tel.shutdown()
    spans = h.spans.get_finished_spans()
    assert [s.attributes["hicache.acked"] for s in spans] == [False, False]
    assert len([r for r in warnings_log.records if "ack_watch" in r.getMessage()]) == 1


def test_direct_copies_say_so(harness):
    h = harness()
    h.tel.submit("offload", {"kv": 64}, 64, page_size=64, expect_ack=False, host_start_ns=0, host_end_ns=5)
    [span] = h.finished()
    assert span.attributes["hicache.origin"] == DIRECT
    assert "hicache.acked" not in span.attributes
    assert h.value("hicache.transfer.bytes", **{"hicache.direction": "offload", "hicache.origin": DIRECT}) == 64
    assert h.value("hicache.transfer.bytes", **{"hicache.direction": "offload", "hicache.origin": MERGED_OP}) == 0
