"""Framework adapters, by entry point (group ``otel_hicache.adapters``): objects with any of ``CAUSES``
(``{direction: causes}``), ``DIRECT_CAUSES`` (causes whose copies nobody acks) and ``doctor(out, check)``."""

from __future__ import annotations

import functools
from importlib.metadata import entry_points
from typing import Any

from .diagnostics import warn_once
from .semconv import CAUSE_OTHER as OTHER

GROUP = "otel_hicache.adapters"


@functools.lru_cache(maxsize=None)
def registered() -> tuple[tuple[str, Any], ...]:
    """Each adapter's ``(name, registration)``, by name; a broken one is warned about and left out."""
    found = []
    for ep in sorted(entry_points(group=GROUP), key=lambda ep: ep.name):
        try:
            found.append((ep.name, ep.load()))
        except Exception as exc:
            warn_once(f"adapter:{ep.name}", "otel-hicache: adapter %s not loaded (%s: %s); its causes count as %r",
                      ep.name, type(exc).__name__, exc, OTHER)
    return tuple(found)


@functools.lru_cache(maxsize=None)
def causes() -> dict[str, tuple[str, ...]]:
    """Each direction's causes: the adapters', then ``other``."""
    found: dict[str, list[str]] = {"offload": [], "onboard": []}
    for _, registration in registered():
        for direction, names in (getattr(registration, "CAUSES", None) or {}).items():
            found[direction].extend(c for c in names if c not in found[direction] and c != OTHER)
    return {direction: (*names, OTHER) for direction, names in found.items()}


@functools.lru_cache(maxsize=None)
def direct_causes() -> frozenset[str]:
    """``hicache.origin=direct`` causes; ``other`` can be either."""
    return frozenset(c for _, r in registered() for c in getattr(r, "DIRECT_CAUSES", ()))
