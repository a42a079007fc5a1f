"""Exact counts of cache events that are not transfers: prefix hits per tier,
dropped tokens, evictions.

These happen on the serving framework's hot path (once per request, per
eviction), so counting must cost almost nothing there: each of
:meth:`CacheEvents.prefix_tokens`, :meth:`~CacheEvents.dropped_tokens` and
:meth:`~CacheEvents.evicted_tokens` is a dict update, no OTel SDK call. The totals reach the
sinks with the poller's state when they change, where observable counters report them
(:mod:`otel_hicache.sinks.cache_events`).
Cumulative totals are exact whatever the trace sampler does, and the SDK turns
them into deltas itself when delta temporality is configured.

Series that operators alert on exist as zeros from the start: every prefix
tier, every eviction tier, and the known drop reasons for the ``kv`` pool.
"""

from __future__ import annotations

from typing import Any, Mapping

from . import fork
from .. import semconv as sc
from ..diagnostics import warn_once

_DEVICE, _HOST, _STORAGE = (((sc.TIER, tier),) for tier in sc.PREFIX_TIERS)


class CacheEvents:
    """Cumulative token counts per (kind, attributes).

    :param attributes: static attributes (ranks...) on every point, as for
        :class:`~otel_hicache.TransferTelemetry`.

    The poller sends the totals with its state when they changed; the sinks' observable
    counters (``sinks.cache_events``) report them.
    """

    def __init__(self, attributes: Mapping[str, Any] | None = None) -> None:
        self._static = dict(attributes or {})
        self._reset()
        fork.after_fork_in_child(self._reset)  # the parent's counts are the parent's

    def _reset(self) -> None:
        self._totals: dict[str, dict[tuple[tuple[str, Any], ...], int]] = {
            kind: dict.fromkeys(keys, 0) for kind, keys in sc.cache_event_zero_series().items()
        }
        self._sent: Any = None

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

    # -- export ---------------------------------------------------------------
    def total(self, kind: str, **attributes: Any) -> int:
        """Sum of the totals of ``kind`` whose attributes include ``attributes`` (tests, demos)."""
        return sum(value for key, value in list(self._totals[kind].items())
                   if all(dict(key).get(k) == v for k, v in attributes.items()))

    def changed(self) -> dict[str, list[tuple[tuple[tuple[str, Any], ...], int]]] | None:
        """The totals, ``{kind: [(attribute pairs, total), ...]}`` (pairs: no dict key in a
        message), when they changed since the last call, else None (the poller's state)."""
        snapshot = {kind: dict(totals) for kind, totals in list(self._totals.items())}
        if snapshot == self._sent:
            return None
        self._sent = snapshot
        return {kind: list(totals.items()) for kind, totals in snapshot.items()}
