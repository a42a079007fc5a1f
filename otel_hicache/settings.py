"""Typed reading of the ``OTEL_HICACHE_*`` variables and ``OTEL_SDK_DISABLED``, never raising: a malformed
value warns once (naming the variable, quoting a short prefix) and the default is used; a blank one means
unset. Booleans are ``true`` or ``false`` in any case."""

from __future__ import annotations

import math
import os
from typing import Any, Callable

from .diagnostics import shown as quoted, warn_once
from .environment_variables import DEFAULTS


def _read(name: str, default: Any, parse: Callable[[str], Any], expected: str) -> Any:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return parse(raw.strip())
    except ValueError:
        shown = str(default).lower() if isinstance(default, bool) else default
        warn_once(f"env:{name}", "otel-hicache: %s=%s is not %s; using the default %s", name, quoted(raw), expected,
                  shown)
        return default


def _boolean(raw: str) -> bool:
    if raw.lower() not in ("true", "false"):
        raise ValueError(raw)
    return raw.lower() == "true"


def env_bool(name: str, default: bool | None = None) -> bool:
    return _read(name, DEFAULTS[name] if default is None else default, _boolean, "a boolean (true/false)")


def _number(name: str, default: Any, kind: type, minimum: float) -> Any:
    def parse(raw: str) -> Any:
        if not math.isfinite(value := kind(raw)) or value < minimum:
            raise ValueError(raw)
        return value

    what = "a number" if kind is float else "an integer"
    return kind(_read(name, DEFAULTS[name] if default is None else default, parse, f"{what} >= {minimum}"))


def env_float(name: str, default: float | None = None, minimum: float = 0.0) -> float:
    return _number(name, default, float, minimum)


def env_int(name: str, default: int | None = None, minimum: int = 1) -> int:
    return _number(name, default, int, minimum)


def sdk_disabled() -> bool:
    """``OTEL_SDK_DISABLED`` as the SDK reads it: only ``true`` disables (anything else but ``false`` warns)."""
    return _read("OTEL_SDK_DISABLED", False, _boolean, "a boolean (true/false)")
