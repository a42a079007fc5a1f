"""Flushing and shutting down providers within a time bound.

The SDK's OTLP exporters retry with backoff for up to their timeout (and the
span processor's final export can take as long again); a server's exit must not
wait for an unreachable collector. Every flush and shutdown otel-hicache does
runs on a daemon thread that is given up on after the bound, and while one for
the same providers is still blocked, later ones do not wait for it again.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from .diagnostics import warn_once


def providers_key(tracer_provider: Any, meter_provider: Any) -> tuple[int, int]:
    """Identifies a pair of providers for :func:`run_bounded`."""
    return (id(tracer_provider), id(meter_provider))


def shutdown_providers(tracer_provider: Any, meter_provider: Any, timeout_s: float) -> bool:
    """``shutdown`` both providers (exporting what they hold), bounded in time."""
    return run_bounded(
        [
            lambda: _call(tracer_provider, "shutdown"),
            lambda: _call(meter_provider, "shutdown", int(timeout_s * 1000)),
        ],
        timeout_s,
        key=providers_key(tracer_provider, meter_provider),
    )


def flush_providers(tracer_provider: Any, meter_provider: Any, timeout_s: float) -> bool:
    """``force_flush`` both providers, bounded in time (see :func:`run_bounded`)."""
    millis = int(timeout_s * 1000)
    return run_bounded(
        [lambda: _call(tracer_provider, "force_flush", millis), lambda: _call(meter_provider, "force_flush", millis)],
        timeout_s,
        key=providers_key(tracer_provider, meter_provider),
    )


def _call(provider: Any, method: str, *args: Any) -> Any:
    func = getattr(provider, method, None)
    if func is None:
        return True
    return func(*args)


_stuck: dict[Any, threading.Thread] = {}


def run_bounded(steps: Sequence[Callable[[], Any]], timeout_s: float, key: Any = None) -> bool:
    """Run ``steps`` in order on a daemon thread; give up waiting after ``timeout_s``.

    The SDK's exporters may retry for far longer than a server's exit may take;
    the daemon thread is abandoned (and dies with the interpreter) if it does.
    While an earlier flush of the same ``key`` (the same providers) is still
    stuck (collector unreachable), later ones are not waited for at all, so a
    shutdown sequence of several bounded steps costs one timeout, not one per step.
    """
    stuck = _stuck.get(key) if key is not None else None
    if stuck is not None:
        if stuck.is_alive():
            warn_once("bounded:stuck", "otel-hicache: an earlier telemetry flush is still blocked (collector "
                      "unreachable?); not waiting for this one")
            return False
        del _stuck[key]
    result = {"ok": True}

    def run() -> None:
        for step in steps:
            try:
                if step() is False:
                    result["ok"] = False
            except Exception as exc:
                result["ok"] = False
                warn_once(f"bounded:{type(exc).__name__}", "otel-hicache: flush/shutdown step failed: %r", exc)

    thread = threading.Thread(target=run, name="otel-hicache-flush", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        if key is not None:
            _stuck[key] = thread
        warn_once(
            "bounded:timeout",
            "otel-hicache: telemetry flush/shutdown did not finish within %.1f s (collector "
            "unreachable?); giving up so the process is not held",
            timeout_s,
        )
        return False
    return result["ok"]
