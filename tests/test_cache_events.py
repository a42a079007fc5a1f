"""Prefix hits per tier, dropped and evicted tokens: exact, cheap, zero series from the start."""

from __future__ import annotations

import os

import pytest

from otel_hicache import semconv as sc
from otel_hicache.capture.cache_events import CacheEvents


def _points(h, name):
    return {tuple(sorted((k, v) for k, v in p.attributes.items())): p.value for p in h.points(name)}


def test_zero_series_exist_at_start_up_with_the_static_attributes(harness):
    h = harness(attributes={"tp_rank": 1, "pp_rank": 0})
    assert _points(h, "hicache.prefix.tokens") == {
        (("hicache.tier", tier), ("pp_rank", 0), ("tp_rank", 1)): 0 for tier in ("device", "host", "storage")
    }
    assert _points(h, "hicache.dropped_tokens") == {
        (("hicache.pool", "kv"), ("pp_rank", 0), ("reason", reason), ("tp_rank", 1)): 0
        for reason in ("host_pressure", "write_through_unbacked_eviction")
    }
    assert _points(h, "hicache.evicted_tokens") == {
        (("hicache.tier", tier), ("pp_rank", 0), ("tp_rank", 1)): 0 for tier in ("device", "host")
    }


def test_counts_are_exact_cumulative_totals(harness):
    h = harness()
    events = h.tel.cache_events
    for i in range(100):
        events.prefix_tokens(device=i, host=2 * i, storage=0)
    events.dropped_tokens(64, sc.DROP_HOST_PRESSURE)
    events.dropped_tokens(32, "some_future_reason", pool="swa")
    events.evicted_tokens(128, sc.TIER_DEVICE)
    events.evicted_tokens(0, sc.TIER_HOST)
    assert h.value("hicache.prefix.tokens", **{"hicache.tier": "device"}) == sum(range(100))
    assert h.value("hicache.prefix.tokens", **{"hicache.tier": "host"}) == 2 * sum(range(100))
    assert h.value("hicache.prefix.tokens", **{"hicache.tier": "storage"}) == 0
    assert h.value("hicache.dropped_tokens", reason="host_pressure") == 64
    assert h.value("hicache.dropped_tokens", reason="some_future_reason", **{"hicache.pool": "swa"}) == 32
    assert h.value("hicache.evicted_tokens", **{"hicache.tier": "device"}) == 128
    # a second collection reports the same cumulative totals (no double counting)
    assert h.value("hicache.evicted_tokens", **{"hicache.tier": "device"}) == 128
    events.evicted_tokens(2, sc.TIER_DEVICE)
    assert h.value("hicache.evicted_tokens", **{"hicache.tier": "device"}) == 130


def test_bad_counts_warn_once_and_never_raise(harness, warnings_log):
    h = harness()
    events = h.tel.cache_events
    events.prefix_tokens("x", None, 1)
    events.dropped_tokens(object(), "r")
    events.dropped_tokens(object(), "r")
    events.evicted_tokens(5, "host")
    assert h.value("hicache.evicted_tokens", **{"hicache.tier": "host"}) == 5
    messages = [r.getMessage() for r in warnings_log.records]
    assert len([m for m in messages if "dropped count" in m]) == 1
    assert len([m for m in messages if "prefix count" in m]) == 1


def test_counts_made_before_the_sinks_exist_are_kept():
    """The capture's totals, sent with the poller's state, are what the sinks' counters report."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_hicache.sinks.cache_events import CacheEventCounters

    events = CacheEvents({"tp_rank": 0})
    events.evicted_tokens(7, "host")
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    counters = CacheEventCounters(provider, {"tp_rank": 0})
    counters.totals = events.changed()
    assert events.changed() is None  # nothing new since: the poller sends nothing more
    data = reader.get_metrics_data()
    values = {(m.name, p.attributes.get("hicache.tier")): p.value
              for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
              for p in m.data.data_points}
    assert values[("hicache.evicted_tokens", "host")] == 7
    assert events.total("evicted", **{"hicache.tier": "host"}) == 7
    provider.shutdown()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX-only")
def test_a_forked_child_starts_from_zero():
    events = CacheEvents()
    events.evicted_tokens(7, "host")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.write(write, str(events.total("evicted")).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 32) == b"0"
    assert events.total("evicted") == 7
