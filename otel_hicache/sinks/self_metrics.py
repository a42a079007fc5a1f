"""What otel-hicache costs, as counters of CPU seconds.

* ``otel_hicache.worker.cpu_time``: the poller thread in the serving process (intake,
  completion, timing; embedded, the sinks' work too), from the thread CPU clock the
  poller reads itself and sends with its state;
* ``otel_hicache.export.cpu_time{thread=telemetry_process}``: the whole telemetry
  process (sinks, encoding, export), from its process CPU clock. Embedded there is no
  such point: the SDK's export threads are not ours to find through its public API.

Observable counters, read at collection: nothing per op. ``rate(...)`` of either is the
share of one core it uses. Beside them the gauge ``otel_hicache.sinks{location}``: where the
sinks run, so that a fallback to embedded sinks (their cost on the serving process) shows
on a dashboard, not only in a log line. Every point carries the static attributes (ranks).
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
