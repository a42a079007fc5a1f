"""Run SGLang's real HiCache device<->host KV transfer code on a CPU-only machine.

The tests of the SGLang instrumentation use this module to exercise the genuine
SGLang objects (the cache stack: 0.5.22 and later; the engine level: every tested release) -- ``HiCacheController`` / ``HybridCacheController``,
``L2TransferEngine``, ``MHATokenToKVPool``, ``TokenToKVPoolAllocator``, the host
pools, ``UnifiedRadixCache`` with its tree core, ``HiCacheAck`` and SGLang's own
``RadixCacheMetricsCollector`` -- without a GPU.

Two CPU-only substitutions make that possible (:func:`install_cpu_support`);
torch and torchvision are PyPI's CUDA builds, which run on the CPU:

* ``pool_host.common.ALLOC_MEMORY_FUNCS["cpu"]`` allocates host KV unpinned
  (the default path registers the memory with the CUDA runtime);
* ``pool_host.mha.transfer_kv_direct`` becomes a pure-torch
  ``index_select``/``index_copy_`` (the real one is an ``sgl_kernel`` CUDA op).
  It covers ``io_backend="direct"`` with the ``layer_first`` layout only.

On CPU SGLang's device module is ``torch.cpu``: its ``Event`` takes no timing
argument, so every ``HiCacheAck`` / ``TransferCompletion`` reports
``timing_enabled=False``, events are no-ops and the copies run synchronously.

The scenario functions return plain dicts describing the transfers they caused,
so a test can compare them with what the instrumentation recorded and with
SGLang's own ``sglang:*_total`` Prometheus counters (:func:`sglang_counter_values`).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import sys
import threading
import warnings
from array import array
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

__all__ = [
    "CacheStack",
    "build_controller",
    "build_stack",
    "controller_round_trip",
    "decode_retraction",
    "host_eviction",
    "insert_sequence",
    "install_cpu_support",
    "request_tracing",
    "traced_request",
    "checkpoint_request",
    "load_back_request",
    "traced_round_trip",
    "sglang_counter",
    "sglang_counter_values",
    "unbacked_eviction_drop",
    "write_back_eviction",
    "write_through_round_trip",
]

#: Labels every ``RadixCacheMetricsCollector`` series carries; they identify the
#: collector, not the event, so :func:`sglang_counter_values` leaves them out.
COLLECTOR_LABELS = {"cache_type": "UnifiedRadixCache", "tp_rank": 0, "pp_rank": 0, "dp_rank": 0}

HEAD_NUM = 2
HEAD_DIM = 8


# --------------------------------------------------------------------------
# CPU support
# --------------------------------------------------------------------------
def _alloc_unpinned(dims, dtype, device, pin_memory, allocator,
                    registration_granularity_bytes=None):
    """``ALLOC_MEMORY_FUNCS["cpu"]``: plain host memory, no CUDA host registration."""
    return allocator.allocate(dims, dtype=dtype, device=device)


def _transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """Pure-torch stand-in for ``sgl_kernel.kvcacheio.transfer_kv_direct``."""
    import torch

    assert len(src_layers) == len(dst_layers)
    assert src_indices.numel() == dst_indices.numel()
    for src, dst in zip(src_layers, dst_layers):
        src_idx = src_indices.to(src.device, torch.int64)
        dst_idx = dst_indices.to(dst.device, torch.int64)
        dst.index_copy_(0, dst_idx, src.index_select(0, src_idx).to(dst.device))


#: The SGLang modules the builders below use. Importing them pulls in most of
#: ``sglang.srt``, whose import emits CUDA-only ``UserWarning``s on CPU
#: (AWQ/GGUF quantization, ``requests``' charset detection).
_SGLANG_MODULES = (
    "sglang.srt.mem_cache.pool_host.common",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.server_args",
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.allocator",
    "sglang.srt.mem_cache.cache_init_params",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler",
    "sglang.srt.mem_cache.unified_cache.components.base",
    "sglang.srt.mem_cache.unified_radix_cache",
    "sglang.srt.observability.metrics_collector",
)


def install_cpu_support() -> None:
    """Make SGLang's HiCache code runnable on CPU. Idempotent.

    Imports the SGLang modules this file uses (with their import-time warnings
    silenced) and patches the host-pool allocation and the direct KV copy.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in _SGLANG_MODULES:
            importlib.import_module(name)
    host_common = sys.modules["sglang.srt.mem_cache.pool_host.common"]
    host_mha = sys.modules["sglang.srt.mem_cache.pool_host.mha"]
    host_common.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_unpinned
    host_mha.transfer_kv_direct = _transfer_kv_direct
    # l2_transfer logs once that torch.cpu.Event cannot time; pool_host.base warns
    # when the host pool is smaller than the device pool (unbacked_eviction_drop).
    logging.getLogger("sglang.srt.mem_cache.l2_transfer").setLevel(logging.ERROR)
    logging.getLogger("sglang.srt.mem_cache.pool_host.base").setLevel(logging.ERROR)


PARALLEL_ARGS: Dict[str, Any] = {}
"""Server arguments of the process's parallel topology (``tp_size``, ``dp_size``, ...), in
every ``ServerArgs`` published here: a scheduler rank publishes its ranks once
(``runtime_context.publish(..., ranks=...)``), and a later publish must keep the topology
they belong to. Set by a scheduler-like child (``sglang_child.scheduler_rank``)."""


def _publish_server_args(**fields: Any):
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    server_args = ServerArgs(model_path="dummy", **{**PARALLEL_ARGS, **fields})
    set_global_server_args_for_scheduler(server_args)
    return server_args


def _fill_random(kv, indices) -> None:
    import torch

    n = len(indices)
    for layer in range(kv.layer_num):
        kv.k_buffer[layer][indices] = torch.randn(n, HEAD_NUM, HEAD_DIM).to(kv.dtype)
        kv.v_buffer[layer][indices] = torch.randn(n, HEAD_NUM, HEAD_DIM).to(kv.dtype)


# --------------------------------------------------------------------------
# Stacks
# --------------------------------------------------------------------------
@dataclass
class CacheStack:
    """A real ``UnifiedRadixCache`` with HiCache and the pools under it."""

    cache: Any            # UnifiedRadixCache
    controller: Any       # cache.cache_controller (HybridCacheController)
    allocator: Any        # TokenToKVPoolAllocator
    kv: Any               # MHATokenToKVPool (the device pool)
    req_to_token: Any     # ReqToTokenPool
    policy: str = "write_through"

    @property
    def host_pool(self) -> Any:
        """The host pool group the controller writes to."""
        return self.controller.mem_pool_host


_metrics_collector = None


def _shared_metrics_collector():
    """SGLang's own collector; created once, the Prometheus registry is global."""
    global _metrics_collector
    if _metrics_collector is None:
        from sglang.srt.observability.metrics_collector import RadixCacheMetricsCollector

        _metrics_collector = RadixCacheMetricsCollector(labels=dict(COLLECTOR_LABELS))
    return _metrics_collector


def _device_pool(kv_size: int, page_size: int, layers: int, dtype: Any) -> tuple[Any, Any]:
    """SGLang's real MHA device KV pool on CPU and its token allocator."""
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    kv = MHATokenToKVPool(size=kv_size, page_size=page_size, dtype=dtype, head_num=HEAD_NUM,
                          head_dim=HEAD_DIM, layer_num=layers, device="cpu", enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(size=kv_size, dtype=dtype, device="cpu", kvcache=kv, need_sort=False)
    return kv, allocator


def build_stack(policy: str = "write_through", page_size: int = 4, layers: int = 3,
                kv_size: int = 64, host_ratio: float = 2.0,
                tree_core_backend: Optional[str] = None) -> CacheStack:
    """Build ``UnifiedRadixCache`` + ``init_hicache`` the way the scheduler does.

    bfloat16 MHA device pool (``head_num=2, head_dim=8``), ``io_backend="direct"``,
    ``layer_first`` host layout, write policy ``policy``. ``host_ratio`` is
    ``--hicache-ratio`` (host pool size relative to the device pool).
    SGLang's ``RadixCacheMetricsCollector`` is attached before ``init_hicache``,
    as in production, so the dropped-token series are pre-seeded.
    ``tree_core_backend`` selects SGLang's TreeCore (``"python"`` or ``"rust"``);
    None keeps SGLang's default (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``).
    """
    install_cpu_support()
    import torch
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    _publish_server_args(page_size=page_size)
    req_to_token = ReqToTokenPool(size=4, max_context_len=128, device="cpu",
                                  enable_memory_saver=False)
    kv, allocator = _device_pool(kv_size, page_size, layers, torch.bfloat16)
    params = CacheInitParams(req_to_token_pool=req_to_token,
                             token_to_kv_pool_allocator=allocator, page_size=page_size,
                             disable=False, tree_components=(ComponentType.FULL,),
                             tree_core_backend=tree_core_backend)
    cache = UnifiedRadixCache(params=params)
    cache.metrics_collector = _shared_metrics_collector()
    server_args = _publish_server_args(
        page_size=page_size, hicache_io_backend="direct", hicache_mem_layout="layer_first",
        hicache_write_policy=policy, hicache_ratio=host_ratio)
    cache.init_hicache(server_args, params)
    atexit.unregister(cache.shutdown)
    return CacheStack(cache=cache, controller=cache.cache_controller, allocator=allocator,
                      kv=kv, req_to_token=req_to_token, policy=policy)


def build_controller(page_size: int = 4, layers: int = 3, kv_size: int = 64):
    """Engine level: a bare ``HiCacheController`` over float16 pools.

    Returns ``(controller, kv, allocator)``; ``controller.write(indices, node_id=...)``
    submits at once (``start_writing``), ``controller.load`` queues until
    ``controller.start_loading()``. Acks land in ``ack_write_queue`` /
    ``ack_load_queue``.
    """
    install_cpu_support()
    import torch
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool

    _publish_server_args(page_size=page_size, hicache_io_backend="direct",
                         hicache_mem_layout="layer_first", hicache_ratio=2.0,
                         enable_hierarchical_cache=True)
    kv, allocator = _device_pool(kv_size, page_size, layers, torch.float16)
    host = build_kv_host_pool(kv_pool=kv, page_size=page_size, use_mla=False)
    controller = HiCacheController(
        token_to_kv_pool_allocator=allocator, mem_pool_host=host, page_size=page_size,
        tp_group=None, load_cache_event=threading.Event(), io_backend="direct",
        write_policy="write_through")
    return controller, kv, allocator


def controller_round_trip(controller, kv, allocator, n: int = 8, write_node_id: int = 7,
                          load_node_id: int = 8) -> Dict[str, Any]:
    """Engine-level write then load of ``n`` tokens; bit-exact. Two acks, whose
    ``node_ids`` are ``[write_node_id]`` and ``[load_node_id]``."""
    import torch

    device_indices = allocator.alloc(n)
    _fill_random(kv, device_indices)
    host_indices = controller.write(device_indices, node_id=write_node_id)
    write_ack = controller.ack_write_queue.pop(0)
    write_ack.finish_event.synchronize()
    loaded = controller.load(host_indices, node_id=load_node_id)
    controller.start_loading()
    load_ack = controller.ack_load_queue.pop(0)
    load_ack.finish_event.synchronize()
    for layer in range(kv.layer_num):
        assert torch.equal(kv.k_buffer[layer][loaded], kv.k_buffer[layer][device_indices])
        assert torch.equal(kv.v_buffer[layer][loaded], kv.v_buffer[layer][device_indices])
    return {"offload_tokens": write_ack.num_tokens, "offload_bytes": write_ack.num_bytes,
            "onboard_tokens": load_ack.num_tokens, "onboard_bytes": load_ack.num_bytes,
            "write_ack": write_ack, "load_ack": load_ack}


# --------------------------------------------------------------------------
# Scenarios on a UnifiedRadixCache stack
# --------------------------------------------------------------------------
def _radix_key(tokens: List[int]):
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens))


def insert_sequence(stack: CacheStack, start: int, n: int
                    ) -> Tuple[List[int], List[Any], Callable[[], Any]]:
    """Allocate ``n`` device slots with random KV and insert tokens ``start..start+n``.

    Returns ``(tokens, reference_k_per_layer, match)`` where ``match()`` runs
    ``cache.match_prefix`` for the same key. Under write_through the insert
    queues a backup (``controller.write(..., flush=False)``) without submitting it.
    """
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams

    tokens = list(range(start, start + n))
    value = stack.allocator.alloc(n)
    assert value is not None, "device pool exhausted"
    _fill_random(stack.kv, value)
    reference = [stack.kv.k_buffer[layer][value].clone() for layer in range(stack.kv.layer_num)]
    stack.cache.insert(InsertParams(key=_radix_key(tokens), value=value))
    key = _radix_key(tokens)
    return tokens, reference, lambda: stack.cache.match_prefix(MatchPrefixParams(key=key))


def _evict_device(stack: CacheStack, num_tokens: int) -> int:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    return stack.cache.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted


def _device_kv_matches(stack: CacheStack, match_result, reference) -> bool:
    import torch

    indices = stack.cache.path_device_indices(match_result.last_device_node)
    return all(torch.equal(stack.kv.k_buffer[layer][indices], reference[layer])
               for layer in range(stack.kv.layer_num))


def write_through_round_trip(stack: CacheStack, n: int = 12, start: int = 100) -> Dict[str, Any]:
    """Insert, back up, evict from device, load back from host; KV bit-exact.

    One merged D2H op (``flush_pending_backups`` -> ``start_writing``) and one
    merged H2D op (``ready_to_load_host_cache`` -> ``start_loading``); each
    ack is consumed by ``check_hicache_events``.
    """
    cache, controller = stack.cache, stack.controller
    assert controller.write_policy == "write_through"
    tokens, reference, match = insert_sequence(stack, start, n)
    queued_writes = len(controller.write_queue)
    cache.flush_pending_backups()
    write_acks = list(controller.ack_write_queue)
    cache.check_hicache_events()
    assert not controller.ack_write_queue, "write ack not consumed"

    evicted = _evict_device(stack, n)
    hit = match()
    assert hit.device_prefix_len == 0 and hit.host_hit_length == n, hit
    assert cache.load_back(hit.best_match_node)
    queued_loads = len(controller.load_queue)
    cache.ready_to_load_host_cache()
    load_acks = list(controller.ack_load_queue)
    cache.check_hicache_events()
    assert not controller.ack_load_queue, "load ack not consumed"

    hit = match()
    assert hit.device_prefix_len == n, hit
    assert _device_kv_matches(stack, hit, reference), "KV changed across the round trip"
    assert len(write_acks) == 1 and len(load_acks) == 1
    return {
        "tokens": n,
        "queued_writes": queued_writes,
        "queued_loads": queued_loads,
        "offload_tokens": sum(a.num_tokens for a in write_acks),
        "offload_bytes": sum(a.num_bytes for a in write_acks),
        "onboard_tokens": sum(a.num_tokens for a in load_acks),
        "onboard_bytes": sum(a.num_bytes for a in load_acks),
        "merged_offloads": len(write_acks),
        "merged_onboards": len(load_acks),
        "device_evicted_tokens": evicted,
        "bit_exact": True,
    }


def selective_write_through(stack: CacheStack, n: int = 12, start: int = 300) -> Dict[str, Any]:
    """write_through_selective: a node is backed up on its second hit
    (``write_through_threshold`` 2), not on its first insert. Inserts ``n`` tokens
    (nothing queued), matches and inserts them again (one op queued), flushes and
    consumes the ack."""
    cache, controller = stack.cache, stack.controller
    assert controller.write_policy == "write_through_selective"
    _, _, match = insert_sequence(stack, start, n)
    queued_first = len(controller.write_queue)
    match()
    insert_sequence(stack, start, n)
    queued_second = len(controller.write_queue)
    cache.flush_pending_backups()
    write_acks = list(controller.ack_write_queue)
    cache.check_hicache_events()
    assert not controller.ack_write_queue, "write ack not consumed"
    return {"queued_after_first_insert": queued_first, "queued_after_second_insert": queued_second,
            "offload_tokens": sum(a.num_tokens for a in write_acks),
            "offload_bytes": sum(a.num_bytes for a in write_acks), "merged_offloads": len(write_acks)}


def write_back_eviction(stack: CacheStack, n: int = 8, start: int = 500,
                        load_back: bool = False) -> Dict[str, Any]:
    """write_back: the insert queues nothing; evicting the node from the device
    backs it up first (``writing_check(write_back=True)``: submit one op, wait,
    consume its ack), leaving a host-only copy. With ``load_back`` the copy is
    then loaded back (one more merged op) and compared bit for bit; that needs
    ``n >= cache.load_back_threshold`` (10): smaller loads are declined.
    """
    cache, controller = stack.cache, stack.controller
    assert controller.write_policy == "write_back"
    tokens, reference, match = insert_sequence(stack, start, n)
    assert not controller.write_queue, "write_back must not back up on insert"
    host_free_before = controller.mem_pool_host.available_size()
    evicted = _evict_device(stack, n)
    offloaded = host_free_before - controller.mem_pool_host.available_size()
    assert not controller.ack_write_queue, "the blocking flush consumes its ack"
    hit = match()
    assert hit.device_prefix_len == 0 and hit.host_hit_length == n, hit
    result = {"tokens": n, "offload_tokens": offloaded, "merged_offloads": 1,
              "device_evicted_tokens": evicted, "host_hit_length": hit.host_hit_length}
    if load_back:
        assert n >= cache.load_back_threshold, "load_back declines loads under 10 tokens"
        assert cache.load_back(hit.best_match_node)
        cache.ready_to_load_host_cache()
        load_acks = list(controller.ack_load_queue)
        cache.check_hicache_events()
        hit = match()
        assert hit.device_prefix_len == n, hit
        assert _device_kv_matches(stack, hit, reference), "KV changed across write_back"
        result.update(onboard_tokens=sum(a.num_tokens for a in load_acks),
                      merged_onboards=len(load_acks), bit_exact=True)
    return result


def decode_retraction(stack: CacheStack, n: int = 8, req_pool_idx: int = 0,
                      req: Any = None) -> Dict[str, Any]:
    """Decode retraction with ``backup_kv_cache`` / ``restore_kv_cache``.

    These call ``L2TransferEngine.submit_device_to_host`` / ``submit_host_to_device``
    directly: no ``HiCacheAck``, nothing in SGLang's counters. A request of
    ``seqlen`` tokens backs up ``seqlen - 1`` tokens (the last token's KV is not
    yet computed), padded up to a page: the copy moves that many slots.
    ``req`` is the retracted request (for example a real ``schedule_batch.Req``
    of ``n`` tokens); by default a stand-in with ``rid``, ``seqlen`` and ``kv``.
    """
    import torch
    from sglang.srt.utils.common import ceil_align

    cache, kv, controller = stack.cache, stack.kv, stack.controller
    assert cache.supports_retraction_backup()
    device_indices = stack.allocator.alloc(n)
    stack.req_to_token.req_to_token[req_pool_idx, :n] = device_indices.to(
        stack.req_to_token.req_to_token.dtype)
    _fill_random(kv, device_indices)
    logical = n - 1
    before = [kv.k_buffer[layer][device_indices[:logical]].clone()
              for layer in range(kv.layer_num)]
    if req is None:
        req = SimpleNamespace(rid="retracted-0", seqlen=n,
                              kv=SimpleNamespace(req_pool_idx=req_pool_idx))
    else:
        assert req.seqlen == n, (req.seqlen, n)
        req.kv.req_pool_idx = req_pool_idx
    acks_before = (len(controller.ack_write_queue), len(controller.ack_load_queue))
    host_free_before = controller.mem_pool_host.available_size()
    backup = cache.backup_kv_cache(req)
    assert backup is not None, "host pool full"
    copied = len(backup.host_indices)
    for layer in range(kv.layer_num):
        kv.k_buffer[layer][device_indices] = 0
    cache.restore_kv_cache(req, backup)
    assert all(torch.equal(kv.k_buffer[layer][device_indices[:logical]], before[layer])
               for layer in range(kv.layer_num)), "retraction round trip not bit-exact"
    assert (len(controller.ack_write_queue), len(controller.ack_load_queue)) == acks_before
    assert controller.mem_pool_host.available_size() == host_free_before
    stack.allocator.free(device_indices)
    assert copied == ceil_align(logical, cache.page_size)
    return {"seqlen": n, "logical_tokens": logical,
            "direct_offload_tokens": copied, "direct_onboard_tokens": copied,
            "acks": 0, "bit_exact": True}


def unbacked_eviction_drop(stack: CacheStack, n: int = 8, start: int = 900) -> Dict[str, Any]:
    """write_through device eviction of a node that never got a host copy.

    Write-through backs a node up on its first insert, so a node is only
    unbacked when the host pool cannot take the copy. Here a first sequence's
    still-unsubmitted backup takes the whole free host pool (it stays device-
    resident and locked until acked, so ``evict_host`` cannot reclaim it); the
    next sequence's backup then fails, and evicting it from the device destroys
    its KV: SGLang counts ``sglang:hicache_dropped_tokens_total
    {reason="write_through_unbacked_eviction"}``. The pending backup is then
    submitted and acked (one merged op) so the stack is left consistent.

    Needs a stack whose free host pool fits in the free device pool, e.g.
    ``build_stack("write_through", host_ratio=0.25)``.
    """
    cache, controller = stack.cache, stack.controller
    assert controller.write_policy == "write_through"
    host_free = controller.mem_pool_host.available_size()
    device_free = stack.allocator.available_size()
    if host_free == 0 or host_free + n > device_free:
        raise ValueError(
            f"host pool has {host_free} free slots, device {device_free}: build the "
            "stack with a host pool smaller than the device pool (host_ratio=0.25)")
    filler, _, _ = insert_sequence(stack, start, host_free)
    assert controller.mem_pool_host.available_size() == 0
    queued_writes = len(controller.write_queue)
    tokens, _, match = insert_sequence(stack, start + host_free, n)
    assert len(controller.write_queue) == queued_writes, "victim unexpectedly backed up"
    evicted = _evict_device(stack, n)
    hit = match()
    assert hit.device_prefix_len == 0 and hit.host_hit_length == 0, hit

    cache.flush_pending_backups()
    write_acks = list(controller.ack_write_queue)
    cache.check_hicache_events()
    assert not controller.ack_write_queue
    return {"dropped_tokens": n, "device_evicted_tokens": evicted,
            "filler_tokens": host_free, "offload_tokens": sum(a.num_tokens for a in write_acks),
            "merged_offloads": len(write_acks)}


def host_eviction(stack: CacheStack, n: int = 12, start: int = 1300,
                  num_tokens: Optional[int] = None) -> Dict[str, Any]:
    """Free host copies with ``cache.evict_host`` (no transfer, no ack).

    Inserts and backs up ``n`` tokens (one merged write-through op), evicts
    every evictable token from the device so the host copies are host-only,
    then asks ``evict_host`` for ``num_tokens`` (default ``n``) host tokens.
    Host eviction frees whole least-recently-used host leaves, so on a stack
    with older host copies those go first, and it may free more than asked.
    """
    cache, controller = stack.cache, stack.controller
    assert controller.write_policy == "write_through"
    insert_sequence(stack, start, n)
    cache.flush_pending_backups()
    write_acks = list(controller.ack_write_queue)
    cache.check_hicache_events()
    device_evicted = _evict_device(stack, cache.evictable_size())
    assert cache.evictable_size() == 0
    requested = n if num_tokens is None else num_tokens
    host_free_before = controller.mem_pool_host.available_size()
    host_evicted = cache.evict_host(requested)
    freed = controller.mem_pool_host.available_size() - host_free_before
    assert host_evicted >= requested and freed == host_evicted, (host_evicted, freed)
    return {"tokens": n, "offload_tokens": sum(a.num_tokens for a in write_acks),
            "merged_offloads": len(write_acks), "device_evicted_tokens": device_evicted,
            "host_evict_requested": requested, "host_evicted_tokens": host_evicted,
            "host_slots_freed": freed}


# --------------------------------------------------------------------------
# SGLang's request tracing (--enable-trace)
# --------------------------------------------------------------------------
@contextlib.contextmanager
def request_tracing(tracer_provider: Any):
    """SGLang's request tracing on in this process, as ``process_tracing_init`` leaves
    it (``opentelemetry_initialized``, the module's ``tracer``), with spans going to
    ``tracer_provider`` instead of an OTLP exporter behind the global provider."""
    import sglang.srt.observability.trace as sglang_trace

    saved = sglang_trace.opentelemetry_initialized, sglang_trace.tracer
    sglang_trace.tracer = tracer_provider.get_tracer("sglang server")
    sglang_trace.opentelemetry_initialized = True
    try:
        yield sglang_trace
    finally:
        sglang_trace.opentelemetry_initialized, sglang_trace.tracer = saved


def traced_request(rid: str, tokens: List[int], sampled: bool = True) -> Tuple[Any, Any]:
    """A ``schedule_batch.Req`` of ``tokens`` whose trace context came the way a
    scheduler gets it: SGLang's ``TraceReqContext`` started a request's root span (the
    tokenizer's side) and crossed a process boundary by pickling. Returns ``(req, the
    tokenizer-side context)``; call ``.trace_req_finish()`` on the latter when done.
    Needs :func:`request_tracing`. ``sampled=False``: the request's trace was not sampled."""
    import pickle

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.observability.trace import TraceReqContext
    from sglang.srt.sampling.sampling_params import SamplingParams

    tokenizer_side = TraceReqContext(rid)
    headers = None if sampled else {"traceparent": "00-0000000000000000000000000000abcd-00000000000000ef-00"}
    tokenizer_side.external_trace_header = headers
    tokenizer_side.trace_req_start()
    req = Req(rid, "", array("q", tokens), SamplingParams())
    req.time_stats.trace_ctx = pickle.loads(pickle.dumps(tokenizer_side))  # the scheduler's copy
    req.refresh_fill_ids()
    return req, tokenizer_side


def checkpoint_request(stack: CacheStack, req: Any, req_pool_idx: int = 0) -> Any:
    """The scheduler caching a finished request's KV: ``len(req.origin_input_ids)`` device
    slots with random KV in the request's row, ``UnifiedRadixCache.checkpoint`` (the insert;
    under write_through it queues the backup), then its tree lock released, as
    ``release_kv_cache`` does. Returns the slots."""
    n = len(req.origin_input_ids)
    value = stack.allocator.alloc(n)
    assert value is not None, "device pool exhausted"
    _fill_random(stack.kv, value)
    stack.req_to_token.req_to_token[req_pool_idx, :n] = value.to(stack.req_to_token.req_to_token.dtype)
    req.kv.req_pool_idx = req_pool_idx
    stack.cache.checkpoint(req, up_to=n)
    stack.cache.unlock(req.lock)
    req.lock = None
    return value


def load_back_request(stack: CacheStack, req: Any) -> int:
    """Admission of a request whose prefix is on the host only: ``match_prefix``, then
    ``init_load_back`` with the request, as ``schedule_policy`` does (the load is queued;
    ``ready_to_load_host_cache`` submits it). Returns the tokens to load."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams

    hit = stack.cache.match_prefix(MatchPrefixParams(key=_radix_key(list(req.origin_input_ids))))
    assert hit.host_hit_length > 0, hit
    req.last_node = hit.last_device_node
    loaded = stack.cache.init_load_back(InitLoadBackParams(best_match_node=hit.best_match_node,
                                                           host_hit_length=hit.host_hit_length, req=req))
    assert loaded is not None and loaded[0] == hit.host_hit_length, (loaded, hit)
    return loaded[0]


def traced_round_trip(stack: CacheStack, n: int = 12, start: int = 100) -> Dict[str, Any]:
    """Two traced requests over one prefix (needs :func:`request_tracing`): the first's
    insert backs its KV up (one merged write-through offload), the prefix is evicted from
    the device, the second's admission loads it back (one merged prefix-hit onboard).
    Returns the ops' tokens and bytes from their acks and each request's root span
    context (``writer``, ``reader``); both requests' root spans are ended."""
    cache, controller = stack.cache, stack.controller
    tokens = list(range(start, start + n))
    writer, writer_side = traced_request(f"rid-writer-{start}", tokens)
    checkpoint_request(stack, writer)
    cache.flush_pending_backups()
    write_acks = list(controller.ack_write_queue)
    cache.check_hicache_events()
    assert _evict_device(stack, n) == n
    reader, reader_side = traced_request(f"rid-reader-{start}", tokens)
    assert load_back_request(stack, reader) == n
    cache.ready_to_load_host_cache()
    load_acks = list(controller.ack_load_queue)
    cache.check_hicache_events()
    assert len(write_acks) == 1 and len(load_acks) == 1
    roots = {}
    for name, side in (("writer", writer_side), ("reader", reader_side)):
        roots[name] = side.root_span.get_span_context()
        side.trace_req_finish()
    return {"offload_tokens": write_acks[0].num_tokens, "offload_bytes": write_acks[0].num_bytes,
            "onboard_tokens": load_acks[0].num_tokens, "onboard_bytes": load_acks[0].num_bytes,
            "merged_offloads": 1, "merged_onboards": 1, **roots}


# --------------------------------------------------------------------------
# SGLang's own counters
# --------------------------------------------------------------------------
CounterKey = Tuple[str, FrozenSet[Tuple[str, str]]]


def sglang_counter_values() -> Dict[CounterKey, float]:
    """Every ``sglang:*_total`` sample in the global Prometheus registry.

    Keyed by ``(sample name, frozenset of (label, value))`` without the
    collector labels (``cache_type``, ``tp_rank``, ``pp_rank``, ``dp_rank``).
    """
    from prometheus_client import REGISTRY

    values: Dict[CounterKey, float] = {}
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            if not (sample.name.startswith("sglang:") and sample.name.endswith("_total")):
                continue
            labels = frozenset((k, v) for k, v in sample.labels.items()
                               if k not in COLLECTOR_LABELS)
            key = (sample.name, labels)
            values[key] = values.get(key, 0.0) + float(sample.value)
    return values


def sglang_counter(name: str, **labels: str) -> float:
    """The value of one ``sglang:*_total`` series, 0.0 when it does not exist."""
    key = (name, frozenset((k, str(v)) for k, v in labels.items()))
    return sglang_counter_values().get(key, 0.0)
