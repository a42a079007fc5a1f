"""OTEL_HICACHE_* variables: defaults, parsing, and malformed values."""

from __future__ import annotations

import pytest

from otel_hicache import environment_variables as ev
from otel_hicache.environment_variables import env_bool, env_float, env_int


def test_every_variable_is_documented_with_a_default():
    names = [v for k, v in vars(ev).items() if k.startswith("OTEL_HICACHE_")]
    assert names and sorted(names) == sorted(ev.DEFAULTS)
    source = open(ev.__file__).read()
    for name in names:  # (docs/configuration.md has each one's row: test_docs_reference.py)
        [line] = [line for line in source.splitlines() if line.strip().startswith(f"{name}: ")]
        assert "  # " in line, line


def test_defaults_when_unset():
    assert env_bool(ev.OTEL_HICACHE_ENABLED) is True
    assert env_int(ev.OTEL_HICACHE_MAX_QUEUE_SIZE) == 16384
    assert env_float(ev.OTEL_HICACHE_SHUTDOWN_TIMEOUT_S) == 5.0


@pytest.mark.parametrize("raw, expected", [("false", False), ("False", False), ("TRUE", True), (" true ", True)])
def test_booleans(monkeypatch, warnings_log, raw, expected):
    monkeypatch.setenv(ev.OTEL_HICACHE_ENABLED, raw)
    assert env_bool(ev.OTEL_HICACHE_ENABLED) is expected
    assert not warnings_log.records


@pytest.mark.parametrize("raw", ["0", "1", "on", "yes", "off"])
def test_booleans_are_the_specifications_true_and_false_only(monkeypatch, warnings_log, raw):
    monkeypatch.setenv(ev.OTEL_HICACHE_HOST_RESIDENCE, raw)
    assert env_bool(ev.OTEL_HICACHE_HOST_RESIDENCE) is True  # the default, with one warning naming the variable
    [record] = warnings_log.records
    assert ev.OTEL_HICACHE_HOST_RESIDENCE in record.getMessage() and repr(raw) in record.getMessage()


@pytest.mark.parametrize(
    "name, raw, reader, default",
    [
        (ev.OTEL_HICACHE_ENABLED, "maybe", env_bool, True),
        (ev.OTEL_HICACHE_MAX_QUEUE_SIZE, "lots", env_int, 16384),
        (ev.OTEL_HICACHE_MAX_QUEUE_SIZE, "0", env_int, 16384),
        (ev.OTEL_HICACHE_SHUTDOWN_TIMEOUT_S, "-1", env_float, 5.0),
        (ev.OTEL_HICACHE_SHUTDOWN_TIMEOUT_S, "nan", env_float, 5.0),
    ],
)
def test_malformed_values_warn_naming_the_variable_and_use_the_default(monkeypatch, warnings_log, name, raw,
                                                                        reader, default):
    monkeypatch.setenv(name, raw)
    assert reader(name) == default
    assert reader(name) == default
    messages = [r.getMessage() for r in warnings_log.records]
    assert len(messages) == 1 and name in messages[0] and repr(raw) in messages[0]


def test_telemetry_survives_malformed_configuration(harness, monkeypatch):
    monkeypatch.setenv(ev.OTEL_HICACHE_MAX_QUEUE_SIZE, "a lot")
    monkeypatch.setenv(ev.OTEL_HICACHE_POLL_INTERVAL_MS, "-3")
    monkeypatch.setenv(ev.OTEL_HICACHE_ENABLED, "sure")
    h = harness()
    h.tel.submit("offload", {"kv": 64}, 10, page_size=64, expect_ack=False, host_start_ns=0, host_end_ns=5)
    assert len(h.finished()) == 1
