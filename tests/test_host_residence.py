"""Host residence and lineage: how long offloaded pages sat in host memory before a load-back
used them, which offload wrote them (span links), and what was freed without reuse."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from otel_hicache import semconv as sc
from otel_hicache.adapters import causes
from otel_hicache import record as rec
from otel_hicache.sinks.host_residence import MAX_LINKS, OFFLOAD_CAUSES, HostPool

PAGE = 4
BYTES_PER_TOKEN = 1000


@pytest.fixture(autouse=True)
def _on(monkeypatch):
    monkeypatch.setenv("OTEL_HICACHE_HOST_RESIDENCE", "true")  # (the default, whatever the environment)


def test_on_by_default_and_off_with_false(harness, monkeypatch):
    monkeypatch.delenv("OTEL_HICACHE_HOST_RESIDENCE")
    h = harness()
    assert h.tel.host_pool(64, PAGE) is not None
    monkeypatch.setenv("OTEL_HICACHE_HOST_RESIDENCE", "false")
    assert h.tel.host_pool(64, PAGE) is None
    h.tel.host_freed(None, [0])  # and a free of no pool is nothing


def _op(h, direction, slots, pool, cause, ms=1.0):
    """One op over ``slots`` (token slots of ``pool``), device-timed, nobody acks it."""
    ev0, ev1 = h.device.copy(h.device.time_ns() + 10_000, ms)
    tokens = len(slots)
    handle = h.tel.submit(direction, {"kv": tokens}, tokens * BYTES_PER_TOKEN, page_size=PAGE, start_event=ev0,
                          finish_event=ev1, expect_ack=False, cause=cause,
                          host_slots=(pool, np.asarray(slots, dtype=np.int64)))
    h.device.advance(ms=ms + 1)
    assert h.flush()
    return handle


def test_residence_is_the_gap_between_the_offload_and_the_load_back(harness):
    h = harness()
    pool = h.tel.host_pool(64, PAGE)
    _op(h, "offload", range(0, 16), pool, "write_through")
    h.device.advance(seconds=2.5)
    _op(h, "onboard", range(0, 16), pool, "prefix_hit")
    offload, onboard = h.finished()
    point = h.value("hicache.host.residence_time", **{sc.CAUSE: "prefix_hit", sc.OFFLOAD_CAUSE: "write_through"})
    # submit to submit: the offload's 1 + 1 ms of device time, then 2.5 s, then the 10 us the copy waits
    gap_s = (1 + 1) / 1e3 + 2.5
    assert (point.count, point.sum) == (1, pytest.approx(gap_s, abs=1e-9))
    a = onboard.attributes
    assert a[sc.RESIDENCE_MIN_US] == a[sc.RESIDENCE_MAX_US] == pytest.approx(gap_s * 1e6, abs=1e-3)
    assert sc.UNKNOWN_PAGES not in a and sc.RESIDENCE_MIN_US not in offload.attributes
    # the load-back links to the offload span that wrote its pages
    assert [(link.context.trace_id, link.context.span_id) for link in onboard.links] == [
        (offload.context.trace_id, offload.context.span_id)]
    assert h.value("hicache.host.reloaded_bytes", **{sc.OFFLOAD_CAUSE: "write_through"}) == 16 * BYTES_PER_TOKEN


def test_pages_of_several_offloads_one_value_each_and_min_max_on_the_span(harness):
    h = harness()
    pool = h.tel.host_pool(64, PAGE)
    _op(h, "offload", range(0, 8), pool, "write_through")
    h.device.advance(seconds=1)
    _op(h, "offload", range(8, 16), pool, "write_back")
    h.device.advance(seconds=1)
    _op(h, "onboard", range(0, 16), pool, "prefix_hit")
    *_, onboard = h.finished()
    values = {c: h.value("hicache.host.residence_time", **{sc.OFFLOAD_CAUSE: c}) for c in ("write_through", "write_back")}
    assert {c: p.count for c, p in values.items()} == {"write_through": 1, "write_back": 1}
    assert values["write_through"].sum == pytest.approx(2 * 0.002 + 2.0, abs=1e-9)
    assert values["write_back"].sum == pytest.approx(0.002 + 1.0, abs=1e-9)
    a = onboard.attributes
    assert (a[sc.RESIDENCE_MIN_US], a[sc.RESIDENCE_MAX_US]) == (pytest.approx(1.002e6), pytest.approx(2.004e6))
    assert len(onboard.links) == 2  # newest first
    assert h.value("hicache.host.reloaded_bytes", **{sc.OFFLOAD_CAUSE: "write_back"}) == 8 * BYTES_PER_TOKEN


def test_freed_without_a_load_back_is_wasted_and_after_one_is_not(harness):
    h = harness()
    pool = h.tel.host_pool(64, PAGE)
    _op(h, "offload", range(0, 16), pool, "write_through")
    _op(h, "offload", range(16, 24), pool, "write_back")
    _op(h, "onboard", range(0, 8), pool, "prefix_hit")  # half of the first offload is used
    h.tel.host_freed(pool, np.arange(0, 24))
    assert h.flush()
    wasted = {c: (h.value("hicache.host.wasted_bytes", **{sc.OFFLOAD_CAUSE: c}),
                  h.value("hicache.host.wasted_tokens", **{sc.OFFLOAD_CAUSE: c})) for c in ("write_through", "write_back")}
    assert wasted == {"write_through": (8 * BYTES_PER_TOKEN, 8), "write_back": (8 * BYTES_PER_TOKEN, 8)}
    # freed pages are no longer resident: reading them again knows nothing of them
    _op(h, "onboard", range(0, 8), pool, "prefix_hit")
    assert h.finished()[-1].attributes[sc.UNKNOWN_PAGES] == 2
    # zero series for every offload cause from start-up
    assert {p.attributes[sc.OFFLOAD_CAUSE] for p in h.points("hicache.host.wasted_bytes")} == set(
        (*causes()["offload"], sc.CAUSE_MIXED))


def test_a_page_offloaded_again_without_a_free_wastes_the_unread_write(harness):
    h = harness()
    pool = h.tel.host_pool(64, PAGE)
    _op(h, "offload", range(0, 8), pool, "write_through")
    h.device.advance(seconds=5)
    _op(h, "offload", range(0, 8), pool, "retraction_backup")  # the same host pages, written again
    h.device.advance(seconds=1)
    _op(h, "onboard", range(0, 8), pool, "retraction_restore")
    assert h.value("hicache.host.wasted_bytes", **{sc.OFFLOAD_CAUSE: "write_through"}) == 8 * BYTES_PER_TOKEN
    [point] = [p for p in h.points("hicache.host.residence_time")]
    assert point.attributes[sc.OFFLOAD_CAUSE] == "retraction_backup" and point.sum == pytest.approx(1.002)


def test_a_restart_knows_nothing_of_earlier_pages(harness):
    """Host memory outlives no process: a new process's pool starts empty."""
    first = harness()
    pool = first.tel.host_pool(64, PAGE)
    _op(first, "offload", range(0, 8), pool, "write_through")
    second = harness()  # the restarted process
    pool = second.tel.host_pool(64, PAGE)
    _op(second, "onboard", range(0, 8), pool, "prefix_hit")
    second.tel.host_freed(pool, range(0, 8))
    [span] = second.finished()
    assert span.attributes[sc.UNKNOWN_PAGES] == 2 and sc.RESIDENCE_MIN_US not in span.attributes
    assert not span.links
    assert not [p for p in second.points("hicache.host.residence_time")]
    assert second.value("hicache.host.reloaded_bytes") == second.value("hicache.host.wasted_bytes") == 0


def test_links_are_bounded_and_the_rest_counted(harness):
    h = harness()
    pool = h.tel.host_pool(4 * (MAX_LINKS + 5), PAGE)
    for page in range(MAX_LINKS + 5):
        _op(h, "offload", range(page * PAGE, (page + 1) * PAGE), pool, "write_through")
    _op(h, "onboard", range(0, (MAX_LINKS + 5) * PAGE), pool, "prefix_hit")
    *offloads, onboard = h.finished()
    assert len(onboard.links) == MAX_LINKS and onboard.attributes[sc.LINKS_DROPPED] == 5
    newest = [o.context.span_id for o in offloads[::-1][:MAX_LINKS]]
    assert [link.context.span_id for link in onboard.links] == newest
    assert h.value("hicache.host.residence_time", **{sc.CAUSE: "prefix_hit"}).count == MAX_LINKS + 5


def test_bad_slots_never_raise_and_the_op_is_still_reported(harness, caplog):
    h = harness()
    pool = h.tel.host_pool(16, PAGE)
    with caplog.at_level(logging.WARNING, logger="otel_hicache"):
        _op(h, "offload", [0, 1, 2, 3, 400, -4], pool, "write_through")  # two slots outside the pool
        h.tel.submit("offload", {"kv": 4}, 4000, page_size=PAGE, expect_ack=False, host_start_ns=1, host_end_ns=2,
                     host_slots=("not a pool", [0]))
        h.tel.submit("offload", {"kv": 4}, 4000, page_size=PAGE, expect_ack=False, host_start_ns=1, host_end_ns=2,
                     host_slots=(pool, ["a"]))
        h.tel.host_freed(pool, object())
        assert len(h.finished()) == 3
    messages = [r.getMessage() for r in caplog.records]
    assert sum("outside the kv host pool" in m for m in messages) == 1
    assert sum("host_slots must be" in m for m in messages) == 1
    assert sum("cannot track an op's host pages" in m for m in messages) == 1
    assert sum("cannot track freed host pages" in m for m in messages) == 1
    assert h.tel.channel.consumer._pools[pool.pool_id].written_ns[0] != 0  # the in-range page was tracked


def _pages(pool, slots):
    return pool.pages(rec.slot_bytes(slots)).tolist()


def test_bookkeeping_memory_per_page_and_pages():
    pool = HostPool(1000, 64)
    columns = (pool.written_ns, pool.cause, pool.page_bytes, pool.trace_hi, pool.trace_lo, pool.span_id, pool.reloaded)
    assert pool.size == 16 and sum(c.itemsize for c in columns) == 8 + 1 + 8 + 8 + 8 + 8 + 1 == 42  # per page
    assert _pages(pool, [130, 0, 63, 64, 999]) == [0, 1, 2, 15]
    assert _pages(pool, np.arange(64, 192)) == [1, 2]
    assert _pages(pool, [np.arange(0, 4), np.arange(640, 644)]) == [0, 10]
    assert _pages(pool, np.arange(0, 130).reshape(2, 65)) == [0, 1, 2]  # 2-D: read flat
    assert _pages(pool, [5, 3, 70, 64, 3]) == [0, 1]
    assert _pages(HostPool(10, 1), [3, 3, 1, 9]) == [1, 3, 9]


@pytest.mark.parametrize("c_json", [True, False], ids=["c-encoder", "json.dumps"])
def test_host_slots_travel_as_bytes_after_the_json_of_their_frame(monkeypatch, c_json):
    assert rec._C_JSON  # CPython's C encoder, made directly, takes the signature it was built for
    monkeypatch.setattr(rec, "_C_JSON", c_json)
    slots = rec.slot_bytes(np.arange(0, 4096))
    batch = [[rec.HOST, 7, 1, rec.OFFLOAD, slots, 5, "x", 9], [rec.FREE, 1, slots[:16]], [rec.DROPPED, "r", 1]]
    frame = rec.encode(batch)
    length, size = rec.FRAME_HEADER.unpack_from(frame)
    assert size == len(slots) + 16 and len(frame) == rec.FRAME_HEADER.size + length + size
    assert len(frame) - size < 200  # the JSON holds their place, not their text
    assert rec.decode(frame) == batch
    placed = [[rec.HOST, 7, 1, rec.OFFLOAD, [0, len(slots)], 5, "x", 9], [rec.FREE, 1, [len(slots), 16]], batch[2]]
    assert frame[rec.FRAME_HEADER.size:][:length] == json.dumps(placed, separators=(",", ":")).encode()  # either way
    with pytest.raises(TypeError, match="set is not JSON serializable"):
        rec.encode([[rec.OP, {1}]])
    # a place outside the frame's slots is refused, never read past the frame
    bad = frame.replace(b'[%d,16]' % len(slots), b'[%d,17]' % len(slots))
    assert bad != frame
    with pytest.raises(ValueError, match="host slots not in their frame"):
        rec.decode(bad)


def test_torch_cpu_indices_are_read_in_place():
    import torch

    pool = HostPool(1000, 64)
    assert _pages(pool, torch.arange(128, 256)) == [2, 3]
    assert _pages(pool, [torch.arange(0, 4), torch.arange(640, 644)]) == [0, 10]  # SGLang's queued ops
    # a tensor not in host memory is refused before it is read (reading it would synchronize)
    with pytest.raises(TypeError, match="host memory"):
        rec.slot_bytes(torch.empty(4, dtype=torch.int64, device="meta"))


def test_answers_and_state_match_a_page_by_page_model():
    """Random offloads, links, load-backs and frees of random sizes and layouts (whole pages,
    partial pages, repeats, out of order, out of range), against a plain model of each page."""
    import random
    import warnings

    rng = random.Random(1234)
    pool, n = HostPool(4096, PAGE), len(OFFLOAD_CAUSES)
    model: dict[int, list] = {}  # page -> [written_ns, cause index, bytes, trace id, span id, reloaded]

    def slots():
        shape = rng.choice(("pages", "slots", "scattered"))
        if shape == "pages":
            first = rng.randrange(0, 1000)
            return list(range(first * PAGE, (first + rng.randrange(1, 40)) * PAGE))
        if shape == "slots":
            first = rng.randrange(0, 4000)
            return list(range(first, first + rng.randrange(1, 200)))  # may run past the pool's end
        return [rng.randrange(-8, 4200) for _ in range(rng.randrange(1, 30))]

    def waste(pages):
        found = [model[p] for p in pages if p in model and not model[p][5]]
        if not found:
            return None
        return ([sum(m[2] for m in found if m[1] == c) for c in range(n)],
                [sum(m[1] == c for m in found) * PAGE for c in range(n)])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3000):
            kind, when, arg = rng.random(), step + 1, slots()
            pages = pool.pages(rec.slot_bytes(arg))
            expected = sorted({s // PAGE for s in arg if 0 <= s // PAGE < pool.size})
            assert pages.tolist() == expected, step
            if kind < 0.45:
                cause, num_bytes = rng.choice(causes()["offload"]), rng.randrange(0, 1 << 20)
                want = waste(expected) if expected else None
                assert pool.written(pages, when, cause, num_bytes) == want, step
                base, extra = divmod(num_bytes, len(expected) or 1)
                for i, p in enumerate(expected):
                    model[p] = [when, OFFLOAD_CAUSES.index(cause), base + (i < extra), 0, 0, False]
                if rng.random() < 0.7:
                    trace, span = rng.getrandbits(128), rng.getrandbits(64) or 1
                    pool.link(pages, trace, span)
                    for p in expected:
                        model[p][3:5] = [trace, span]
            elif kind < 0.85:
                reuse = pool.read(pages, when)
                known = [p for p in expected if p in model]
                writes = sorted({model[p][0]: p for p in reversed(known)}.items())  # write time -> lowest page
                residence = [when - w for w, _ in writes]
                assert list(reuse.residence_ns) == residence and reuse.unknown_pages == len(expected) - len(known)
                assert list(reuse.causes) == [OFFLOAD_CAUSES[model[p][1]] for _, p in writes]
                assert reuse.bytes_by_cause == [sum(model[p][2] for p in known if model[p][1] == c) for c in range(n)]
                linked = [(model[p][3], model[p][4]) for _, p in writes[::-1] if model[p][4]]
                assert pool.links(reuse) == (linked[:MAX_LINKS], max(0, len(linked) - MAX_LINKS)), step
                for p in known:
                    model[p][5] = True
            else:
                assert pool.freed(pages) == (waste(expected) if expected else None), step
                for p in expected:
                    model.pop(p, None)
    assert sorted(np.flatnonzero(pool.written_ns).tolist()) == sorted(model)
    for p, (when, cause, num_bytes, trace, span, reloaded) in model.items():
        assert (pool.written_ns[p], pool.cause[p], pool.page_bytes[p], pool.span_id[p], pool.reloaded[p]) == (
            when, cause, num_bytes, span, reloaded)
        assert not span or (int(pool.trace_hi[p]) << 64 | int(pool.trace_lo[p])) == trace
    assert pool.reloaded.any() and (pool.span_id != 0).any()
