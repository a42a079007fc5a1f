"""The observable counters of the cache events the capture counts (prefix hits per tier,
dropped and evicted tokens): they report the latest totals the capture sent, zeros for
the series operators alert on until then. Cumulative totals are exact whatever the trace
sampler does; the SDK turns them into deltas itself when delta temporality is configured.
"""

from __future__ import annotations

from typing import Any, Mapping

from .. import semconv as sc
from ..version import __version__


class CacheEventCounters:
    """``totals``: ``{kind: [(attribute pairs, total), ...]}``, replaced whole by each state that carries them."""

    def __init__(self, meter_provider: Any, static: Mapping[str, Any]) -> None:
        from opentelemetry.metrics import Observation

        self.totals: Mapping[str, Any] = {
            kind: [(key, 0) for key in keys] for kind, keys in sc.cache_event_zero_series().items()}
        attrs = dict(static)
        meter = meter_provider.get_meter(sc.SCOPE_NAME, __version__)

        def callback_for(kind: str) -> Any:
            def observe(_options: Any) -> list[Any]:
                return [Observation(value, {**attrs, **dict(key)}) for key, value in self.totals.get(kind, ())]

            return observe

        for kind, (name, unit, description) in sc.CACHE_EVENT_KINDS.items():
            meter.create_observable_counter(name, callbacks=[callback_for(kind)], unit=unit, description=description)
