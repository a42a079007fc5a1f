"""The two DEBUG lines per completed op, and their cost when DEBUG is off."""

from __future__ import annotations

import logging

from otel_hicache.sinks import logs
def test_two_debug_lines_per_op_with_trace_ids(harness, caplog):
    caplog.set_level(logging.DEBUG, logger="otel_hicache")
    h = harness()
    t0 = h.device.time_ns()
    for i in range(2):
        ev0, ev1 = h.device.copy(t0 + i * 10_000_000, 6.781)
        h.tel.submit("onboard", {"kv": 1408}, 161_480_704, page_size=64, start_event=ev0, finish_event=ev1,
                     expect_ack=False)
    h.device.advance(ms=30)
    spans = h.finished()
    lines = [r for r in caplog.records if r.levelno == logging.DEBUG and "transfer" in r.getMessage()]
    assert len(lines) == 4
    per_op, cumulative = lines[2].getMessage(), lines[3].getMessage()
    assert per_op.startswith("Onboard transfer complete ts_us=")
    assert "blocks=22 bytes=161480704 tokens=1408 xfer_us=6781.0 bandwidth=23.81GB/s" in per_op
    assert 'src="L2" dst="L1" timing_source=device_event' in per_op
    assert ('Onboard transfer cumulative direction="onboard" total_events=2 total_blocks=44 '
            "total_bytes=322961408 total_tokens=2816 total_busy_us=13562.0 bandwidth=23.81GB/s") in cumulative
    span_ids = {f"{s.context.span_id:016x}" for s in spans}
    assert {lines[0].otelSpanID, lines[2].otelSpanID} == span_ids
    assert f"span_id={lines[2].otelSpanID}" in per_op


def test_no_formatting_when_debug_is_off(harness, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="otel_hicache")
    calls = []
    monkeypatch.setattr(logs.logger, "debug", lambda *a, **k: calls.append(a))
    h = harness()
    for _ in range(5):
        h.tel.submit("offload", {"kv": 64}, 10, page_size=64, expect_ack=False, host_start_ns=0, host_end_ns=5)
    assert len(h.finished()) == 5
    assert calls == []
