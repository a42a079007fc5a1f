"""Prefix hits per tier, dropped and evicted tokens, counted where SGLang counts them.

AFTER hooks on the calls SGLang's own series come from (see
``docs/reference.md``, "Cache events"); each adds to
``TransferTelemetry.cache_events`` with a dict update, and counts even when
SGLang runs without ``--enable-metrics``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from otel_hicache import semconv as sc
from otel_hicache.diagnostics import warn_once

from .transfers import TransferObserver


def _events(observer: TransferObserver) -> Any:
    telemetry = observer.telemetry
    return telemetry.cache_events if telemetry is not None and telemetry.enabled else None


def wrap_record_dropped_tokens(observer: TransferObserver, original: Callable[..., Any]) -> Callable[..., Any]:
    """``UnifiedRadixCache._record_dropped_tokens(dropped_tokens, reason)``: KV pool tokens."""

    @functools.wraps(original)
    def _record_dropped_tokens(cache: Any, dropped_tokens: int, reason: str, *args: Any, **kwargs: Any) -> Any:
        result = original(cache, dropped_tokens, reason, *args, **kwargs)
        events = _events(observer)
        if events is not None:
            try:
                if dropped_tokens > 0:
                    events.dropped_tokens(dropped_tokens, reason, "kv")
            except Exception as exc:  # pylint: disable=broad-except
                warn_once("sglang:dropped", "otel-hicache: could not count dropped tokens (%r)", exc)
        return result

    return _record_dropped_tokens


def wrap_update_eviction_metrics(observer: TransferObserver, original: Callable[..., Any]) -> Callable[..., Any]:
    """``BasePrefixCache.update_eviction_metrics(num_evicted, start_time)``: device evictions."""

    @functools.wraps(original)
    def update_eviction_metrics(cache: Any, num_evicted: int, *args: Any, **kwargs: Any) -> Any:
        result = original(cache, num_evicted, *args, **kwargs)
        events = _events(observer)
        if events is not None:
            try:
                if num_evicted > 0:
                    events.evicted_tokens(num_evicted, sc.TIER_DEVICE)
            except Exception as exc:  # pylint: disable=broad-except
                warn_once("sglang:evicted", "otel-hicache: could not count evicted tokens (%r)", exc)
        return result

    return update_eviction_metrics


def wrap_evict_host(observer: TransferObserver, original: Callable[..., Any],
                    base_component: Any) -> Callable[..., Any]:
    """``UnifiedRadixCache.evict_host(num_tokens, component_type)``: host evictions of
    the base (KV) component; SWA/Mamba component evictions are not KV tokens."""

    @functools.wraps(original)
    def evict_host(cache: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(cache, *args, **kwargs)
        events = _events(observer)
        if events is not None:
            try:
                component = kwargs.get("component_type", args[1] if len(args) > 1 else base_component)
                if component == base_component and isinstance(result, int) and result > 0:
                    events.evicted_tokens(result, sc.TIER_HOST)
            except Exception as exc:  # pylint: disable=broad-except
                warn_once("sglang:evict_host", "otel-hicache: could not count host evictions (%r)", exc)
        return result

    return evict_host


def wrap_split_cached_prefix_by_tier(observer: TransferObserver,
                                     original: Callable[..., Any]) -> Callable[..., Any]:
    """``schedule_batch.split_cached_prefix_by_tier``: one request's (device, host, storage) split."""

    @functools.wraps(original)
    def split_cached_prefix_by_tier(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        events = _events(observer)
        if events is not None:
            try:
                device, host, storage = result
                events.prefix_tokens(device, host, storage)
            except Exception as exc:  # pylint: disable=broad-except
                warn_once("sglang:prefix", "otel-hicache: could not count prefix hits (%r)", exc)
        return result

    return split_cached_prefix_by_tier
