"""A caller's attributes checked within the SDK's span limits before the channel: a str, bool, int64 or
float, or a list of them."""

from __future__ import annotations

import os
import reprlib
from collections.abc import Mapping
from typing import Any

from ..diagnostics import warn_once
from ..record import INT64_MAX, encodes


def _value(value: Any, nested: bool = False) -> bool:
    if isinstance(value, (tuple, list)):
        return not nested and all(_value(v, True) for v in value)
    if isinstance(value, str):
        return encodes(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return -INT64_MAX - 1 <= value <= INT64_MAX
    return isinstance(value, (bool, float))


def _valid(key: Any, value: Any) -> bool:
    return isinstance(key, str) and bool(key) and encodes(key) and _value(value)


def _limit(kind: str, default: int | None) -> int | None:
    for name in (f"OTEL_SPAN_ATTRIBUTE_{kind}_LIMIT", f"OTEL_ATTRIBUTE_{kind}_LIMIT"):
        if (raw := (os.environ.get(name) or "").strip()).isdigit():
            return int(raw)
    return default  # sinks.otel_environment warns about a malformed one


def limits() -> tuple[int, int | None]:
    """The SDK's span attribute (count, value length or None) limits."""
    return _limit("COUNT", 128), _limit("VALUE_LENGTH", None)


def static_attributes(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    static: dict[str, Any] = {}
    for key, value in (attributes or {}).items():
        if _valid(key, value):
            static[str.__str__(key)] = tuple(value) if isinstance(value, list) else value
        else:
            warn_once(f"static:{key!r}"[:200], "otel-hicache: static attribute %s=%s is not a string/bool/int/"
                      "float (or a list of them); ignored", reprlib.repr(key), reprlib.repr(value))
    return static


def call_attributes(attributes: Any, count: int, length: int | None) -> dict[str, Any] | None:
    """The valid ones (others warned about), at most ``count``, str values cut to ``length``."""
    if not isinstance(attributes, Mapping):
        warn_once("attributes:type", "otel-hicache: attributes must be a mapping, got %s", type(attributes).__name__)
        return None
    out: dict[str, Any] = {}
    for key, value in attributes.items():
        if not _valid(key, value):
            warn_once(f"attribute:{type(value).__name__}", "otel-hicache: a span attribute OTLP cannot encode "
                      "was left out (%s, a %s)", reprlib.repr(key), type(value).__name__)
            continue
        if len(out) == count:
            warn_once("attribute:count", "otel-hicache: an op has more than %d attributes of its own "
                      "(OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT); the rest were left out", count)
            break
        if length is not None and isinstance(value, (str, tuple, list)):
            value = value[:length] if isinstance(value, str) else [
                v[:length] if isinstance(v, str) else v for v in value]
        out[str.__str__(key)] = value
    return out or None


class CallAttributes:
    """``call_attributes`` within the SDK's limits; the same dict, unchanged, checked once."""

    def __init__(self) -> None:
        self._limits = limits()
        self._last: tuple = (None, None, None)  # the dict, a copy, what it gave

    def __call__(self, attributes: Any) -> dict[str, Any] | None:
        given, copy, out = self._last
        try:
            if attributes is given and attributes == copy:
                return out
        except Exception:  # a value that cannot compare (an array): checked again
            pass
        out = call_attributes(attributes, *self._limits)
        # immutable values only: a list changed in place equals the copy
        if type(attributes) is dict and out is not None and len(out) == len(attributes) and all(
                type(v) in (str, int, float, bool) for v in out.values()):
            self._last = (attributes, dict(attributes), out)
        return out
