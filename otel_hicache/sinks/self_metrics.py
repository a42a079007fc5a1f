"""What otel-hicache costs, as CPU seconds of the poller thread and of the telemetry process (none
embedded: the SDK's threads are not ours to find), and a gauge of where its sinks run."""

from __future__ import annotations

import time
from typing import Any, Mapping

from .. import semconv as sc
from ..version import __version__


class TelemetryCpu:
    """The counters and the gauge on ``meter_provider``; ``poller_cpu_s`` is set from each state."""

    def __init__(self, meter_provider: Any, static: Mapping[str, Any], location: str) -> None:
        from opentelemetry.metrics import Observation

        self.poller_cpu_s: float | None = None
        meter, attrs = meter_provider.get_meter(sc.SCOPE_NAME, __version__), dict(static)
        process = {**attrs, sc.THREAD: sc.THREAD_TELEMETRY_PROCESS}
        in_process = location != sc.LOCATION_TELEMETRY_PROCESS
        for spec, make, values in (
                (sc.POLLER_CPU_TIME, meter.create_observable_counter,
                 lambda: [] if self.poller_cpu_s is None else [Observation(self.poller_cpu_s, attrs)]),
                (sc.EXPORT_CPU_TIME, meter.create_observable_counter,
                 lambda: [] if in_process else [Observation(time.process_time(), process)]),
                (sc.SINKS, meter.create_observable_gauge, lambda: [Observation(1, {**attrs, sc.LOCATION: location})])):
            make(spec[0], [lambda _options, values=values: values()], *spec[1:])
