"""Exact counts of cache events that are not transfers: prefix hits per tier,
dropped tokens, evictions.

These happen on the serving framework's hot path (once per request, per
eviction), so counting must cost almost nothing there: each of
:meth:`CacheEvents.prefix_tokens`, :meth:`~CacheEvents.dropped_tokens` and
:meth:`~CacheEvents.evicted_tokens` is a dict update, no OTel SDK call. The totals reach the SDK through
observable counters that read them at collection time, on the reader's thread.
Cumulative totals are exact whatever the trace sampler does, and the SDK turns
them into deltas itself when delta temporality is configured.

Series that operators alert on exist as zeros from the start: every prefix
tier, every eviction tier, and the known drop reasons for the ``kv`` pool.
"""

from __future__ import annotations

from typing import Any, Mapping

from . import fork
from . import semconv as sc
from .diagnostics import warn_once
from .version import __version__

_KINDS = {
    "prefix": sc.PREFIX_TOKENS,
    "dropped": sc.DROPPED_TOKENS,
    "evicted": sc.EVICTED_TOKENS,
}


_DEVICE, _HOST, _STORAGE = (((sc.TIER, tier),) for tier in sc.PREFIX_TIERS)


def _zero_keys() -> dict[str, list[tuple[tuple[str, Any], ...]]]:
    return {
        "prefix": [_DEVICE, _HOST, _STORAGE],
        "dropped": [((sc.REASON, reason), (sc.POOL, "kv")) for reason in sc.DROPPED_TOKEN_REASONS],
        "evicted": [((sc.TIER, tier),) for tier in sc.EVICTION_TIERS],
    }


class CacheEvents:
    """Cumulative token counts per (kind, attributes), read by observable counters.

    :param attributes: static attributes (ranks...) on every point, as for
        :class:`~otel_hicache.TransferTelemetry`.

    Call :meth:`bind` with a ``MeterProvider`` to export (again after a fork,
    with the child's provider); counts made before binding are kept.
    """

    def __init__(self, attributes: Mapping[str, Any] | None = None) -> None:
        self._static = dict(attributes or {})
        self._reset()
        self._bound: list[Any] = []
        fork.after_fork_in_child(self._reset)  # the parent's counts are the parent's

    def _reset(self) -> None:
        self._totals: dict[str, dict[tuple[tuple[str, Any], ...], int]] = {
            kind: dict.fromkeys(keys, 0) for kind, keys in _zero_keys().items()
        }

    # -- hot path -------------------------------------------------------------
    def prefix_tokens(self, device: int, host: int, storage: int) -> None:
        """One request's cached prefix, split by the tier each part was found in."""
        totals = self._totals["prefix"]
        try:
            if device:
                totals[_DEVICE] += int(device)
            if host:
                totals[_HOST] += int(host)
            if storage:
                totals[_STORAGE] += int(storage)
        except (TypeError, ValueError):
            self._bad("prefix", (device, host, storage))

    def dropped_tokens(self, tokens: int, reason: str, pool: str = "kv") -> None:
        """Tokens dropped without a lower-tier copy."""
        self._add("dropped", ((sc.REASON, str(reason)), (sc.POOL, str(pool))), tokens)

    def evicted_tokens(self, tokens: int, tier: str) -> None:
        """Tokens evicted from ``tier`` (``device`` or ``host``)."""
        self._add("evicted", ((sc.TIER, str(tier)),), tokens)

    def _add(self, kind: str, key: tuple[tuple[str, Any], ...], tokens: Any) -> None:
        try:
            if tokens:
                totals = self._totals[kind]
                totals[key] = totals.get(key, 0) + int(tokens)
        except (TypeError, ValueError):
            self._bad(kind, tokens)

    @staticmethod
    def _bad(kind: str, value: Any) -> None:
        warn_once(f"cache_events:{kind}", "otel-hicache: ignored a %s count that is not an integer: %r", kind, value)

    # -- export -------------------------------------------------------------
    def total(self, kind: str, **attributes: Any) -> int:
        """Sum of the totals of ``kind`` whose attributes include ``attributes`` (tests, demos)."""
        return sum(value for key, value in list(self._totals[kind].items())
                   if all(dict(key).get(k) == v for k, v in attributes.items()))

    def bind(self, meter_provider: Any) -> None:
        """Register the observable counters on ``meter_provider``'s meter."""
        from opentelemetry.metrics import Observation

        meter = meter_provider.get_meter(sc.SCOPE_NAME, __version__)
        static = self._static

        def callback_for(kind: str) -> Any:
            def observe(_options: Any) -> list[Any]:
                # list() copies in one C call: safe against concurrent inserts
                return [Observation(value, {**static, **dict(key)})
                        for key, value in list(self._totals[kind].items())]

            return observe

        self._bound = [
            meter.create_observable_counter(name, callbacks=[callback_for(kind)], unit=unit, description=description)
            for kind, (name, unit, description) in _KINDS.items()
        ]
