"""Typed, validated reading of environment variables: the one env reader of otel-hicache.

Every reader falls back to the documented default and warns once, naming the
variable, when a value is malformed; none of them raises. Booleans are the OTel
specification's: ``true`` or ``false``, case-insensitive (as the SDK reads
``OTEL_SDK_DISABLED``); ``1``, ``yes`` or ``on`` are malformed.
"""

from __future__ import annotations

import math
import os

from .diagnostics import warn_once
from .environment_variables import DEFAULTS

def env_bool(name: str, default: bool | None = None) -> bool:
    default = DEFAULTS[name] if default is None else default
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ("true", "false"):
        return value == "true"
    warn_once(
        f"env:{name}",
        "otel-hicache: %s=%r is not a boolean (true/false); using the default %s",
        name,
        raw,
        str(default).lower(),
    )
    return default


def env_float(name: str, default: float | None = None, minimum: float = 0.0) -> float:
    default = DEFAULTS[name] if default is None else default
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return float(default)
    try:
        value = float(raw)
        if not math.isfinite(value) or value < minimum:
            raise ValueError
    except ValueError:
        warn_once(
            f"env:{name}",
            "otel-hicache: %s=%r is not a number >= %s; using the default %s",
            name,
            raw,
            minimum,
            default,
        )
        return float(default)
    return value


def env_int(name: str, default: int | None = None, minimum: int = 1) -> int:
    default = DEFAULTS[name] if default is None else default
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return int(default)
    try:
        value = int(raw.strip())
        if value < minimum:
            raise ValueError
    except ValueError:
        warn_once(
            f"env:{name}",
            "otel-hicache: %s=%r is not an integer >= %d; using the default %d",
            name,
            raw,
            minimum,
            default,
        )
        return int(default)
    return value


def sdk_disabled() -> bool:
    """``OTEL_SDK_DISABLED`` as the SDK reads it: only ``true`` disables; a value other
    than ``true`` or ``false`` is warned about once (it leaves the SDK enabled)."""
    raw = os.environ.get("OTEL_SDK_DISABLED")
    if raw is None or raw.strip() == "":
        return False
    value = raw.strip().lower()
    if value not in ("true", "false"):
        warn_once("env:OTEL_SDK_DISABLED", "otel-hicache: OTEL_SDK_DISABLED=%r is not a boolean (true/false); "
                  "using false (enabled) instead", raw)
    return value == "true"
