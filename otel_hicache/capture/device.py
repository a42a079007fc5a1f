"""Device back-ends, from the (duck-typed) events: their ``anchor_factory()`` or ``torch.<backend>``."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def _torch_backend(obj: Any) -> Any:
    parts = type(obj).__module__.split(".")
    try:
        return importlib.import_module(f"torch.{parts[1]}") if len(parts) > 1 and parts[0] == "torch" else None
    except ImportError:
        return None


def anchor_factory_for(event: Any) -> Callable[[], Any] | None:
    """A callable recording a timing event now, or None."""
    custom = getattr(event, "anchor_factory", None)
    if callable(custom):
        return custom()
    backend = _torch_backend(event)
    if (stream_cls := getattr(backend, "Stream", None)) is None:
        return None
    index, cls, streams = getattr(getattr(event, "device", None), "index", None), type(event), []

    def factory() -> Any:
        if not streams:
            if index is not None and hasattr(backend, "set_device"):
                backend.set_device(index)  # the poller thread's
            streams.append(stream_cls(device=index))
        anchor = cls(enable_timing=True)
        anchor.record(streams[0])
        return anchor

    return factory


def timing_event_pair(stream: Any) -> tuple[Any, Any]:
    custom = getattr(stream, "timing_event_pair", None)
    if callable(custom):
        return custom()
    event_cls = getattr(_torch_backend(stream), "Event", None)
    if event_cls is None:
        raise TypeError(f"no timing events known for {type(stream).__name__}")
    return event_cls(enable_timing=True), event_cls(enable_timing=True)
