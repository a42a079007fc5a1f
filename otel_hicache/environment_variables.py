"""The ``OTEL_HICACHE_*`` variables and ``OTEL_SDK_DISABLED``: a malformed value warns once, then the default."""

from __future__ import annotations

import math
import os
from typing import Any, Callable

from .diagnostics import shown, warn_once

OTEL_HICACHE_ENABLED = "OTEL_HICACHE_ENABLED"
OTEL_HICACHE_MAX_QUEUE_SIZE = "OTEL_HICACHE_MAX_QUEUE_SIZE"
OTEL_HICACHE_POLL_INTERVAL_MS = "OTEL_HICACHE_POLL_INTERVAL_MS"
OTEL_HICACHE_ACK_TIMEOUT_S = "OTEL_HICACHE_ACK_TIMEOUT_S"
OTEL_HICACHE_TRANSFER_TIMEOUT_S = "OTEL_HICACHE_TRANSFER_TIMEOUT_S"
OTEL_HICACHE_ANCHOR_INTERVAL_S = "OTEL_HICACHE_ANCHOR_INTERVAL_S"
OTEL_HICACHE_SHUTDOWN_TIMEOUT_S = "OTEL_HICACHE_SHUTDOWN_TIMEOUT_S"
OTEL_HICACHE_HOST_RESIDENCE = "OTEL_HICACHE_HOST_RESIDENCE"
OTEL_HICACHE_TELEMETRY_PROCESS = "OTEL_HICACHE_TELEMETRY_PROCESS"

DEFAULTS = {
    OTEL_HICACHE_ENABLED: True,  # false: submit() returns at once
    OTEL_HICACHE_MAX_QUEUE_SIZE: 16384,  # records held before their span
    OTEL_HICACHE_POLL_INTERVAL_MS: 10.0,  # finish events polled
    OTEL_HICACHE_ACK_TIMEOUT_S: 30.0,  # then hicache.acked=false
    OTEL_HICACHE_TRANSFER_TIMEOUT_S: 60.0,  # then an error span
    OTEL_HICACHE_ANCHOR_INTERVAL_S: 1.0,  # the clock anchor's
    OTEL_HICACHE_SHUTDOWN_TIMEOUT_S: 5.0,  # shutdown() and the flush at exit
    OTEL_HICACHE_HOST_RESIDENCE: True,  # false: host_pool() is None
    OTEL_HICACHE_TELEMETRY_PROCESS: None,  # unset: by the exporters
}


def _read(name: str, default: Any, parse: Callable[[str], Any], expected: str) -> Any:
    if not (text := (os.environ.get(name) or "").strip()):
        return default
    try:
        return parse(text)
    except (KeyError, ValueError):
        warn_once(f"env:{name}", "otel-hicache: %s=%s is not %s; using the default %s", name,
                  shown(os.environ[name]), expected, str(default).lower() if isinstance(default, bool) else default)
        return default


def _boolean(text: str) -> bool:
    return {"true": True, "false": False}[text.lower()]


def env_bool(name: str) -> bool | None:
    return _read(name, DEFAULTS[name], _boolean, "a boolean (true/false)")


def _at_least(value: float, minimum: float) -> Any:
    if not math.isfinite(value) or value < minimum:
        raise ValueError(value)
    return value


def env_float(name: str, minimum: float = 0.0) -> float:
    return float(_read(name, DEFAULTS[name], lambda text: _at_least(float(text), minimum), f"a number >= {minimum}"))


def env_int(name: str) -> int:
    return int(_read(name, DEFAULTS[name], lambda text: _at_least(int(text), 1), "an integer >= 1"))


def sdk_disabled() -> bool:
    """As the SDK reads it: only ``true`` disables (anything else but ``false`` warns)."""
    return _read("OTEL_SDK_DISABLED", False, _boolean, "a boolean (true/false)")
