"""Why each copy was made (``hicache.cause``), from where SGLang asked for it.

SGLang queues an op (``HiCacheController.write/load``) in one place and submits it
later, merged with others, in ``start_writing/start_loading``. So the cause is taken
where the op is *queued*: a wrapper on each SGLang method that asks for copies for
one reason (a *cause site*, :data:`SITES`) sets the thread's current cause for the
duration of the call, and when the call returns, tags the ops it appended to its
controller's ``write_queue``/``load_queue`` with it. ``start_*`` (see
``transfers.py``) reads the tags of the ops it merges: one cause for all of them is
the merged op's cause; several are reported as parts, each op's tokens and bytes
computed with SGLang's own ``_num_tokens_by_pool``/``_transfer_num_bytes`` (which
add up over merged ops), so bytes and tokens per cause sum exactly to the totals.
An op queued outside every site, or copied directly outside one, is ``other``.

Requests (``REQUEST_SITES``): with SGLang's request tracing on (``--enable-trace``),
a wrapper on each SGLang method that handles one request sets the thread's current
request (its trace context, ``req.time_stats.trace_ctx.root_span_context``) for the
call, and the ops its cause sites queue, or the copies they make, are tagged with it
too: the span links to the requests (``otel_hicache.request_links``). Only for the
causes that belong to one request (:data:`REQUEST_CAUSES`): a write-back during a
request's allocation wrote other requests' KV. The request sites are wrapped only in a
process whose SGLang tracing is on (``TransferObserver``); without it nothing is paid
but one attribute read per tagged call.

Nothing inspects the stack: a site costs one Python frame, two queue lengths and
the current cause set and restored per call (``docs/performance.md``).
"""

from __future__ import annotations

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


def _own_controller(instance: Any) -> Any:
    return instance.cache_controller


def _pipeline_controller(pipeline: Any) -> Any:
    return pipeline._cache.cache_controller  # pylint: disable=protected-access  # BufferModePipeline's cache


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


def request_context(req: Any) -> Any:
    """A traced SGLang request's trace context (its root span's), else None. Read from the
    trace context's own ``__dict__``: SGLang's ``TraceNullContext`` (an untraced request)
    answers every missing attribute with itself, after an AttributeError (~1.5 us)."""
    trace_ctx = getattr(getattr(req, "time_stats", None), "trace_ctx", None)
    context = getattr(trace_ctx, "__dict__", _NO_ATTRIBUTES).get("root_span_context")
    return context if isinstance(context, dict) else None  # an OTel Context is a dict


class QueuedCauses:
    """The causes of the ops waiting in each controller queue: ``id(queue) -> {id(op):
    (op, cause)}``, filled by the sites, taken by ``start_*``. Every access is on the
    scheduler thread (sites and ``start_*`` run there), so there is no lock."""

    def __init__(self, local: Any) -> None:
        self.local = local  # the adapter's transfers._Capture: .cause and .request, the current sites'
        self.by_queue: dict[int, dict[int, tuple[Any, str]]] = {}
        # id(queue) -> {id(op): (op, request trace context)}: only with request sites wrapped
        self.requests: dict[int, dict[int, tuple[Any, Any]]] = {}

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
        tag = self.tag
        local = self.local
        fixed = site.cause if isinstance(site.cause, str) else None
        resolve = site.cause
        controller_of = site.controller

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def cause_site(instance: Any, *args: Any, **kwargs: Any) -> Any:
                try:
                    controller = controller_of(instance)
                    cause = fixed or resolve(instance, controller, args, kwargs)  # type: ignore[operator]
                    writes, loads = controller.write_queue, controller.load_queue
                    queued_writes, queued_loads = len(writes), len(loads)
                    first_write = writes[0] if queued_writes else None
                    first_load = loads[0] if queued_loads else None
                except Exception as exc:  # pylint: disable=broad-except  # never into SGLang
                    warn_once(f"cause:{site.path}", "otel-hicache: cannot read the cause of %s (%r); its copies "
                              "are counted as 'other'", site.path, exc)
                    return original(instance, *args, **kwargs)
                outer = local.cause
                local.cause = cause
                local.thread = get_ident()
                try:
                    return original(instance, *args, **kwargs)
                finally:
                    local.cause = outer
                    # most calls queue nothing (a declined load, a node already backed up)
                    if len(writes) != queued_writes:
                        tag(writes, queued_writes, first_write, cause)
                    if len(loads) != queued_loads:
                        tag(loads, queued_loads, first_load, cause)

            return cause_site

        return Method(make)

    def tag(self, queue: Any, length: int, first: Any, cause: str) -> None:
        """Tag the ops a site's call appended to ``queue`` (``length`` long at entry, ``first``
        its first op then): those after ``length`` if the queue still starts with ``first``,
        else (empty then, or consumed by a ``start_*`` meanwhile) every op in it. Ops already
        tagged (by a site nested inside) keep their tag."""
        try:
            if not queue:
                return
            appended = queue[length if length and queue[0] is first else 0:]
            _tag_ops(self.by_queue, queue, appended, cause)
            if self.local.request is not None and cause in REQUEST_CAUSES:
                request = self.local.current_request()
                if request is not None:
                    _tag_ops(self.requests, queue, appended, request)
        except Exception as exc:  # pylint: disable=broad-except
            warn_once("cause:tag", "otel-hicache: cannot tag queued ops with their cause (%r); they are "
                      "counted as 'other'", exc)

    def take_requests(self, queue: Any) -> list[Any] | None:
        """In ``start_*``: the trace contexts of the requests the ops in ``queue`` were tagged
        with, or None. Not the current request: a ``start_*`` inside a request site merges
        ops of other causes too (a write-back during a load-back)."""
        tags = self.requests.pop(id(queue), None)
        if not tags:
            return None
        found = []
        for op in queue:
            entry = tags.get(id(op))
            if entry is not None and entry[0] is op:
                found.append(entry[1])
        return found or None

    def take(self, queue: Any) -> str | tuple[list[Any], list[str]] | None:
        """In ``start_*``, before the original merges ``queue``: the cause of its ops when
        they share one, else ``(ops, causes)``. An op no site tagged has the current
        site's cause (``start_*`` called inside it), or None (``other``)."""
        tags = self.by_queue.pop(id(queue), None) if self.by_queue else None
        if tags is None:  # nothing tagged (a controller driven by hand, or ops queued inside this site)
            return self.local.current_cause()
        causes = []
        mixed = False
        first = None
        for op in queue:  # one op, or a few: the common case is one cause, no list kept
            entry = tags.get(id(op))
            if entry is not None and entry[0] is op:
                cause = entry[1]
            else:
                cause = self.local.current_cause() or sc.CAUSE_OTHER
            causes.append(cause)
            if first is None:
                first = cause
            elif cause != first:
                mixed = True
        if first is None:  # an empty queue
            return self.local.current_cause()
        return (list(queue), causes) if mixed else first


def _tag_ops(store: dict[int, dict[int, tuple[Any, Any]]], queue: Any, ops: list[Any], value: Any) -> None:
    """Tag ``ops`` of ``queue`` with ``value`` in ``store`` (``id(queue) -> {id(op): (op, value)}``);
    an op already tagged (by a site nested inside) keeps its tag. A queue's tags are pruned of
    ops that left it without a ``start_*`` (``reset()``) once they outnumber the queue."""
    tags = store.get(id(queue))
    if tags is None:
        tags = store[id(queue)] = {}
    elif len(tags) > 2 * len(queue) + 64:
        live = {id(op) for op in queue}
        for key in [k for k in tags if k not in live]:
            del tags[key]
    for op in ops:
        entry = tags.get(id(op))
        if entry is None or entry[0] is not op:
            tags[id(op)] = (op, value)


def parts(controller: Any, queued: tuple[list[Any], list[str]]) -> list[tuple[str, Any, int]]:
    """A mixed merged op's parts: each queued op's cause, tokens per pool and bytes, as
    SGLang computes them for the merged op (both add up over the ops it merges)."""
    return [(cause, controller._num_tokens_by_pool(op), controller._transfer_num_bytes(op))  # pylint: disable=protected-access
            for op, cause in zip(*queued)]
