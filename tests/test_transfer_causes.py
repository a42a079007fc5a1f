"""``submit(cause=...)`` and ``submit(cause_call=...)``: why an op moved its bytes, on spans and metrics."""

from __future__ import annotations

import logging

import pytest

from otel_hicache import semconv as sc
from otel_hicache.adapters import causes
from otel_hicache.capture.records import TransferRecord, validate
from harness import submission

CAUSE = sc.CAUSE


def _given(value):
    return value


def _record(direction="offload", pools=None, num_bytes=3000, cause=None, parts=None, call=None):
    r = TransferRecord(submission(direction, pools if pools is not None else {"kv": 30, "swa": 6}, num_bytes, 4,
                                  expect_ack=True, cause=cause, cause_call=(_given, parts) if parts else call))
    validate(r)
    return r


def test_no_cause_is_other_and_a_known_one_is_kept():
    assert (_record().cause, _record().cause_parts) == ("other", None)
    assert _record(cause="write_back").cause == "write_back"
    assert _record("onboard", cause="prefix_hit").cause == "prefix_hit"


@pytest.mark.parametrize("cause", ["prefix_hit", "invented", ""])  # prefix_hit is an onboard cause
def test_an_unknown_or_wrong_direction_cause_is_other_and_warned_once(cause, caplog):
    with caplog.at_level(logging.WARNING, logger="otel_hicache"):
        assert _record(cause=cause).cause == "other"
        assert _record(cause=cause).cause == "other"
    assert sum("is not a offload cause" in r.getMessage() for r in caplog.records) == 1


def test_parts_of_one_cause_make_that_cause_and_of_several_make_mixed():
    one = _record(parts=[("write_through", {"kv": 10, "swa": 2}, 1000), ("write_through", {"kv": 20, "swa": 4}, 2000)])
    assert (one.cause, one.cause_parts) == ("write_through", None)
    mixed = _record(parts=[("write_through", {"kv": 10, "swa": 2}, 1000), ("other", {"kv": 20}, 1500),
                           ("write_through", {"kv": 0}, 0), ("other", {"swa": 4}, 500)])
    assert mixed.cause == "mixed"
    assert mixed.cause_parts == (("other", ("kv", "swa"), (20, 4), 2000),
                                 ("write_through", ("kv", "swa"), (10, 2), 1000))


def test_a_cause_call_is_made_on_the_worker_and_one_that_raises_makes_other(caplog):
    calls = []
    parts = [("write_through", {"kv": 10, "swa": 2}, 1000), ("write_back", {"kv": 20, "swa": 4}, 2000)]
    deferred = _record(call=(lambda: calls.append(1) or parts,))
    assert (deferred.cause, deferred.cause_parts, calls) == (
        "mixed", (("write_back", ("kv", "swa"), (20, 4), 2000), ("write_through", ("kv", "swa"), (10, 2), 1000)), [1])
    assert _record(call=(lambda: "write_back",)).cause == "write_back"
    assert _record(call=(calls.append, 2)).cause == "other" and calls == [1, 2]  # (function, *args): None
    assert _record(call=(str.strip, " write_back ")).cause == "write_back"
    assert _record(cause="write_back", call=(str, "write_through")).cause == "write_through"  # the call wins
    assert _record(cause=[("write_back", {"kv": 30, "swa": 6}, 3000)]).cause == "other"  # parts only by a call

    def broken():
        raise KeyError("gone")

    with caplog.at_level(logging.WARNING, logger="otel_hicache"):
        assert [(_record(call=(broken,)).cause, _record(call=(broken,)).cause_parts)] == [("other", None)]
    assert sum("could not work out an op's cause" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("parts", [
    [("write_through", {"kv": 10}, 1000), ("other", {"kv": 20, "swa": 6}, 1999)],  # a byte short
    [("write_through", {"kv": 10}, 1000), ("other", {"kv": 21, "swa": 6}, 2000)],  # a token more
    [("write_through", {"kv": -1}, 1000)],
    [("write_through", 5)],
    "write_through write_back".split(),
    7,
])
def test_parts_that_do_not_sum_to_the_op_make_it_other_warned_once(parts, caplog):
    with caplog.at_level(logging.WARNING, logger="otel_hicache"):
        assert (_record(parts=parts).cause, _record(parts=parts).cause_parts) == ("other", None)
    assert sum("cause parts are malformed" in r.getMessage() for r in caplog.records) == 1


def test_spans_and_metrics_by_cause_sum_exactly_to_the_totals(harness):
    h = harness()
    h.tel.submit("offload", {"kv": 64}, 6400, page_size=4, expect_ack=False, host_start_ns=1, host_end_ns=2,
                 cause="retraction_backup")
    h.tel.submit("offload", {"kv": 30, "swa": 6}, 3000, page_size=4, expect_ack=False, host_start_ns=1, host_end_ns=2,
                 cause_call=(_given, [("write_through", {"kv": 10, "swa": 2}, 1000),
                                      ("write_back", {"kv": 20, "swa": 4}, 2000)]))
    h.tel.submit("onboard", {"kv": 8}, 800, page_size=4, expect_ack=False, host_start_ns=1, host_end_ns=2)
    spans = sorted(h.finished(), key=lambda s: s.attributes["hicache.tokens"])
    assert [(s.attributes[CAUSE], s.attributes.get(sc.CAUSES_ATTR)) for s in spans] == [
        ("other", None), ("mixed", ("write_back", "write_through")), ("retraction_backup", None)]

    def tokens(cause, pool="kv", direction="offload"):
        return h.value("hicache.transfer.tokens", **{CAUSE: cause, sc.POOL: pool, sc.DIRECTION: direction})

    assert (tokens("write_through"), tokens("write_through", "swa"), tokens("write_back"), tokens("write_back", "swa"),
            tokens("retraction_backup"), tokens("other", direction="onboard")) == (10, 2, 20, 4, 64, 8)
    by_cause = {c: h.value("hicache.transfer.bytes", **{CAUSE: c, sc.DIRECTION: "offload"})
                for c in causes()["offload"]}
    assert by_cause == {"write_through": 1000, "write_through_selective": 0, "write_back": 2000, "storage_backup": 0,
                        "decode_offload": 0, "retraction_backup": 6400, "other": 0}
    assert sum(by_cause.values()) == h.value("hicache.transfer.bytes", **{sc.DIRECTION: "offload"}) == 9400
    # one op per duration point: the mixed op under `mixed`, never split
    assert h.value("hicache.transfer.duration", **{CAUSE: "mixed"}).count == 1
    assert not [p for p in h.points("hicache.transfer.bytes") if p.attributes[CAUSE] == "mixed"]
