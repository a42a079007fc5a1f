"""SGLang's L1<->L2 copies, reported to otel-hicache (``docs/sglang.md``).

``L2TransferEngine.submit_*`` make every copy; one made outside ``start_writing/start_loading``
(decode retraction) is reported at once from its transfer list (``hicache.origin=direct``), one
made inside is held and reported with the ``HiCacheAck`` of its ``finish_event`` (a merged op),
its ack watched in the ack queue. Causes, host slots and events are read on the poller.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from threading import get_ident
from typing import Any, Callable
from weakref import WeakKeyDictionary

from otel_hicache import TransferTelemetry
from otel_hicache.diagnostics import warn_once

from . import causes
from .patching import MISSING, arg, missing
from .ranks import rank_attributes

OFFLOAD = "offload"
ONBOARD = "onboard"
ANCHOR_POOL = "kv"  # PoolName.KV.value: the anchor pool of a plain HiCacheController
DRAFT_BYTES = "hicache.draft_bytes"


def sglang_tracing_enabled() -> bool:
    """Whether SGLang's request tracing (``--enable-trace``) is on in this process."""
    enabled = getattr(sys.modules.get("sglang.srt.observability.trace"), "get_global_tracing_enabled", None)
    return bool(enabled()) if enabled is not None else False


def _events(timing: bool, start: Any, finish: Any, end_ns: int) -> dict[str, Any]:
    """submit()'s events; a synchronous copy (``torch.cpu`` events do nothing) ends as its call returns."""
    sync = not timing and type(finish).__module__ == "torch.cpu"
    return {"start_event": start if timing else None, "finish_event": finish, "host_end_ns": end_ns if sync else None}


class _ControllerInfo:
    """What is reported with every op of one controller, read once."""

    def __init__(self, controller: Any) -> None:
        host = getattr(controller, "mem_pool_host", None)
        self.page_size = int(getattr(controller, "page_size", 0) or getattr(host, "page_size", 1) or 1)
        engine = getattr(controller, "l2_transfer_engine", None)
        self.io_backend = getattr(engine, "io_backend", None) or getattr(controller, "io_backend", None)
        self.attributes: dict[str, Any] = {"hicache.controller": type(controller).__name__}  # span-only attributes
        for key, value in (("hicache.write_policy", getattr(controller, "write_policy", None)),
                           ("hicache.layer_num", getattr(controller, "transfer_layer_id_max", None)),
                           ("hicache.mem_layout", getattr(host, "layout", None))):
            if isinstance(value, (str, int)) and not isinstance(value, bool):
                self.attributes[key] = value
        # host residence tracks the anchor (KV) host pool
        self.anchor_host = getattr(getattr(host, "anchor_entry", None), "host_pool", None) or host
        self.host_pool: Any = None
        self.has_drafts = False  # packed draft-model (MTP) pools ride on loads
        self.pool_names: dict[int, str] = {}  # id(host pool) -> pool name, for direct copies
        entries = getattr(host, "entry_map", None)
        if isinstance(entries, dict):  # HybridCacheController: a HostPoolGroup
            for entry in entries.values():
                name, pool = getattr(getattr(entry, "name", None), "value", None), getattr(entry, "host_pool", None)
                if isinstance(name, str) and pool is not None:
                    self.pool_names[id(pool)] = name
                self.has_drafts = self.has_drafts or bool(getattr(entry, "packed_draft_device_pools", None))
        elif host is not None:
            self.pool_names[id(host)] = ANCHOR_POOL


def _transfers(copy: tuple) -> Any:
    """The ``transfers`` parameter of a held engine call (MISSING, warned once, if renamed)."""
    wrapped, _engine, args, kwargs = copy[:4]
    transfers = arg(args, kwargs, 0, "transfers")
    if transfers is MISSING:
        missing(wrapped, "transfers", "its direct copies are not reported, its merged ops carry no "
                "hicache.draft_bytes")
    return transfers


def _tally(transfers: Any, pool_names: dict[int, str]) -> tuple[dict[str, int], int, int, int]:
    """A transfer list's tokens per pool, bytes, packed draft bytes (a draft transfer moves one
    host layer) and the page size of its first pool."""
    pools: dict[str, int] = {}
    num_bytes = draft = page_size = 0
    for index, transfer in enumerate(transfers):
        pool, tokens = transfer.host_pool, int(transfer.host_indices.numel())
        size = int(getattr(pool, "size_per_token", 0) or 0)
        if getattr(transfer, "is_draft", False):
            layers = int(getattr(pool, "layer_num", 0) or 0)
            draft += tokens * size // layers if layers else 0
            continue
        num_bytes += tokens * size
        name = pool_names.get(id(pool)) or (ANCHOR_POOL if index == 0 else type(pool).__name__)
        pools[name] = pools.get(name, 0) + tokens
        page_size = page_size or int(getattr(pool, "page_size", 1) or 1)
    return pools, num_bytes, draft, page_size


class TransferObserver:
    """The adapter's state in one process: the telemetry (from its first HiCache controller) and
    the controllers, engines and host pools."""

    def __init__(self, make_telemetry: Callable[[dict[str, Any]], TransferTelemetry]) -> None:
        self._make_telemetry = make_telemetry
        self.telemetry: TransferTelemetry | None = None
        self._failed = False
        self._lock = threading.Lock()
        self.local = causes.Local()
        self.causes = causes.QueuedCauses(self.local)
        self._controllers: WeakKeyDictionary[Any, _ControllerInfo] = WeakKeyDictionary()
        self._engines: WeakKeyDictionary[Any, _ControllerInfo] = WeakKeyDictionary()  # engine -> its controller's
        self.host_pools: dict[int, tuple[Any, Any]] = {}  # id(SGLang's) -> (weakref to it, telemetry.host_pool())
        self.request_patcher: Any = None  # the request sites' Patcher: instrumented if SGLang traces requests

    def telemetry_now(self) -> TransferTelemetry | None:
        """This process's telemetry, started on first use; None if it could not (warned once)."""
        with self._lock:
            if self.telemetry is None and not self._failed:
                try:
                    self.telemetry = self._make_telemetry(rank_attributes())
                except Exception as exc:
                    self._failed = True
                    warn_once("sglang:telemetry", "otel-hicache: could not start telemetry (%r); SGLang runs "
                              "uninstrumented", exc)
            return self.telemetry

    def _info(self, controller: Any) -> _ControllerInfo:
        info = self._controllers.get(controller)
        if info is None:
            info = self._controllers[controller] = _ControllerInfo(controller)
            engine, host = getattr(controller, "l2_transfer_engine", None), info.anchor_host
            if engine is not None:
                self._engines[engine] = info
            if host is not None and self.telemetry is not None:  # controllers may share a host pool
                info.host_pool = self._host_pool(host)
                slots, page_size = getattr(host, "size", None), getattr(host, "page_size", None)
                if info.host_pool is None and isinstance(slots, int) and isinstance(page_size, int):
                    info.host_pool = self.telemetry.host_pool(slots, page_size)
                    if info.host_pool is not None:
                        self.host_pools[id(host)] = (weakref.ref(host), info.host_pool)
        return info

    def _host_pool(self, host: Any) -> Any:
        """Host residence's pool for SGLang's ``host`` (by identity: never hashes it)."""
        tracked = self.host_pools.get(id(host))
        return tracked[1] if tracked is not None and tracked[0]() is host else None

    def init_wrapper(self, wrapped: Any, controller: Any, args: tuple, kwargs: dict) -> None:
        """``HiCacheController.__init__``: then start this process's telemetry."""
        wrapped(*args, **kwargs)
        try:
            if self.telemetry_now() is not None:
                self._info(controller)
                if self.request_patcher is not None and sglang_tracing_enabled():
                    self.request_patcher.instrument()
        except Exception as exc:
            warn_once("sglang:controller", "otel-hicache: cannot read a %s (%r); its ops carry fewer attributes",
                      type(controller).__name__, exc)

    def host_free_wrapper(self, wrapped: Any, host: Any, args: tuple, kwargs: dict) -> Any:
        """``HostKVCache.free(indices)``: the freed pages of a tracked host pool."""
        result = wrapped(*args, **kwargs)
        pool, telemetry = self._host_pool(host), self.telemetry
        if pool is not None and telemetry is not None:
            indices = arg(args, kwargs, 0, "indices")
            if getattr(indices, "is_cuda", False):  # reading them would synchronize
                warn_once("sglang:host_free_cuda", "otel-hicache: host pages freed by device indices are not "
                          "tracked (reading them would synchronize)")
            elif indices is not MISSING:
                telemetry.host_freed(pool, indices)
        return result

    def submit_wrapper(self, direction: str) -> Callable[..., Any]:
        """For ``L2TransferEngine.submit_*(transfers, ...)``."""
        local, clock = self.local, time.time_ns

        def submit(wrapped: Any, engine: Any, args: tuple, kwargs: dict) -> Any:
            start_ns = clock()
            completion = wrapped(*args, **kwargs)
            copy = (wrapped, engine, args, kwargs, completion, start_ns, clock())
            captured = local.captured
            if captured is not None and local.thread == get_ident():  # inside start_*: held for its ack
                captured.append(copy)
                return completion
            telemetry = self.telemetry if self.telemetry is not None else self.telemetry_now()  # no controller yet?
            if telemetry is not None and telemetry.enabled:
                try:
                    self._report_direct(telemetry, direction, copy, local.current_cause())
                except Exception as exc:  # never into SGLang
                    warn_once("sglang:submit", "otel-hicache: could not report an L2 copy (%r)", exc)
            return completion

        return submit

    def start_wrapper(self, direction: str, op_queue: str, ack_queue: str) -> Callable[..., Any]:
        """For ``HiCacheController.start_writing/start_loading()``, which merge ``op_queue`` and
        append the ack to ``ack_queue``."""
        local, queued = self.local, self.causes
        other_queue = "write_queue" if op_queue == "load_queue" else "load_queue"

        def start(wrapped: Any, controller: Any, args: tuple, kwargs: dict) -> Any:
            telemetry = self.telemetry
            if telemetry is None or not telemetry.enabled:
                if queued.log:
                    queued.log = []  # nothing will resolve them
                return wrapped(*args, **kwargs)
            try:
                ops = list(getattr(controller, op_queue))
                pending = queued.pending(controller, ops, getattr(controller, other_queue))
            except Exception as exc:
                warn_once("sglang:cause", "otel-hicache: cannot read the queued ops (%r)", exc)
                ops, pending = [], (None, None)
            outer, captured = local.captured, []
            local.captured, local.thread = captured, get_ident()
            try:
                return wrapped(*args, **kwargs)
            finally:  # a copy of a start_* that raised before appending its ack is reported as direct
                local.captured = outer
                if captured:
                    try:
                        self._report_merged(telemetry, direction, controller, getattr(controller, ack_queue),
                                            captured, ops, *pending)
                    except Exception as exc:
                        warn_once("sglang:start", "otel-hicache: could not report a merged op (%r)", exc)

        return start

    def _report_merged(self, telemetry: TransferTelemetry, direction: str, controller: Any, queue: list[Any],
                       captured: list[tuple], ops: list[Any], cause: Any, requests: Any) -> None:
        """Each held copy with its ack (direct without one); the queued ops' cause, host slots
        and requests go with the first copy paired with an ack."""
        info = self._info(controller)
        host_slots = None  # the queued ops' host slots (CPU tensors, read on the poller)
        if info.host_pool is not None and ops:
            host_slots = (info.host_pool, [getattr(op, "host_indices", None) for op in ops])
        handed = False
        for copy in captured:
            transfers, finish = _transfers(copy), copy[4].finish_event
            ack = next((a for a in reversed(queue[-4:]) if a.finish_event is finish), None)
            if ack is None:
                self._report_direct(telemetry, direction, copy, self.local.current_cause())
                continue
            if not handed:
                cause, handed = self.causes.hand_over(cause), True
            attributes = info.attributes
            if info.has_drafts and direction == ONBOARD and transfers is not MISSING:
                draft = _tally(transfers, info.pool_names)[2]
                attributes = {**attributes, DRAFT_BYTES: draft} if draft else attributes
            call = cause if type(cause) is tuple else None  # (made on the poller)
            telemetry.submit(
                direction, ack.num_tokens_by_pool or {ANCHOR_POOL: ack.num_tokens}, ack.num_bytes,
                page_size=info.page_size, io_backend=info.io_backend, attributes=attributes, ack_watch=(queue, ack),
                host_start_ns=copy[5], **_events(ack.timing_enabled, ack.start_event, finish, copy[6]),
                cause=None if call else cause, cause_call=call, host_slots=host_slots, requests=requests)
            host_slots = requests = None

    def _report_direct(self, telemetry: TransferTelemetry, direction: str, copy: tuple, cause: str | None) -> None:
        """A copy nobody acks: tokens per pool and bytes from its transfer list."""
        transfers = _transfers(copy)
        if transfers is MISSING:
            return
        _wrapped, engine, _args, _kwargs, completion, start_ns, end_ns = copy
        info = self._engines.get(engine)
        pools, num_bytes, draft, page_size = _tally(transfers, info.pool_names if info is not None else {})
        attributes = info.attributes if info is not None else {}
        if draft:
            attributes = {**attributes, DRAFT_BYTES: draft}
        request = self.local.current_request()
        telemetry.submit(
            direction, pools, num_bytes + draft, page_size=info.page_size if info is not None else page_size or 1,
            io_backend=getattr(engine, "io_backend", None), attributes=attributes, expect_ack=False,
            host_start_ns=start_ns, **_events(completion.timing_enabled, completion.start_event,
                                              completion.finish_event, end_ns),
            cause=cause, requests=[request] if request is not None and cause in causes.REQUEST_CAUSES else None)
