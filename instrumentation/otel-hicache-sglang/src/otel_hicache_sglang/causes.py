"""Why each copy was made (``hicache.cause``), taken where SGLang *queues* the op.

A wrapper on each SGLang method that asks for copies for one reason (a cause site, :data:`SITES`)
sets the thread's current cause during the call and logs the range of op ids the call made
(``CacheOperation.counter``). ``start_*`` hands that log and a copy of the queue it merges to the
poller, which finds each op's range: one cause, or the op's parts by cause, each queued op's
tokens and bytes by SGLang's own ``_num_tokens_by_pool``/``_transfer_num_bytes`` (they sum to the
totals). With SGLang's request tracing on, the :data:`REQUEST_SITES` set the current request too.
"""

from __future__ import annotations

import sys
from bisect import bisect_right
from operator import attrgetter
from threading import get_ident
from types import SimpleNamespace
from typing import Any, Callable, NamedTuple

from opentelemetry.trace import get_current_span
from otel_hicache import semconv as sc
from otel_hicache.diagnostics import warn_once

from . import registration as reg


class Local:
    """The scheduler thread's copies held in a ``start_*``, current cause and request: valid on
    ``thread`` only (cheaper than a ``threading.local``)."""

    captured: list[Any] | None = None
    cause: str | None = None
    request: Any = None
    thread = 0

    def current_cause(self) -> str | None:
        return self.cause if self.thread == get_ident() else None

    def current_request(self) -> Any:
        return self.request if self.thread == get_ident() else None


class Site(NamedTuple):
    """``(module, "Class.method")``, its cause (or ``f(instance, controller, args, kwargs)``), its controller."""

    module: str
    path: str
    cause: str | Callable[[Any, Any, tuple, dict], str]
    controller: Callable[[Any], Any]


_own_controller = attrgetter("cache_controller")
_pipeline_controller = attrgetter("_cache.cache_controller")  # BufferModePipeline's cache's


def backup_cause(_cache: Any, controller: Any, args: tuple, kwargs: dict) -> str:
    """``UnifiedRadixCache._execute_and_commit_kv_backup(action, write_back=False)``: a write-back
    when ``write_back``, else the insert-time backup of the write policy."""
    if args[1] if len(args) > 1 else kwargs.get("write_back", False):
        return reg.WRITE_BACK
    if getattr(controller, "write_policy", None) == "write_through_selective":
        return reg.WRITE_THROUGH_SELECTIVE
    return reg.WRITE_THROUGH


UNIFIED_RADIX_CACHE = "sglang.srt.mem_cache.unified_radix_cache"
BUFFER_PIPELINE = "sglang.srt.mem_cache.buffer_mode.pipeline"
DECODE_OFFLOAD = "sglang.srt.disaggregation.decode_kvcache_offload_manager"

SITES: dict[str, tuple[Site, ...]] = {  # group name -> its sites (wrapped all or nothing)
    "transfer causes": (
        Site(UNIFIED_RADIX_CACHE, "UnifiedRadixCache._execute_and_commit_kv_backup", backup_cause, _own_controller),
        Site(UNIFIED_RADIX_CACHE, "UnifiedRadixCache.load_back", reg.PREFIX_HIT, _own_controller),
        Site(UNIFIED_RADIX_CACHE, "UnifiedRadixCache.backup_kv_cache", reg.RETRACTION_BACKUP, _own_controller),
        Site(UNIFIED_RADIX_CACHE, "UnifiedRadixCache.restore_kv_cache", reg.RETRACTION_RESTORE, _own_controller),
    ),
    "transfer causes: buffer-only host mode": (
        Site(BUFFER_PIPELINE, "BufferModePipeline._stage_backup_intent", reg.STORAGE_BACKUP, _pipeline_controller),
        Site(BUFFER_PIPELINE, "BufferModePipeline._allocate_and_queue_load_back", reg.STORAGE_PREFETCH,
             _pipeline_controller),
    ),
    "transfer causes: decode offload": (
        Site(DECODE_OFFLOAD, "DecodeKVCacheOffloadManager.offload_kv_cache", reg.DECODE_OFFLOAD, _own_controller),
    ),
}


class RequestSite(NamedTuple):
    """``(module, "Class.method")`` and its request parameter (position after ``self``, name)."""

    module: str
    path: str
    position: int
    name: str


REQUEST_SITES: dict[str, tuple[RequestSite, ...]] = {
    "request links": (
        RequestSite(UNIFIED_RADIX_CACHE, "UnifiedRadixCache.checkpoint_into_tree", 0, "req"),  # insert
        RequestSite(UNIFIED_RADIX_CACHE, "UnifiedRadixCache.load_back", 2, "req"),
        RequestSite(UNIFIED_RADIX_CACHE, "UnifiedRadixCache.backup_kv_cache", 0, "req"),
        RequestSite(UNIFIED_RADIX_CACHE, "UnifiedRadixCache.restore_kv_cache", 0, "req"),
    ),
    "request links: decode offload": (
        RequestSite(DECODE_OFFLOAD, "DecodeKVCacheOffloadManager.offload_kv_cache", 0, "req"),
    ),
}

REQUEST_CAUSES = frozenset((reg.WRITE_THROUGH, reg.WRITE_THROUGH_SELECTIVE, reg.PREFIX_HIT, reg.DECODE_OFFLOAD,
                            reg.RETRACTION_BACKUP, reg.RETRACTION_RESTORE))
"""The causes whose copies belong to the request of their site (a write-back does not)."""

MAX_ID_RANGES = 4096  # per controller; beyond (ops waiting that long), the oldest half go
MAX_LOG = 16384  # site calls logged between two merged ops; later ones are not


def request_context(req: Any) -> Any:
    """A traced request's root span context, else None (read from ``__dict__``: SGLang's
    ``TraceNullContext`` answers any attribute, slowly)."""
    trace_ctx = getattr(getattr(req, "time_stats", None), "trace_ctx", None)
    context = getattr(trace_ctx, "__dict__", {}).get("root_span_context")
    return get_current_span(context).get_span_context() if isinstance(context, dict) else None


class QueuedCauses:
    """The causes (and requests) of each controller's queued ops, as ranges of op ids.

    The scheduler thread only appends to :attr:`log`; each merged op takes the log so far to
    :meth:`resolve` on the poller (so a poller behind by any number of ops loses none), which
    keeps ``by_controller``: ``id(controller) -> (ends, entries)``, ``entries[i] = (first id,
    cause, request)`` of ops ``first <= id < ends[i]``, in the order the calls returned (``ends``
    never decreases; a nested site comes first)."""

    def __init__(self, local: Local, operations: Any = None) -> None:
        self.local = local
        self.operations = operations  # the class numbering the ops (.counter); None: SGLang's
        self.log: list[tuple[Any, ...]] = []
        self.handed = False  # a log was handed over: the poller may hold ranges of ops still queued
        self.linking = False  # a traced request passed a request site: start_* collects requests
        self.by_controller: dict[int, tuple[list[int], list[tuple[int, str, Any]]]] = {}
        self._last: tuple[list[Any], Any] | None = None  # resolve()'s last ops and answer

    def _counter(self) -> Any:
        """SGLang's ``CacheOperation`` (imported by the sites' modules), which numbers its ops."""
        if self.operations is None:
            operation = getattr(sys.modules.get("sglang.srt.managers.cache_controller"), "CacheOperation", None)
            if not isinstance(getattr(operation, "counter", None), int):
                warn_once("cause:counter", "otel-hicache: SGLang's CacheOperation.counter is missing; queued ops "
                          "are counted as 'other'")
                operation = SimpleNamespace(counter=0)  # never moves: nothing is tagged
            self.operations = operation
        return self.operations

    def request_site(self, site: RequestSite) -> Callable[..., Any]:
        """The wrapper of a request site: its request is the current one during the call."""
        local, position, name = self.local, site.position, site.name

        def request_site(wrapped: Any, _instance: Any, args: tuple, kwargs: dict) -> Any:
            try:
                context = request_context(args[position] if len(args) > position else kwargs.get(name))
            except Exception:  # not linked, never into SGLang
                context = None
            if context is None:
                return wrapped(*args, **kwargs)
            self.linking = True
            outer, local.request, local.thread = local.request, context, get_ident()
            try:
                return wrapped(*args, **kwargs)
            finally:
                local.request = outer

        return request_site

    def site(self, site: Site) -> Callable[..., Any]:
        """The wrapper of a cause site."""
        local, cause_of, controller_of = self.local, site.cause, site.controller

        def cause_site(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            try:
                cause = cause_of if type(cause_of) is str else cause_of(instance, controller_of(instance), args, kwargs)
                operations = self.operations or self._counter()
            except Exception as exc:  # never into SGLang
                warn_once(f"cause:{site.path}", "otel-hicache: cannot read the cause of %s (%r); its copies are "
                          "counted as 'other'", site.path, exc)
                return wrapped(*args, **kwargs)
            first = operations.counter
            outer, local.cause, local.thread = local.cause, cause, get_ident()
            try:
                return wrapped(*args, **kwargs)
            finally:
                local.cause = outer
                end = operations.counter
                if end != first:  # most calls make no op
                    if len(self.log) < MAX_LOG:
                        self.log.append((controller_of, instance, first, end, cause, local.request))
                    else:  # no merged op for that long (reset()s only, or no start_* wrapped)
                        warn_once("cause:log", "otel-hicache: %d cause-site calls made ops and no merged op "
                                  "followed; the ops of later ones are counted as 'other'", MAX_LOG)

        return cause_site

    def pending(self, controller: Any, ops: list[Any], other: list[Any]) -> tuple[Any, list[Any] | None]:
        """Before ``start_*`` merges ``ops`` (a copy of its queue; ``other``, the other queue):
        ``(cause, requests)``, the current cause while no site made an op, else what
        :meth:`hand_over` makes the deferred call of, and the list it fills with requests."""
        current = self.local.current_cause()
        if not (self.log or self.handed):
            return current, None
        requests: list[Any] | None = [] if self.linking else None
        return (controller, ops, list(other) if other else None, self._counter().counter, current,
                requests), requests

    def hand_over(self, pending: Any) -> Any:
        """As the merged op is submitted (only then: a ``start_*`` may submit nothing):
        ``submit(cause_call=)``, the deferred call of :meth:`resolve` with the log so far."""
        if type(pending) is not tuple:
            return pending
        logged = self.log
        if logged:
            self.log = []
            self.handed = True
        else:
            logged = []  # never the live list, which later sites append to
        return (self.resolve, *pending, logged)

    def resolve(self, controller: Any, ops: list[Any], waiting: list[Any] | None, counter: int,
                current: str | None, requests: list[Any] | None, logged: list[Any]) -> Any:
        """On the poller, in submission order: the cause of the merged op of ``ops`` (one, or its
        parts; an op no site made is ``current``'s, or ``other``), their requests appended to
        ``requests``; the ranges no op still waiting (in ``waiting``, or made from ``counter`` on)
        needs are dropped. The same ``ops`` again (another copy of the op): the same answer."""
        if self._last is None or self._last[0] is not ops:
            self._sort_in(logged)
            self._last = (ops, self._cause(controller, ops, waiting, counter, current, requests))
        return self._last[1]

    def _cause(self, controller: Any, ops: list[Any], waiting: list[Any] | None, counter: int, current: str | None,
               requests: list[Any] | None) -> Any:
        ends, entries = self.by_controller.get(id(controller), ([], []))
        if not ends or not ops:
            return current
        causes = []
        for op in ops:
            i = bisect_right(ends, op.id)  # the first range ending after it, then outwards (nested sites)
            while i < len(ends) and entries[i][0] > op.id:
                i += 1
            causes.append(entries[i][1] if i < len(ends) else current or sc.CAUSE_OTHER)
            if i < len(ends) and entries[i][2] is not None and requests is not None:
                requests.append(entries[i][2])
        # every op made before the merge was merged, waits in the other queue, or was dropped (reset())
        drop = bisect_right(ends, min([counter, *(op.id for op in waiting or ())]))
        del ends[:drop], entries[:drop]
        return causes[0] if len(set(causes)) == 1 else [  # SGLang's own counts add up over merged ops
            (cause, controller._num_tokens_by_pool(op), controller._transfer_num_bytes(op))
            for op, cause in zip(ops, causes)]

    def _sort_in(self, logged: list[Any]) -> None:
        for controller_of, instance, first, end, cause, request in logged:
            try:
                key = id(controller_of(instance))
            except Exception as exc:
                warn_once("cause:tag", "otel-hicache: cannot tag queued ops with their cause (%r); they are "
                          "counted as 'other'", exc)
                continue
            ends, entries = self.by_controller.setdefault(key, ([], []))
            if len(ends) >= MAX_ID_RANGES:  # ops waiting that long, or a controller never started
                warn_once("cause:ranges", "otel-hicache: %d id ranges of queued ops kept for one controller; the "
                          "oldest half are dropped (their ops are counted as 'other')", MAX_ID_RANGES)
                del ends[:MAX_ID_RANGES // 2], entries[:MAX_ID_RANGES // 2]
            ends.append(end)
            entries.append((first, cause, request if cause in REQUEST_CAUSES else None))
