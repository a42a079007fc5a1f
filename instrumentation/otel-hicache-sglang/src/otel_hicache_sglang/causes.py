"""Why each copy was made (``hicache.cause``), from where SGLang asked for it.

SGLang queues an op (``HiCacheController.write/load``) in one place and submits it
later, merged with others, in ``start_writing/start_loading``. So the cause is taken
where the op is *queued*: a wrapper on each SGLang method that asks for copies for
one reason (a *cause site*, :data:`SITES`) sets the thread's current cause for the
duration of the call. Every op is a ``CacheOperation`` numbered in creation order
(``CacheOperation.counter``, its ``id``): the site reads the counter before and after
the call, and a call that made ops records its range of ids and its cause for its
controller (nothing is read from the queues; most calls make no op). ``start_*`` (see
``transfers.py``) finds each op it merges in those ranges (innermost site first): one
cause for all of them is the merged op's cause; several are reported as parts, each
op's tokens and bytes computed with SGLang's own ``_num_tokens_by_pool``/
``_transfer_num_bytes`` (which add up over merged ops), so bytes and tokens per cause
sum exactly to the totals. An op queued outside every site, or copied directly outside
one, is ``other``.

Requests (``REQUEST_SITES``): with SGLang's request tracing on (``--enable-trace``),
a wrapper on each SGLang method that handles one request sets the thread's current
request (its trace context, ``req.time_stats.trace_ctx.root_span_context``) for the
call, and the ops its cause sites queue, or the copies they make, are tagged with it
too: the span links to the requests (``otel_hicache.request_links``). Only for the
causes that belong to one request (:data:`REQUEST_CAUSES`): a write-back during a
request's allocation wrote other requests' KV. The request sites are wrapped only in a
process whose SGLang tracing is on (``TransferObserver``); without it nothing is paid
but one attribute read per tagged call.

Nothing inspects the stack: a site costs one Python frame, two reads of the counter and
the current cause set and restored per call, and an id range appended when it made ops
(``docs/performance.md``).
"""

from __future__ import annotations

import sys
from bisect import bisect_right
from operator import attrgetter
from threading import get_ident
from typing import Any, Callable, NamedTuple

from otel_hicache import semconv as sc
from otel_hicache.diagnostics import warn_once

from .patching import Method


class Site(NamedTuple):
    """A cause site: ``(module, "Class.method")``, its cause (or a function of the call's
    ``(instance, controller, args, kwargs)`` that returns one) and how to reach the
    controller whose queues the call appends to."""

    module: str
    path: str
    cause: str | Callable[[Any, Any, tuple, dict], str]
    controller: Callable[[Any], Any]


_own_controller = attrgetter("cache_controller")  # C: no Python frame per site call
_pipeline_controller = attrgetter("_cache.cache_controller")  # BufferModePipeline's cache's


def backup_cause(_cache: Any, controller: Any, args: tuple, kwargs: dict) -> str:
    """``UnifiedRadixCache._execute_and_commit_kv_backup(action, write_back=False)``: a
    write-back backup (device eviction under ``write_back``, or a component's state
    eviction) when ``write_back``; otherwise the insert-time backup of the write policy."""
    if (args[1] if len(args) > 1 else kwargs.get("write_back", False)):  # patching.arg(), inlined
        return sc.CAUSE_WRITE_BACK
    if getattr(controller, "write_policy", None) == "write_through_selective":
        return sc.CAUSE_WRITE_THROUGH_SELECTIVE
    return sc.CAUSE_WRITE_THROUGH


UNIFIED_RADIX_CACHE = "sglang.srt.mem_cache.unified_radix_cache"
BUFFER_PIPELINE = "sglang.srt.mem_cache.buffer_mode.pipeline"
DECODE_OFFLOAD = "sglang.srt.disaggregation.decode_kvcache_offload_manager"

SITES: dict[str, tuple[Site, ...]] = {
    # group name -> its sites (wrapped all or nothing, when the module is imported)
    "transfer causes": (
        Site(UNIFIED_RADIX_CACHE, "UnifiedRadixCache._execute_and_commit_kv_backup", backup_cause, _own_controller),
        Site(UNIFIED_RADIX_CACHE, "UnifiedRadixCache.load_back", sc.CAUSE_PREFIX_HIT, _own_controller),
        Site(UNIFIED_RADIX_CACHE, "UnifiedRadixCache.backup_kv_cache", sc.CAUSE_RETRACTION_BACKUP, _own_controller),
        Site(UNIFIED_RADIX_CACHE, "UnifiedRadixCache.restore_kv_cache", sc.CAUSE_RETRACTION_RESTORE,
             _own_controller),
    ),
    "transfer causes: buffer-only host mode": (
        Site(BUFFER_PIPELINE, "BufferModePipeline._stage_backup_intent", sc.CAUSE_STORAGE_BACKUP,
             _pipeline_controller),
        Site(BUFFER_PIPELINE, "BufferModePipeline._allocate_and_queue_load_back", sc.CAUSE_STORAGE_PREFETCH,
             _pipeline_controller),
    ),
    "transfer causes: decode offload": (
        Site(DECODE_OFFLOAD, "DecodeKVCacheOffloadManager.offload_kv_cache", sc.CAUSE_DECODE_OFFLOAD,
             _own_controller),
    ),
}


class RequestSite(NamedTuple):
    """A request site: ``(module, "Class.method")`` and where its request parameter is
    (position after ``self``, name)."""

    module: str
    path: str
    position: int
    name: str


REQUEST_SITES: dict[str, tuple[RequestSite, ...]] = {
    # group name -> its sites (as SITES: one module per group, each applied when it is imported)
    "request links": (
        RequestSite(UNIFIED_RADIX_CACHE, "UnifiedRadixCache.checkpoint_into_tree", 0, "req"),  # insert
        RequestSite(UNIFIED_RADIX_CACHE, "UnifiedRadixCache.load_back", 2, "req"),  # a prefix hit's load-back
        RequestSite(UNIFIED_RADIX_CACHE, "UnifiedRadixCache.backup_kv_cache", 0, "req"),
        RequestSite(UNIFIED_RADIX_CACHE, "UnifiedRadixCache.restore_kv_cache", 0, "req"),
    ),
    "request links: decode offload": (
        RequestSite(DECODE_OFFLOAD, "DecodeKVCacheOffloadManager.offload_kv_cache", 0, "req"),
    ),
}

REQUEST_CAUSES = frozenset((
    sc.CAUSE_WRITE_THROUGH, sc.CAUSE_WRITE_THROUGH_SELECTIVE, sc.CAUSE_PREFIX_HIT, sc.CAUSE_DECODE_OFFLOAD,
    sc.CAUSE_RETRACTION_BACKUP, sc.CAUSE_RETRACTION_RESTORE,
))
"""The causes whose copies belong to the request of their site: linked to it."""


_NO_ATTRIBUTES: dict[str, Any] = {}

MAX_ID_RANGES = 4096
"""Id ranges kept per controller at most. Each ``start_*`` drops those that no op still
waiting in the controller's queues needs; ops dropped without one (``reset()``) leave
theirs until this many pile up, then the oldest half go."""


def _cache_operation() -> Any:
    """SGLang's ``CacheOperation`` (the class that numbers the queued ops), or None. Its
    module is imported by then: the sites' modules import it, and the adapter patches it."""
    module = sys.modules.get("sglang.srt.managers.cache_controller")
    operation = getattr(module, "CacheOperation", None)
    return operation if isinstance(getattr(operation, "counter", None), int) else None


class _NoCounter:
    counter = 0  # never moves: nothing is tagged (warned once)


def request_context(req: Any) -> Any:
    """A traced SGLang request's trace context (its root span's), else None. Read from the
    trace context's own ``__dict__``: SGLang's ``TraceNullContext`` (an untraced request)
    answers every missing attribute with itself, after an AttributeError (~1.5 us)."""
    trace_ctx = getattr(getattr(req, "time_stats", None), "trace_ctx", None)
    context = getattr(trace_ctx, "__dict__", _NO_ATTRIBUTES).get("root_span_context")
    return context if isinstance(context, dict) else None  # an OTel Context is a dict


class QueuedCauses:
    """The causes (and requests) of the ops each controller has queued, as ranges of op ids:
    ``id(controller) -> (ends, entries)``, ``entries[i] = (first id, cause, request)`` of the
    ops ``first <= id < ends[i]`` made by one site's call, in the order the calls returned
    (so ``ends`` never decreases, and a nested site's range comes before its caller's). Filled
    by the sites, read by ``start_*``. Every access is on the scheduler thread (sites and
    ``start_*`` run there), so there is no lock."""

    def __init__(self, local: Any, operations: Any = None) -> None:
        self.local = local  # the adapter's transfers._Capture: .cause and .request, the current sites'
        self.operations = operations  # the class numbering the ops (.counter, op.id); None: SGLang's
        self.by_controller: dict[int, tuple[list[int], list[tuple[int, str, Any]]]] = {}

    def _counter(self) -> Any:
        if self.operations is None:
            self.operations = _cache_operation()
            if self.operations is None:
                warn_once("cause:counter", "otel-hicache: SGLang's CacheOperation.counter is missing; queued ops "
                          "are counted as 'other'")
                self.operations = _NoCounter
        return self.operations

    def request_site(self, site: RequestSite) -> Method:
        """The wrapper of one request site: the request is the current one during the call."""
        local = self.local
        position, name = site.position, site.name

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def request_site(instance: Any, *args: Any, **kwargs: Any) -> Any:
                try:
                    context = request_context(args[position] if len(args) > position else kwargs.get(name))
                except Exception:  # pylint: disable=broad-except  # not linked, never into SGLang
                    context = None
                if context is None:
                    return original(instance, *args, **kwargs)
                outer = local.request
                local.request = context
                local.thread = get_ident()
                try:
                    return original(instance, *args, **kwargs)
                finally:
                    local.request = outer

            return request_site

        return Method(make)

    def site(self, site: Site) -> Method:
        """The wrapper of one cause site."""
        local = self.local
        fixed = site.cause if isinstance(site.cause, str) else None
        resolve = site.cause
        controller_of = site.controller
        made = self.made
        by_controller = self.by_controller

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            operations = self._counter()

            def cause_site(instance: Any, *args: Any, **kwargs: Any) -> Any:
                try:
                    cause = fixed or resolve(instance, controller_of(instance), args, kwargs)  # type: ignore[operator]
                except Exception as exc:  # pylint: disable=broad-except  # never into SGLang
                    warn_once(f"cause:{site.path}", "otel-hicache: cannot read the cause of %s (%r); its copies "
                              "are counted as 'other'", site.path, exc)
                    return original(instance, *args, **kwargs)
                first = operations.counter
                outer = local.cause
                local.cause = cause
                local.thread = get_ident()
                try:
                    return original(instance, *args, **kwargs)
                finally:
                    local.cause = outer
                    end = operations.counter
                    if end != first:  # most calls make no op (a declined load, a node backed up)
                        try:  # made(), inlined for the common case: a known controller, no request
                            ranges = by_controller.get(id(controller_of(instance)))
                            if ranges is None or local.request is not None or len(ranges[0]) >= MAX_ID_RANGES:
                                made(instance, controller_of, first, end, cause)
                            else:
                                ranges[0].append(end)
                                ranges[1].append((first, cause, None))
                        except Exception:  # pylint: disable=broad-except  # made() warns
                            made(instance, controller_of, first, end, cause)

            return cause_site

        return Method(make)

    def made(self, instance: Any, controller_of: Callable[[Any], Any], first: int, end: int, cause: str) -> None:
        """A site's call made the ops ``first <= id < end``: their cause (and request) for its controller."""
        try:
            key = id(controller_of(instance))
            ranges = self.by_controller.get(key)
            if ranges is None:
                ranges = self.by_controller[key] = ([], [])
            ends, entries = ranges
            if len(ends) >= MAX_ID_RANGES:  # ops that left without a start_* (reset()), or a controller never started
                del ends[:MAX_ID_RANGES // 2], entries[:MAX_ID_RANGES // 2]
            request = self.local.request
            if request is not None:
                request = self.local.current_request() if cause in REQUEST_CAUSES else None
            ends.append(end)
            entries.append((first, cause, request))
        except Exception as exc:  # pylint: disable=broad-except
            warn_once("cause:tag", "otel-hicache: cannot tag queued ops with their cause (%r); they are "
                      "counted as 'other'", exc)

    def take(self, controller: Any, queue: Any, other: Any) -> tuple[Any, list[Any] | None]:
        """In ``start_*``, before the original merges ``queue`` (``other``: the controller's
        other queue, whose ops wait on): the cause of its ops when they share one, else
        ``(ops, causes)``; and the trace contexts of the requests they were made for, or
        None. An op no site made has the current site's cause (``start_*`` called inside it),
        or None (``other``). Then the ranges no waiting op needs are dropped."""
        local = self.local
        current = local.cause  # current_cause(), inlined
        if current is not None and local.thread != get_ident():
            current = None
        ranges = self.by_controller.get(id(controller))
        if ranges is None or not ranges[0]:
            return current, None
        ends, entries = ranges
        count = len(ends)
        causes = []
        requests = None
        mixed = False
        first = None
        for op in queue:  # one op, or a few
            op_id = op.id
            i = bisect_right(ends, op_id)  # the first range ending after it, then outwards (nested sites)
            while i < count and entries[i][0] > op_id:
                i += 1
            if i < count:
                cause, request = entries[i][1], entries[i][2]
                if request is not None:
                    if requests is None:
                        requests = []
                    requests.append(request)
            else:
                cause = current or sc.CAUSE_OTHER
            causes.append(cause)
            if first is None:
                first = cause
            elif cause != first:
                mixed = True
        if other:
            drop = bisect_right(ends, min(op.id for op in other))  # ranges ending at or before the oldest waiting op
            del ends[:drop], entries[:drop]
        else:
            del ends[:], entries[:]
        if first is None:  # an empty queue
            return current, None
        return ((list(queue), causes) if mixed else first), requests


def parts(controller: Any, queued: tuple[list[Any], list[str]]) -> list[tuple[str, Any, int]]:
    """A mixed merged op's parts: each queued op's cause, tokens per pool and bytes, as
    SGLang computes them for the merged op (both add up over the ops it merges)."""
    return [(cause, controller._num_tokens_by_pool(op), controller._transfer_num_bytes(op))  # pylint: disable=protected-access
            for op, cause in zip(*queued)]
