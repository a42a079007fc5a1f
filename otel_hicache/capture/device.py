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
import os
import sys
from typing import Any, Callable, Mapping

from ..record import BUS_ID, INDEX, NONE, ONLY, UUID


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


def current_device(torch_module: Any = None, environ: Mapping[str, str] | None = None) -> tuple[str, Any]:
    """The GPU this process copies with, as NVML can look it up: ``(kind, value)``.

    1. torch's current CUDA device, if CUDA is already initialized in this process
       (never initialized here: that would break a later fork): its PCI bus id
       (its UUID with a torch that has no bus id). Call it on the thread that set
       the device: the current device is per thread.
    2. Else the first entry of ``CUDA_VISIBLE_DEVICES`` (device 0 of the process):
       a UUID as it is; an index only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (NVML's
       order; CUDA's default order is fastest first).
    3. Else NVML index 0 with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, or the one GPU NVML
       sees if it sees exactly one (``ONLY``).

    ``NONE`` (with the reason as value) when no GPU can be named. Never raises.
    """
    env = os.environ if environ is None else environ
    torch = torch_module if torch_module is not None else sys.modules.get("torch")
    try:
        cuda = getattr(torch, "cuda", None)
        if cuda is not None and cuda.is_initialized():
            props = cuda.get_device_properties(cuda.current_device())
            try:
                bus = f"{int(props.pci_domain_id):08X}:{int(props.pci_bus_id):02X}:{int(props.pci_device_id):02X}.0"
                return (BUS_ID, bus)
            except (AttributeError, TypeError, ValueError):
                uuid = str(getattr(props, "uuid", "") or "")
                if uuid:
                    return (UUID, uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
    except Exception:  # pylint: disable=broad-except  # a broken torch: fall back to the environment
        pass
    by_pci_order = env.get("CUDA_DEVICE_ORDER", "").strip().upper() == "PCI_BUS_ID"
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        first = visible.split(",")[0].strip()
        if first.startswith(("GPU-", "MIG-")):
            return (UUID, first)
        if first.isdigit():
            if by_pci_order:
                return (INDEX, int(first))
            return (NONE, f"CUDA_VISIBLE_DEVICES={visible!r} is in CUDA's order (CUDA_DEVICE_ORDER is not "
                          "PCI_BUS_ID) and CUDA is not initialized: which GPU is unknown")
        return (NONE, f"CUDA_VISIBLE_DEVICES={visible!r} names no GPU")
    if by_pci_order:
        return (INDEX, 0)
    return (ONLY, None)
