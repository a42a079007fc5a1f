"""Typed reading of the ``OTEL_HICACHE_*`` variables, and of ``OTEL_SDK_DISABLED``.

Every reader falls back to the documented default (:data:`DEFAULTS`) and warns
once, naming the variable and a short prefix of the value, when a value is
malformed; none of them raises. An empty or blank value means unset.
Booleans are the OTel specification's: ``true`` or ``false``, any case (as the
SDK reads ``OTEL_SDK_DISABLED``); ``1``, ``yes`` or ``on`` are malformed.
"""

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
        value = kind(raw)
        if not math.isfinite(value) or value < minimum:
            raise ValueError(raw)
        return value

    what = "a number" if kind is float else "an integer"
    return kind(_read(name, DEFAULTS[name] if default is None else default, parse, f"{what} >= {minimum}"))


def env_float(name: str, default: float | None = None, minimum: float = 0.0) -> float:
    return _number(name, default, float, minimum)


def env_int(name: str, default: int | None = None, minimum: int = 1) -> int:
    return _number(name, default, int, minimum)


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (lower case; the value is matched in any case)."""
    def parse(raw: str) -> str:
        if raw.lower() not in choices:
            raise ValueError(raw)
        return raw.lower()

    return _read(name, DEFAULTS[name], parse, "one of " + ", ".join(choices))


def env_fraction(name: str) -> float:
    """A number ``>= 0`` and ``< 1`` (a quantile; 0 meaning off)."""
    def parse(raw: str) -> float:
        value = float(raw)
        if not 0.0 <= value < 1.0:  # NaN too
            raise ValueError(raw)
        return value

    return _read(name, DEFAULTS[name], parse, "a number >= 0 and < 1")


def sdk_disabled() -> bool:
    """``OTEL_SDK_DISABLED`` as the SDK reads it: only ``true`` disables (anything but
    ``true`` or ``false`` is warned about once, and leaves the SDK enabled)."""
    return _read("OTEL_SDK_DISABLED", False, _boolean, "a boolean (true/false)")
