"""A TransferTelemetry on a simulated device with in-memory SDK sinks, for tests
(the ``harness`` fixture in conftest.py, and the fault tests' rig)."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_hicache import TransferTelemetry
from otel_hicache.capture.records import SUBMISSION_FIELDS
from simulated import SimulatedDevice

SUBMISSION_DEFAULTS = {"num_bytes": 0, "page_size": 1, "expect_ack": False, "submit_ns": 0}


def submission(*values: Any, **fields: Any) -> list[Any]:
    """``submit()``'s list, by position or name."""
    handle = [*values, *(fields.pop(name, SUBMISSION_DEFAULTS.get(name)) for name in SUBMISSION_FIELDS[len(values):])]
    if fields or len(handle) != len(SUBMISSION_FIELDS):
        raise TypeError(f"submission() got too many or unknown fields: {', '.join(sorted(fields))}")
    return handle


class Harness:
    """A TransferTelemetry wired to a simulated device and in-memory SDK sinks."""

    def __init__(self, sampler: Any = None, attributes: dict | None = None, spans: Any = None) -> None:
        self.device = SimulatedDevice()
        self.spans = spans if spans is not None else InMemorySpanExporter()
        self.tracer_provider = TracerProvider(sampler=sampler, shutdown_on_exit=False)
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False)
        self.tel = TransferTelemetry(
            self.tracer_provider,
            self.meter_provider,
            attributes if attributes is not None else {"tp_rank": 0},
            clock=self.device.time_ns,
            anchor_event_factory=self.device.anchor_event,
        )

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait for the poller and the sinks to process everything completed (no metric
        collection: each collection resets exemplars)."""
        pipeline = self.tel._pipeline  # pylint: disable=protected-access
        return pipeline.flush(timeout_s) if pipeline is not None else True

    def finished(self) -> list[Any]:
        assert self.flush()
        return list(self.spans.get_finished_spans())

    def points(self, name: str) -> list[Any]:
        assert self.flush()
        data = self.reader.get_metrics_data()
        found = []
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name == name:
                        found.extend(metric.data.data_points)
        return found

    def value(self, name: str, **attrs: Any) -> Any:
        """The sum of the counter points, or the one histogram point, whose attributes include ``attrs``."""
        matches = [p for p in self.points(name) if all(p.attributes.get(k) == v for k, v in attrs.items())]
        assert matches, (name, attrs, [dict(p.attributes) for p in self.points(name)])
        if hasattr(matches[0], "value"):
            return sum(p.value for p in matches)
        assert len(matches) == 1, (name, attrs, [dict(p.attributes) for p in matches])
        return matches[0]

    def close(self) -> None:
        self.tel.shutdown()
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()
