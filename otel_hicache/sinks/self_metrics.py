"""What otel-hicache costs, as observable counters of CPU seconds, and where its sinks run.

``otel_hicache.poller.cpu_time``: the poller thread (its CPU clock, sent with its state);
``otel_hicache.export.cpu_time{thread=telemetry_process}``: the whole telemetry process (none
embedded: the SDK's threads are not ours to find). The gauge ``otel_hicache.sinks{location}``
shows a fallback to embedded sinks on a dashboard, not only in a log line.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from .. import semconv as sc
from ..version import __version__


class TelemetryCpu:
    """Registers both counters on ``meter_provider``; ``poller_cpu_s`` is set from each state."""

    def __init__(self, meter_provider: Any, static: Mapping[str, Any], location: str) -> None:
        from opentelemetry.metrics import Observation

        self.poller_cpu_s: float | None = None
        attrs = dict(static)
        process_attrs = {**attrs, sc.THREAD: sc.THREAD_TELEMETRY_PROCESS}
        meter = meter_provider.get_meter(sc.SCOPE_NAME, __version__)

        def poller_cpu(_options: Any) -> list[Any]:
            seconds = self.poller_cpu_s
            return [] if seconds is None else [Observation(seconds, attrs)]

        in_process = location != sc.LOCATION_TELEMETRY_PROCESS

        def process_cpu(_options: Any) -> list[Any]:
            return [] if in_process else [Observation(time.process_time(), process_attrs)]

        for spec, callback in ((sc.POLLER_CPU_TIME, poller_cpu), (sc.EXPORT_CPU_TIME, process_cpu)):
            name, unit, description = spec
            meter.create_observable_counter(name, callbacks=[callback], unit=unit, description=description)
        where = [Observation(1, {**attrs, sc.LOCATION: location})]
        name, unit, description = sc.SINKS
        meter.create_observable_gauge(name, callbacks=[lambda _options: where], unit=unit, description=description)
