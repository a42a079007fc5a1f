"""Typed, validated reading of environment variables.

Every reader falls back to the documented default and warns once, naming the
variable, when a value is malformed; none of them raises.
"""

from __future__ import annotations

import math
import os

from .diagnostics import warn_once
from .environment_variables import DEFAULTS

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_bool(name: str, default: bool | None = None) -> bool:
    default = DEFAULTS[name] if default is None else default
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
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
    """``OTEL_SDK_DISABLED`` as the SDK reads it (only ``true`` disables)."""
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
