"""Device back-ends for wall-clock anchors, found from the events themselves.

Events are duck-typed (``query()``, ``synchronize()``, ``elapsed_time()``), so
CUDA, XPU, NPU events and test doubles all work for timing. Only the anchor
needs to *create* events; :func:`anchor_factory_for` derives a factory from a
sample event:

* an event that offers ``anchor_factory()`` (test doubles, custom devices) is
  asked for it;
* a ``torch.<backend>.Event`` (``torch.cuda``, ``torch.xpu``, ``torch.npu``...)
  gets a factory that records a new timing event on a dedicated, non-blocking
  side stream of the event's device, from the poller thread.

Events for which no factory is found (duck-typed events of other back-ends)
get no anchor: the poller places them relative to each other from
their own events instead (:class:`otel_hicache.clock.EventTimeline`,
``hicache.placement_source=relative``), so overlaps stay exact; only their
offset to the wall clock is estimated.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def anchor_factory_for(event: Any) -> Callable[[], Any] | None:
    """A callable returning a freshly recorded timing event, or None."""
    custom = getattr(event, "anchor_factory", None)
    if callable(custom):
        return custom()
    cls = type(event)
    parts = cls.__module__.split(".")
    if len(parts) < 2 or parts[0] != "torch":
        return None
    try:
        backend = importlib.import_module(f"torch.{parts[1]}")
    except ImportError:
        return None
    stream_cls = getattr(backend, "Stream", None)
    if stream_cls is None:
        return None
    device = getattr(event, "device", None)
    index = getattr(device, "index", None) if device is not None else None
    state: dict[str, Any] = {}

    def factory() -> Any:
        stream = state.get("stream")
        if stream is None:
            if index is not None and hasattr(backend, "set_device"):
                backend.set_device(index)  # the poller thread's current device
            stream = stream_cls() if index is None else stream_cls(device=index)
            state["stream"] = stream
        anchor = cls(enable_timing=True)
        anchor.record(stream)
        return anchor

    return factory


def timing_event_pair(stream: Any) -> tuple[Any, Any]:
    """Two unrecorded timing events (``enable_timing=True``) of ``stream``'s backend."""
    custom = getattr(stream, "timing_event_pair", None)
    if callable(custom):
        return custom()
    parts = type(stream).__module__.split(".")
    event_cls = None
    if len(parts) >= 2 and parts[0] == "torch":
        event_cls = getattr(importlib.import_module(f"torch.{parts[1]}"), "Event", None)
    if event_cls is None:
        raise TypeError(f"no timing events known for {type(stream).__name__}")
    return event_cls(enable_timing=True), event_cls(enable_timing=True)
