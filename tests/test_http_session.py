"""The OTLP/HTTP exporters' session (``otel_hicache.sinks.http_session``), with the real SDK exporters
that ``providers.exporters()`` builds from the ``OTEL_*`` variables, against the in-process
receiver: no redirect is followed, a refusal is an export failure named once, and a
collector's ``Retry-After`` is kept."""

from __future__ import annotations

import logging

import pytest

from otel_hicache.sinks import providers
from otel_hicache.diagnostics import reset_warnings
from otel_hicache.sinks.http_session import describe
from otlp_receiver import HttpReceiver


def _span() -> list:
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider(shutdown_on_exit=False)
    span = provider.get_tracer("test").start_span("refused")
    span.end()
    return [span]


@pytest.fixture
def otlp_http(monkeypatch):
    def exporter(endpoint: str, timeout_s: str = "2"):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", timeout_s)
        (made,) = providers.exporters("traces", names=["otlp"])
        return made

    reset_warnings()
    yield exporter
    reset_warnings()


def test_a_redirect_is_not_followed_and_is_a_failure(otlp_http, caplog):
    from opentelemetry.sdk.trace.export import SpanExportResult

    target = HttpReceiver()  # would accept: a followed redirect would deliver there
    redirect = HttpReceiver(status=307, headers={"Location": f"{target.endpoint}/v1/traces"})
    try:
        exporter = otlp_http(redirect.endpoint)
        with caplog.at_level(logging.WARNING):
            results = [exporter.export(_span()) for _ in range(3)]
        exporter.shutdown()
    finally:
        redirect.stop()
        target.stop()
    assert results == [SpanExportResult.FAILURE] * 3
    assert redirect.received.refused_items("traces") == 3 and not target.received.spans()
    named = [r.getMessage() for r in caplog.records if r.name == "otel_hicache"]
    assert len(named) == 1, named  # once per endpoint and status
    assert (f"{redirect.endpoint}/v1/traces was refused: HTTP 307 Temporary Redirect (to "
            f"{target.endpoint}/v1/traces: redirects are not followed; set the endpoint to where it points)"
            in named[0]), named


@pytest.mark.parametrize("status, headers, attempts", [
    # the collector asked for 30 s: the exporter's first backoff (0.8-1.2 s) within its 2 s
    # timeout sends nothing more
    (503, {"Retry-After": "30"}, 1),
    # retried by the exporter: the first attempt, then one after its first backoff (0.8-1.2 s); the
    # next backoff (1.6-2.4 s) no longer fits the 2 s timeout, whatever the jitter
    (429, {}, 2),
])
def test_a_busy_collector_is_retried_as_it_asks_and_never_at_once(otlp_http, status, headers, attempts):
    from opentelemetry.sdk.trace.export import SpanExportResult

    busy = HttpReceiver(status=status, headers=headers)
    try:
        exporter = otlp_http(busy.endpoint)
        assert exporter.export(_span()) is SpanExportResult.FAILURE
        exporter.shutdown()
    finally:
        busy.stop()
    assert busy.received.refused_items("traces") == attempts


@pytest.mark.parametrize("location, url, expected", [
    ("https://user:pass@collector:4318/v1/traces", "http://collector:4318/v1/traces",
     "HTTP 308 Permanent Redirect (to https://***@collector:4318/v1/traces: the collector wants TLS; "
     "set an https endpoint)"),
    (None, "http://collector:4318/v1/traces",
     "HTTP 301 Moved Permanently (to nowhere given: redirects are not followed; check the endpoint)"),
])
def test_a_redirect_is_named_without_userinfo(location, url, expected):
    status = 308 if location else 301
    text = describe(status, "whatever", location, url)
    assert text == expected
    assert describe(599, "Odd (really)", None, url) == "HTTP 599 Odd really"
    assert describe(599, None, None, url) == "HTTP 599"
