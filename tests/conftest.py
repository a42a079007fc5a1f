"""Shared fixtures: a simulated device, in-memory exporters and readers."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from harness import Harness
from otel_hicache.diagnostics import reset_warnings

_ENV_PREFIXES = ("OTEL_",)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith(_ENV_PREFIXES):
            monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OTEL_HICACHE_POLL_INTERVAL_MS", "0.5")
    reset_warnings()


@pytest.fixture
def harness() -> Any:
    created: list[Harness] = []

    def make(**kwargs: Any) -> Harness:
        h = Harness(**kwargs)
        created.append(h)
        return h

    yield make
    for h in created:
        h.close()


@pytest.fixture
def warnings_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.WARNING, logger="otel_hicache")
    return caplog


@pytest.fixture
def fresh_configuration() -> Any:
    """No providers from an earlier configure(); the ones a test builds are shut down after it."""
    from otel_hicache import configuration
    configuration._configured = None  # pylint: disable=protected-access
    yield
    configuration.shutdown(1.0)


@pytest.fixture
def embedded(monkeypatch: pytest.MonkeyPatch) -> None:
    """configure() builds its providers here (the sinks embedded), for tests that look inside them:
    the telemetry process builds its own with the same code (otel_hicache.sinks.providers)."""
    monkeypatch.setenv("OTEL_HICACHE_TELEMETRY_PROCESS", "false")
