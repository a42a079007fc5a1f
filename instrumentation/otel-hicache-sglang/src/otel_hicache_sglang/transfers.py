"""SGLang's L1<->L2 copies, reported to otel-hicache.

Two wrap points miss nothing (see ``docs/sglang.md``):

* ``L2TransferEngine.submit_device_to_host/submit_host_to_device`` make every
  copy. Called outside a ``start_*`` (decode-retraction backup/restore), the
  copy is reported at once as ``hicache.origin=direct``: tokens and bytes come
  from its transfer list.
* ``HiCacheController.start_writing/start_loading`` (inherited by
  ``HybridCacheController``) merge queued ops and append a ``HiCacheAck``.
  Copies made inside them are held until the original returns, then reported
  with that ack's own token counts per pool and bytes, as
  ``hicache.origin=merged_op``. The ack is paired by its ``finish_event``.

Consumers of acks are not patched: they pop, iterate-and-clear, or reset the
queues. Each merged op is submitted with ``ack_watch=(ack queue, ack)``; the
otel-hicache worker notices when the ack left the queue. Completion is observed
from the events (``finish_event.query()`` on the worker), never by
synchronizing.

On the scheduler thread each wrapper does a clock read, a few attribute reads
and one ``TransferTelemetry.submit()`` (a list append): no OTel SDK call, no
device call, no tensor work except for direct copies (a ``numel()`` per
transfer). Both per-op wrappers are plain functions (:class:`~.patching.Method`,
no wrapt proxy), and a copy made inside ``start_*`` is only held (its call's
arguments, read when the merged op is reported), so a merged op costs two
Python frames and the pairing; ``docs/performance.md`` has the figures.
"""

from __future__ import annotations

import sys
import threading
from threading import get_ident
import time
import weakref
from functools import partial
from typing import Any, Callable

from otel_hicache import TransferTelemetry
from otel_hicache.diagnostics import logger, warn_once

from . import causes
from .patching import MISSING, Method, arg, missing
from .ranks import rank_attributes

OFFLOAD = "offload"
ONBOARD = "onboard"
ANCHOR_POOL = "kv"  # PoolName.KV.value: the anchor pool of a plain HiCacheController
SGLANG_TRACE = "sglang.srt.observability.trace"

# span-only attributes SGLang knows about a controller
WRITE_POLICY = "hicache.write_policy"
LAYER_NUM = "hicache.layer_num"
MEM_LAYOUT = "hicache.mem_layout"
CONTROLLER = "hicache.controller"
DRAFT_BYTES = "hicache.draft_bytes"


_SYNCHRONOUS_EVENT_TYPES: dict[type, bool] = {}


class _Capture:
    """The copies held while a ``start_*`` runs (None outside one), and the cause of the
    cause site running (``causes.py``; None outside every site), both valid on ``thread``
    only. SGLang makes every L1<->L2 copy on its scheduler thread; a plain object, not a
    ``threading.local`` (cheaper to read and write), with the
    thread checked, so a copy on another thread is never taken for one of its."""

    __slots__ = ("captured", "cause", "request", "thread")

    def __init__(self) -> None:
        self.captured: list[Any] | None = None
        self.cause: str | None = None
        self.request: Any = None  # the trace context of the request site's request (causes.py)
        self.thread = 0

    def current_cause(self) -> str | None:
        cause = self.cause
        return cause if cause is None or self.thread == get_ident() else None

    def current_request(self) -> Any:
        request = self.request
        return request if request is None or self.thread == get_ident() else None

    def direct_requests(self, cause: str | None) -> list[Any] | None:
        """The request a direct copy made now belongs to (``causes.REQUEST_CAUSES``), as ``submit(requests=)``."""
        request = self.current_request()
        return [request] if request is not None and cause in causes.REQUEST_CAUSES else None


def sglang_tracing_enabled() -> bool:
    """Whether SGLang's request tracing (``--enable-trace``) is on in this process: its
    ``process_tracing_init`` runs before the scheduler makes its cache controllers."""
    module = sys.modules.get(SGLANG_TRACE)
    enabled = getattr(module, "get_global_tracing_enabled", None)
    return bool(enabled()) if enabled is not None else False


def _is_synchronous_event(event: Any) -> bool:
    """``torch.cpu`` events are no-ops: the copies ran inside the submit call."""
    cls = type(event)
    known = _SYNCHRONOUS_EVENT_TYPES.get(cls)
    if known is None:
        known = _SYNCHRONOUS_EVENT_TYPES[cls] = cls.__module__ == "torch.cpu"
    return known


def _host_indices(ops: list[Any]) -> list[Any]:
    """The host (CPU) token slots of SGLang's queued ``CacheOperation``s (on the worker)."""
    return [op.host_indices for op in ops]


def _engine_method(engine: Any, direction: str) -> Any:
    """The (patched) engine method that made a copy in ``direction``: for warnings that name it."""
    return getattr(type(engine), "submit_device_to_host" if direction == OFFLOAD else "submit_host_to_device", None)


class _ControllerInfo:
    """What is reported with every op of one controller, built once."""

    __slots__ = ("page_size", "io_backend", "has_drafts", "attributes", "pool_names", "anchor_host", "host_pool",
                 "__weakref__")

    def __init__(self, controller: Any) -> None:
        host = getattr(controller, "mem_pool_host", None)
        self.page_size = int(getattr(controller, "page_size", 0) or getattr(host, "page_size", 1) or 1)
        engine = getattr(controller, "l2_transfer_engine", None)
        self.io_backend = getattr(engine, "io_backend", None) or getattr(controller, "io_backend", None)
        self.has_drafts = False  # packed draft-model (MTP) pools ride on loads
        attributes: dict[str, Any] = {CONTROLLER: type(controller).__name__}
        for key, value in (
            (WRITE_POLICY, getattr(controller, "write_policy", None)),
            (LAYER_NUM, getattr(controller, "transfer_layer_id_max", None)),
            (MEM_LAYOUT, getattr(host, "layout", None)),
        ):
            if isinstance(value, (str, int)) and not isinstance(value, bool):
                attributes[key] = value
        self.attributes = attributes
        # the anchor (KV) host pool, whose pages host residence tracks (TransferObserver._info)
        self.anchor_host = getattr(getattr(host, "anchor_entry", None), "host_pool", None) or host
        self.host_pool: Any = None
        # host pool -> pool name, for the token counts of direct copies
        self.pool_names: dict[int, str] = {}
        entries = getattr(host, "entry_map", None)
        if isinstance(entries, dict):  # HybridCacheController: a HostPoolGroup
            for entry in entries.values():
                name = getattr(getattr(entry, "name", None), "value", None)
                pool = getattr(entry, "host_pool", None)
                if isinstance(name, str) and pool is not None:
                    self.pool_names[id(pool)] = name
                if getattr(entry, "packed_draft_device_pools", None):
                    self.has_drafts = True
        elif host is not None:
            self.pool_names[id(host)] = ANCHOR_POOL


class TransferObserver:
    """Per-process state of the SGLang adapter: the telemetry, built lazily in
    the first process that makes a HiCache controller (a scheduler), and which
    engine belongs to which controller."""

    def __init__(self, make_telemetry: Callable[[dict[str, Any]], TransferTelemetry]) -> None:
        self._make_telemetry = make_telemetry
        self.telemetry: TransferTelemetry | None = None
        self._failed = False
        self._lock = threading.Lock()
        self._local = _Capture()
        self.causes = causes.QueuedCauses(self._local)
        self._controllers: "weakref.WeakKeyDictionary[Any, _ControllerInfo]" = weakref.WeakKeyDictionary()
        self._engines: "weakref.WeakKeyDictionary[Any, _ControllerInfo]" = weakref.WeakKeyDictionary()
        self._last_controller: tuple[Any, _ControllerInfo] | None = None  # (weakref, its info)
        # id(SGLang host pool) -> (weakref to it, its otel_hicache.sinks.host_residence.HostPool)
        self.host_pools: dict[int, tuple[Any, Any]] = {}
        # called once, at the first controller of a process whose SGLang request tracing is on
        self.on_request_tracing: Callable[[], None] | None = None

    # -- set-up ---------------------------------------------------------------
    def telemetry_now(self) -> TransferTelemetry | None:
        """The telemetry of this process, started on first use (ranks are
        published by then). None if it could not start (warned once)."""
        telemetry = self.telemetry
        if telemetry is None and not self._failed:
            with self._lock:
                telemetry = self.telemetry
                if telemetry is None and not self._failed:
                    try:
                        telemetry = self.telemetry = self._make_telemetry(rank_attributes())
                    except Exception as exc:  # pylint: disable=broad-except
                        self._failed = True
                        warn_once("sglang:telemetry", "otel-hicache: could not start telemetry (%r); "
                                  "SGLang runs uninstrumented", exc)
        return telemetry

    def controller_created(self, controller: Any) -> None:
        """After ``HiCacheController.__init__``: start telemetry in this process,
        remember the controller's attributes and its engine."""
        try:
            if self.telemetry_now() is not None:
                self._info(controller)
                if self.on_request_tracing is not None and sglang_tracing_enabled():
                    hook, self.on_request_tracing = self.on_request_tracing, None
                    hook()
        except Exception as exc:  # pylint: disable=broad-except
            warn_once("sglang:controller", "otel-hicache: cannot read a %s (%r); its ops carry fewer attributes",
                      type(controller).__name__, exc)

    def _info(self, controller: Any) -> _ControllerInfo:
        info = self._controllers.get(controller)
        if info is None:
            info = self._controllers[controller] = _ControllerInfo(controller)
            engine = getattr(controller, "l2_transfer_engine", None)
            if engine is not None:
                self._engines[engine] = info
            self._track_host_pool(info)
        return info

    def _controller_info(self, controller: Any) -> _ControllerInfo:
        """The info of the controller of the last op (the common case, without a lookup), or looked up."""
        last = self._last_controller
        if last is not None and last[0]() is controller:
            return last[1]
        info = self._info(controller)
        self._last_controller = (weakref.ref(controller), info)
        return info

    def _track_host_pool(self, info: _ControllerInfo) -> None:
        """Host residence for the controller's anchor host pool (shared by controllers on one pool)."""
        telemetry, host = self.telemetry, info.anchor_host
        if telemetry is None or host is None:
            return
        known = self.host_pools.get(id(host))
        if known is not None and known[0]() is host:
            info.host_pool = known[1]
            return
        slots, page_size = getattr(host, "size", None), getattr(host, "page_size", None)
        if not isinstance(slots, int) or not isinstance(page_size, int):
            return
        info.host_pool = telemetry.host_pool(slots, page_size)
        if info.host_pool is not None:
            self.host_pools[id(host)] = (weakref.ref(host), info.host_pool)

    def host_free_wrapper(self) -> Method:
        """For ``HostKVCache.free(indices)``: freed pages of a tracked host pool, to the worker."""
        observer = self

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def free_patched(host: Any, *args: Any, **kwargs: Any) -> Any:
                result = original(host, *args, **kwargs)
                tracked = observer.host_pools.get(id(host))
                if tracked is not None and tracked[0]() is host:
                    telemetry = observer.telemetry
                    indices = args[0] if args else kwargs.get("indices", MISSING)  # patching.arg(), inlined
                    if telemetry is not None and indices is not MISSING:
                        if getattr(indices, "is_cuda", False):  # reading them would synchronize
                            warn_once("sglang:host_free_cuda", "otel-hicache: host pages freed by device indices "
                                      "are not tracked (reading them would synchronize)")
                        else:
                            telemetry.host_freed(tracked[1], indices)
                return result

            return free_patched

        return Method(make)

    # -- engine wrappers (every copy) -------------------------------------------
    def submit_wrapper(self, direction: str) -> Method:
        """For ``L2TransferEngine.submit_*(transfers, ...)``."""
        observer = self
        local = self._local
        clock = time.time_ns

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def submit_patched(engine: Any, *args: Any, **kwargs: Any) -> Any:
                captured = local.captured
                if captured is not None and local.thread == get_ident():  # inside start_*: held for its ack
                    start_ns = clock()
                    completion = original(engine, *args, **kwargs)
                    captured.append((engine, args, kwargs, completion, start_ns, clock()))
                    return completion
                telemetry = observer.telemetry
                if telemetry is None:
                    telemetry = observer.telemetry_now()  # the first copy of a process with no controller yet
                if telemetry is None or not telemetry.enabled:
                    return original(engine, *args, **kwargs)
                start_ns = clock()
                completion = original(engine, *args, **kwargs)
                end_ns = clock()
                try:
                    transfers = observer._transfers(original, args, kwargs)
                    if transfers is not MISSING:
                        observer._report_direct(telemetry, direction, engine, transfers, completion, start_ns,
                                                end_ns, local.current_cause())
                except Exception as exc:  # pylint: disable=broad-except  # never into SGLang
                    warn_once("sglang:submit", "otel-hicache: could not report an L2 copy (%r)", exc)
                return completion

            return submit_patched

        return Method(make)

    @staticmethod
    def _transfers(original: Any, args: tuple, kwargs: dict) -> Any:
        """The ``transfers`` parameter of an engine call (MISSING, warned once, if renamed)."""
        transfers = arg(args, kwargs, 0, "transfers")
        if transfers is MISSING:
            missing(original, "transfers", "its direct copies are not reported, its merged ops carry no "
                    "hicache.draft_bytes")
        return transfers

    # -- controller wrappers (merged ops with an ack) ------------------------------
    def start_wrapper(self, direction: str, op_queue: str, ack_queue: str) -> Method:
        """For ``HiCacheController.start_writing/start_loading()``, which merge ``op_queue``
        and append the ack to ``ack_queue``."""
        observer = self
        local = self._local
        queued_causes = self.causes
        onboard = direction == ONBOARD
        other_queue = "write_queue" if op_queue == "load_queue" else "load_queue"
        resolve = queued_causes.resolve

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def start_patched(controller: Any, *args: Any, **kwargs: Any) -> Any:
                telemetry = observer.telemetry
                if telemetry is None or not telemetry.enabled:
                    if queued_causes.log:  # nothing will resolve them
                        queued_causes.log = []
                    return original(controller, *args, **kwargs)
                try:
                    queued = getattr(controller, op_queue)
                    # causes.QueuedCauses.pending(), inlined (its hand_over() when the op is submitted):
                    # the queues as they are before the merge, the cause worked out on the worker
                    cause = local.cause
                    if cause is not None and local.thread != get_ident():
                        cause = None
                    requests = ops = waiting = None
                    if queued_causes.log or queued_causes.handed:
                        if queued_causes.linking:
                            requests = []
                        other = getattr(controller, other_queue)
                        ops, counter = list(queued), queued_causes.operations.counter
                        waiting = list(other) if other else None
                    info = observer._controller_info(controller)
                    # the queued ops' CPU host indices, read on the worker (host residence)
                    host = info.host_pool
                    host_slots = None
                    if host is not None and queued:
                        host_slots = (host, partial(_host_indices, ops if ops is not None else list(queued)))
                except Exception as exc:  # pylint: disable=broad-except
                    warn_once("sglang:cause", "otel-hicache: cannot read the queued ops (%r)", exc)
                    cause = info = host_slots = requests = ops = None
                outer = local.captured
                captured: list[Any] = []
                local.captured = captured
                local.thread = get_ident()
                try:
                    result = original(controller, *args, **kwargs)
                except BaseException:
                    local.captured = outer
                    observer._report_unpaired(telemetry, direction, captured, local.current_cause())
                    raise
                local.captured = outer
                if not captured:
                    return result
                try:
                    # The common case inline (one copy, the controller of the last op, its ack
                    # appended last, no draft pools on a load): what _report_merged does, without
                    # its frame and lookups; anything else goes there.
                    if len(captured) == 1 and info is not None:
                        engine, copy_args, copy_kwargs, completion, start_ns, end_ns = captured[0]
                        queue = getattr(controller, ack_queue)
                        ack = queue[-1] if queue else None
                        finish = completion.finish_event
                        if (ack is not None and ack.finish_event is finish
                                and (copy_args or "transfers" in copy_kwargs) and not (onboard and info.has_drafts)):
                            timing = ack.timing_enabled
                            if ops is not None:  # QueuedCauses.hand_over(), inlined
                                logged = queued_causes.log
                                if logged:
                                    queued_causes.log = []
                                    queued_causes.handed = True
                                else:
                                    logged = ()  # never the live list
                                cause = (resolve, controller, ops, waiting, counter, cause, requests, logged)
                            telemetry.submit(
                                direction, ack.num_tokens_by_pool or {ANCHOR_POOL: ack.num_tokens}, ack.num_bytes,
                                info.page_size, ack.start_event, finish, timing, info.io_backend, info.attributes,
                                host_start_ns=start_ns,
                                host_end_ns=end_ns if not timing and _is_synchronous_event(finish) else None,
                                ack_watch=(queue, ack), cause=cause, host_slots=host_slots, requests=requests,
                            )
                            return result
                    if ops is not None:
                        cause = ((ops, waiting, counter), cause)
                    observer._report_merged(telemetry, direction, controller, ack_queue, captured, cause, host_slots,
                                            requests)
                except Exception as exc:  # pylint: disable=broad-except
                    warn_once("sglang:start", "otel-hicache: could not report a merged op (%r)", exc)
                return result

            return start_patched

        return Method(make)

    def wrap_init(self, wrapped: Callable[..., Any], controller: Any, args: tuple, kwargs: dict) -> None:
        """``HiCacheController.__init__``: then start this process's telemetry."""
        wrapped(*args, **kwargs)
        self.controller_created(controller)

    # -- reporting ------------------------------------------------------------
    def _report_merged(self, telemetry: TransferTelemetry, direction: str, controller: Any, ack_queue: str,
                       captured: list[Any], cause: Any, host_slots: Any, requests: Any = None) -> None:
        """``cause``: the current site's (or None), or ``(pending, it)`` with the queues that
        start_* copied, handed over (``QueuedCauses.hand_over``) with the first copy paired
        with an ack."""
        # Runs once per merged op on the scheduler thread, between two device ops (cold
        # caches): every lookup counts several times what it costs in a loop.
        info = self._controller_info(controller)
        pending = None
        if type(cause) is tuple:
            pending, cause = cause
        current = cause
        queue = getattr(controller, ack_queue)
        for engine, args, kwargs, completion, start_ns, end_ns in captured:
            transfers = args[0] if args else kwargs.get("transfers", MISSING)  # arg(), inlined
            if transfers is MISSING:
                transfers = self._transfers(_engine_method(engine, direction), args, kwargs)
            finish = completion.finish_event
            ack = queue[-1] if queue else None  # start_* appends its ack last
            if ack is None or ack.finish_event is not finish:
                ack = next((a for a in reversed(queue[-4:]) if a.finish_event is finish), None)
                if ack is None:
                    self._report_direct(telemetry, direction, engine, transfers, completion, start_ns, end_ns,
                                        current)
                    continue
            if pending is not None:
                cause = self.causes.hand_over(controller, *pending, current, requests)
                pending = None  # the same deferred call for the merged op's other copies
            attributes = info.attributes
            if info.has_drafts and direction == ONBOARD:
                draft = self._draft_bytes(transfers)
                if draft:
                    attributes = {**attributes, DRAFT_BYTES: draft}
            timing = ack.timing_enabled
            telemetry.submit(
                direction, ack.num_tokens_by_pool or {ANCHOR_POOL: ack.num_tokens}, ack.num_bytes, info.page_size,
                ack.start_event, finish, timing, info.io_backend, attributes,
                host_start_ns=start_ns,
                host_end_ns=end_ns if not timing and _is_synchronous_event(finish) else None,
                ack_watch=(queue, ack), cause=cause, host_slots=host_slots, requests=requests,
            )
            host_slots = requests = None  # the queued ops belong to the first copy paired with an ack

    def _report_unpaired(self, telemetry: TransferTelemetry, direction: str, captured: list[Any],
                         cause: str | None) -> None:
        """start_* raised after copying: the copies happened, report them as direct."""
        for engine, args, kwargs, completion, start_ns, end_ns in captured:
            try:
                transfers = self._transfers(_engine_method(engine, direction), args, kwargs)
                self._report_direct(telemetry, direction, engine, transfers, completion, start_ns, end_ns, cause)
            except Exception:  # pylint: disable=broad-except
                logger.debug("otel-hicache: could not report a copy", exc_info=True)

    def _report_direct(self, telemetry: TransferTelemetry, direction: str, engine: Any, transfers: Any,
                       completion: Any, start_ns: int, end_ns: int, cause: str | None) -> None:
        """A copy nobody acks: tokens per pool and bytes from its transfer list; ``cause``
        that of the site it was made in (None: ``other``)."""
        if transfers is MISSING:
            return
        info = self._engines.get(engine)
        pool_names = info.pool_names if info is not None else {}
        pools: dict[str, int] = {}
        num_bytes = 0
        draft = 0
        page_size = info.page_size if info is not None else 0
        for index, transfer in enumerate(transfers):
            host_pool = transfer.host_pool
            tokens = int(transfer.host_indices.numel())
            size = int(getattr(host_pool, "size_per_token", 0) or 0)
            if getattr(transfer, "is_draft", False):
                draft += self._draft_layer_bytes(transfer, tokens)
                continue
            num_bytes += tokens * size
            name = pool_names.get(id(host_pool)) or (ANCHOR_POOL if index == 0 else type(host_pool).__name__)
            pools[name] = pools.get(name, 0) + tokens
            if not page_size:
                page_size = int(getattr(host_pool, "page_size", 1) or 1)
        attributes = info.attributes if info is not None else {}
        if draft:
            attributes = {**attributes, DRAFT_BYTES: draft}
        finish = completion.finish_event
        telemetry.submit(
            direction, pools, num_bytes + draft, page_size or 1, completion.start_event, finish,
            completion.timing_enabled, getattr(engine, "io_backend", None), attributes,
            expect_ack=False,
            host_start_ns=start_ns,
            host_end_ns=end_ns if not completion.timing_enabled and _is_synchronous_event(finish) else None,
            cause=cause, requests=self._local.direct_requests(cause) if self._local.request is not None else None,
        )

    @classmethod
    def _draft_bytes(cls, transfers: Any) -> int:
        total = 0
        if transfers is MISSING:
            return total
        for transfer in transfers:
            if getattr(transfer, "is_draft", False):
                total += cls._draft_layer_bytes(transfer, int(transfer.host_indices.numel()))
        return total

    @staticmethod
    def _draft_layer_bytes(transfer: Any, tokens: int) -> int:
        """A packed draft transfer moves one host layer: tokens x bytes per token per layer."""
        host_pool = transfer.host_pool
        layers = int(getattr(host_pool, "layer_num", 0) or 0)
        size = int(getattr(host_pool, "size_per_token", 0) or 0)
        return tokens * size // layers if layers else 0
