"""Why each copy was made (``hicache.cause``), from where SGLang asked for it.

SGLang queues an op (``HiCacheController.write/load``) in one place and submits it
later, merged with others, in ``start_writing/start_loading``. So the cause is taken
where the op is *queued*: a wrapper on each SGLang method that asks for copies for
one reason (a *cause site*, :data:`SITES`) sets the thread's current cause for the
duration of the call. Every op is a ``CacheOperation`` numbered in creation order
(``CacheOperation.counter``, its ``id``): the site reads the counter before and after
the call, and a call that made ops logs its range of ids and its cause (nothing is
read from the queues; most calls make no op). ``start_*`` (see ``transfers.py``) hands
the otel-hicache worker that log and copies of the queues with the merged op
(``submit(cause=)`` as a deferred call); the worker finds each op in those ranges
(innermost site first): one cause for all of them is the merged op's cause; several are
reported as parts, each op's tokens and bytes computed with SGLang's own
``_num_tokens_by_pool``/``_transfer_num_bytes`` (which add up over merged ops), so bytes
and tokens per cause sum exactly to the totals. An op queued outside every site, or copied directly outside
one, is ``other``.

Requests (``REQUEST_SITES``): with SGLang's request tracing on (``--enable-trace``),
a wrapper on each SGLang method that handles one request sets the thread's current
request (its trace context, ``req.time_stats.trace_ctx.root_span_context``) for the
call, and the ops its cause sites queue, or the copies they make, are tagged with it
too: the span links to the requests (``otel_hicache.capture.request_links``). Only for the
causes that belong to one request (:data:`REQUEST_CAUSES`): a write-back during a
request's allocation wrote other requests' KV. The request sites are wrapped only in a
process whose SGLang tracing is on (``TransferObserver``); without it nothing is paid
but one attribute read per tagged call.

Nothing inspects the stack, and nothing is looked up on the scheduler thread: a site
costs one Python frame, two reads of the counter and the current cause set and restored
per call, and a tuple appended when it made ops; ``start_*`` copies the two queues
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
from . import registration as reg


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
        return reg.WRITE_BACK
    if getattr(controller, "write_policy", None) == "write_through_selective":
        return reg.WRITE_THROUGH_SELECTIVE
    return reg.WRITE_THROUGH


UNIFIED_RADIX_CACHE = "sglang.srt.mem_cache.unified_radix_cache"
BUFFER_PIPELINE = "sglang.srt.mem_cache.buffer_mode.pipeline"
DECODE_OFFLOAD = "sglang.srt.disaggregation.decode_kvcache_offload_manager"

SITES: dict[str, tuple[Site, ...]] = {
    # group name -> its sites (wrapped all or nothing, when the module is imported)
    "transfer causes": (
        Site(UNIFIED_RADIX_CACHE, "UnifiedRadixCache._execute_and_commit_kv_backup", backup_cause, _own_controller),
        Site(UNIFIED_RADIX_CACHE, "UnifiedRadixCache.load_back", reg.PREFIX_HIT, _own_controller),
        Site(UNIFIED_RADIX_CACHE, "UnifiedRadixCache.backup_kv_cache", reg.RETRACTION_BACKUP, _own_controller),
        Site(UNIFIED_RADIX_CACHE, "UnifiedRadixCache.restore_kv_cache", reg.RETRACTION_RESTORE,
             _own_controller),
    ),
    "transfer causes: buffer-only host mode": (
        Site(BUFFER_PIPELINE, "BufferModePipeline._stage_backup_intent", reg.STORAGE_BACKUP,
             _pipeline_controller),
        Site(BUFFER_PIPELINE, "BufferModePipeline._allocate_and_queue_load_back", reg.STORAGE_PREFETCH,
             _pipeline_controller),
    ),
    "transfer causes: decode offload": (
        Site(DECODE_OFFLOAD, "DecodeKVCacheOffloadManager.offload_kv_cache", reg.DECODE_OFFLOAD,
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
    reg.WRITE_THROUGH, reg.WRITE_THROUGH_SELECTIVE, reg.PREFIX_HIT, reg.DECODE_OFFLOAD,
    reg.RETRACTION_BACKUP, reg.RETRACTION_RESTORE,
))
"""The causes whose copies belong to the request of their site: linked to it."""


_NO_ATTRIBUTES: dict[str, Any] = {}

MAX_ID_RANGES = 4096
"""Id ranges kept per controller at most. Each merged op's resolution drops those that no
op still waiting in the controller's queues needs (ops dropped by ``reset()`` included);
beyond this many (ops waiting that long), the oldest half go, warned once."""

MAX_LOG = 16384
"""Site calls that made ops logged at most between two merged ops (the log is handed over
with each); later ones are not logged, warned once."""


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
    answers every missing attribute with itself, after an AttributeError, which is slow."""
    trace_ctx = getattr(getattr(req, "time_stats", None), "trace_ctx", None)
    context = getattr(trace_ctx, "__dict__", _NO_ATTRIBUTES).get("root_span_context")
    return context if isinstance(context, dict) else None  # an OTel Context is a dict


class QueuedCauses:
    """The causes (and requests) of the ops each controller has queued, as ranges of op ids.

    Split across two threads so that the scheduler thread only records. A site's call that
    made ops appends ``(controller_of, instance, first id, end id, cause, request)`` to
    :attr:`log`. Each merged op's ``start_*`` copies the queues before SGLang merges them
    (what :meth:`pending` does) and, when it submits the op, hands the worker the log so far
    with them, a deferred call to :meth:`resolve` (:meth:`hand_over`): the log's entries
    travel with the op they came before, in submission order, so a worker behind by any
    number of ops loses none. There :meth:`resolve` sorts them into ``by_controller``:
    ``id(controller) -> (ends, entries)``, ``entries[i] = (first id, cause, request)`` of
    the ops ``first <= id < ends[i]`` made by one site's call, in the order the calls
    returned (so ``ends`` never decreases, and a nested site's range comes before its
    caller's), finds each merged op in them and drops the ranges no waiting op needs.
    ``log`` is the scheduler thread's, ``by_controller`` the worker's."""

    def __init__(self, local: Any, operations: Any = None) -> None:
        self.local = local  # the adapter's transfers._Capture: .cause and .request, the current sites'
        self.operations = operations  # the class numbering the ops (.counter, op.id); None: SGLang's
        self.log: list[tuple[Callable[[Any], Any], Any, int, int, str, Any]] = []
        # A log was handed over: from then on every merged op goes to the worker, which may
        # hold ranges of ops still queued (a plain flag: the worker never writes it).
        self.handed = False
        self.linking = False  # request sites are wrapped: start_* asks for the requests too
        self.by_controller: dict[int, tuple[list[int], list[tuple[int, str, Any]]]] = {}
        self._last: tuple[list[Any], Any] | None = None  # resolve()'s last ops and answer

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
            self.linking = True

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
        queued = self

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
                        log = queued.log
                        if len(log) < MAX_LOG:
                            log.append((controller_of, instance, first, end, cause, local.request))
                        else:  # no merged op for that long (reset()s only, or no start_* wrapped)
                            warn_once("cause:log", "otel-hicache: %d cause-site calls made ops and no merged op "
                                      "followed; the ops of later ones are counted as 'other'", MAX_LOG)

            return cause_site

        return Method(make)

    def pending(self, controller: Any, queue: list[Any], other: list[Any]) -> tuple[Any, list[Any] | None]:
        """What ``start_*`` (``transfers.py``, which inlines it: a frame is a tenth of its
        cost) passes to ``submit()`` as ``(cause, requests)``: the current site's cause
        (``start_*`` called inside one) or None while no site has made an op; else the
        deferred call of :meth:`hand_over`, with copies of ``queue`` (the one SGLang merges)
        and ``other`` (the controller's other queue, whose ops wait on) as they are before the
        merge, and ``requests``, the list it fills (request sites)."""
        local = self.local
        current = local.cause  # current_cause(), inlined
        if current is not None and local.thread != get_ident():
            current = None
        if not (self.log or self.handed):
            return current, None
        requests: list[Any] | None = [] if self.linking else None
        return self.hand_over(controller, list(queue), list(other) if other else None, self.operations.counter,
                              current, requests), requests

    def hand_over(self, controller: Any, ops: list[Any], waiting: list[Any] | None, counter: int,
                  current: str | None, requests: list[Any] | None) -> tuple[Any, ...]:
        """As a merged op is submitted: ``submit(cause=)``, the deferred call that resolves it
        on the worker with the log so far (a tuple, not a ``partial``: cheaper to build). Only then,
        so a ``start_*`` that submits nothing (an empty queue, a copy with no ack) hands over
        nothing. ``counter``: SGLang's op counter before the merge."""
        logged = self.log
        if logged:
            self.log = []
            self.handed = True
        else:
            logged = ()  # never the live list, which later sites append to
        return (self.resolve, controller, ops, waiting, counter, current, requests, logged)

    def resolve(self, controller: Any, ops: list[Any], waiting: list[Any] | None, counter: int,
                current: str | None, requests: list[Any] | None, logged: list[Any]) -> Any:
        """On the worker, in submission order: sort ``logged`` in, then the cause of the merged
        op of ``ops`` (one cause, or its parts when they differ; an op no site made has
        ``current``, or ``other``), the trace contexts of the requests they were made for
        appended to ``requests``; then the ranges no op waiting (``waiting``, the other queue
        then) or made later (at or after ``counter``) needs are dropped. Called again for the
        same ``ops`` (a merged op of several copies, each submitted with it): the same answer."""
        last = self._last
        if last is not None and last[0] is ops:
            return last[1]
        self._sort_in(logged)
        cause = self._resolve(controller, ops, waiting, counter, current, requests)
        self._last = (ops, cause)
        return cause

    def _sort_in(self, logged: list[Any]) -> None:
        by_controller = self.by_controller
        for controller_of, instance, first, end, cause, request in logged:
            try:
                key = id(controller_of(instance))
            except Exception as exc:  # pylint: disable=broad-except
                warn_once("cause:tag", "otel-hicache: cannot tag queued ops with their cause (%r); they are "
                          "counted as 'other'", exc)
                continue
            ranges = by_controller.get(key)
            if ranges is None:
                ranges = by_controller[key] = ([], [])
            ends, entries = ranges
            if len(ends) >= MAX_ID_RANGES:  # ops waiting that long, or a controller never started
                warn_once("cause:ranges", "otel-hicache: %d id ranges of queued ops kept for one controller; the "
                          "oldest half are dropped (their ops are counted as 'other')", MAX_ID_RANGES)
                del ends[:MAX_ID_RANGES // 2], entries[:MAX_ID_RANGES // 2]
            ends.append(end)
            entries.append((first, cause, request if cause in REQUEST_CAUSES else None))

    def _resolve(self, controller: Any, ops: list[Any], waiting: list[Any] | None, counter: int,
                 current: str | None, requests: list[Any] | None) -> Any:
        ranges = self.by_controller.get(id(controller))
        if ranges is None or not ranges[0] or not ops:
            return current
        ends, entries = ranges
        count = len(ends)
        causes = []
        first_cause = None
        mixed = False
        for op in ops:  # one op, or a few
            op_id = op.id
            i = bisect_right(ends, op_id)  # the first range ending after it, then outwards (nested sites)
            while i < count and entries[i][0] > op_id:
                i += 1
            if i < count:
                cause, request = entries[i][1], entries[i][2]
                if request is not None and requests is not None:
                    requests.append(request)
            else:
                cause = current or sc.CAUSE_OTHER
            causes.append(cause)
            if first_cause is None:
                first_cause = cause
            elif cause != first_cause:
                mixed = True
        # Every op made before start_* was merged then, waited in the other queue, or was dropped
        # (reset()): a range ending at or before the oldest waiting one is done with. Ranges
        # sorted in later (sites still running then, or later) end after ``counter``.
        bound = counter
        if waiting:
            bound = min(bound, min(op.id for op in waiting))
        drop = bisect_right(ends, bound)
        del ends[:drop], entries[:drop]
        return parts(controller, ops, causes) if mixed else first_cause


def parts(controller: Any, ops: list[Any], causes: list[str]) -> list[tuple[str, Any, int]]:
    """A mixed merged op's parts: each queued op's cause, tokens per pool and bytes, as
    SGLang computes them for the merged op (both add up over the ops it merges)."""
    return [(cause, controller._num_tokens_by_pool(op), controller._transfer_num_bytes(op))  # pylint: disable=protected-access
            for op, cause in zip(ops, causes)]
