"""Prefix hits per tier, dropped and evicted tokens, counted where SGLang counts them.

AFTER hooks on the calls SGLang's own series come from (see
``docs/reference.md``, "Cache events"); each adds to
``TransferTelemetry.cache_events`` with a dict update, and counts even when
SGLang runs without ``--enable-metrics``. Each wrapper takes wrapt's
``(wrapped, instance, args, kwargs)``, calls SGLang unchanged and reads its
parameters by position or by name (:func:`~.patching.arg`).
"""

from __future__ import annotations

from typing import Any, Callable

from otel_hicache import semconv as sc
from otel_hicache.diagnostics import warn_once

from .patching import MISSING, arg, missing
from .transfers import TransferObserver

Wrapper = Callable[[Callable[..., Any], Any, tuple, dict], Any]


def _events(observer: TransferObserver) -> Any:
    telemetry = observer.telemetry
    return telemetry.cache_events if telemetry is not None and telemetry.enabled else None


def record_dropped_tokens(observer: TransferObserver) -> Wrapper:
    """``UnifiedRadixCache._record_dropped_tokens(dropped_tokens, reason)``: KV pool tokens."""

    def _wrap_record_dropped_tokens(wrapped: Callable[..., Any], _cache: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        events = _events(observer)
        if events is not None:
            try:
                dropped = arg(args, kwargs, 0, "dropped_tokens")
                reason = arg(args, kwargs, 1, "reason")
                if dropped is MISSING or reason is MISSING:
                    missing(wrapped, "dropped_tokens" if dropped is MISSING else "reason",
                            "hicache.dropped_tokens is not counted")
                elif dropped > 0:
                    events.dropped_tokens(dropped, reason, "kv")
            except Exception as exc:  # pylint: disable=broad-except
                warn_once("sglang:dropped", "otel-hicache: could not count dropped tokens (%r)", exc)
        return result

    return _wrap_record_dropped_tokens


def update_eviction_metrics(observer: TransferObserver) -> Wrapper:
    """``BasePrefixCache.update_eviction_metrics(num_evicted, start_time)``: device evictions."""

    def _wrap_update_eviction_metrics(wrapped: Callable[..., Any], _cache: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        events = _events(observer)
        if events is not None:
            try:
                evicted = arg(args, kwargs, 0, "num_evicted")
                if evicted is MISSING:
                    missing(wrapped, "num_evicted", "device evictions are not counted")
                elif evicted > 0:
                    events.evicted_tokens(evicted, sc.TIER_DEVICE)
            except Exception as exc:  # pylint: disable=broad-except
                warn_once("sglang:evicted", "otel-hicache: could not count evicted tokens (%r)", exc)
        return result

    return _wrap_update_eviction_metrics


def evict_host(observer: TransferObserver, base_component: Callable[[], Any]) -> Wrapper:
    """``UnifiedRadixCache.evict_host(num_tokens, component_type=BASE_COMPONENT_TYPE)``: host
    evictions of the base (KV) component (its return value); SWA/Mamba component evictions
    are not KV tokens."""

    def _wrap_evict_host(wrapped: Callable[..., Any], _cache: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        events = _events(observer)
        if events is not None:
            try:
                component = arg(args, kwargs, 1, "component_type")
                if component is MISSING and len(args) + len(kwargs) > 1:  # passed under another name
                    missing(wrapped, "component_type", "host evictions are not counted")
                elif (component is MISSING or component == base_component()) and isinstance(result, int) \
                        and result > 0:
                    events.evicted_tokens(result, sc.TIER_HOST)
            except Exception as exc:  # pylint: disable=broad-except
                warn_once("sglang:evict_host", "otel-hicache: could not count host evictions (%r)", exc)
        return result

    return _wrap_evict_host


def split_cached_prefix_by_tier(observer: TransferObserver) -> Wrapper:
    """``schedule_batch.split_cached_prefix_by_tier(...)``: one request's (device, host, storage) split."""

    def _wrap_split_cached_prefix_by_tier(wrapped: Callable[..., Any], _instance: Any, args: tuple,
                                          kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        events = _events(observer)
        if events is not None:
            try:
                device, host, storage = result
                events.prefix_tokens(device, host, storage)
            except Exception as exc:  # pylint: disable=broad-except
                warn_once("sglang:prefix", "otel-hicache: could not count prefix hits (%r)", exc)
        return result

    return _wrap_split_cached_prefix_by_tier
