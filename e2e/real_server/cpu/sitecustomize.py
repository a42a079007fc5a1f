"""CPU stand-ins for a real SGLang server in tests, imported at start-up by each of its processes
(this directory leads its PYTHONPATH). SGLang's files stay as they are: two functions are replaced
on import, and sgl_kernel/ here stands in for two CPU ops.
  host pool  pool_host.common.ALLOC_MEMORY_FUNCS["cpu"] allocates unpinned (not registered with CUDA)
  KV copy    pool_host.mha.transfer_kv_direct in torch (the real one is a CUDA op), hence
             --hicache-io-backend direct --hicache-mem-layout layer_first
Another release than TESTED stops the process rather than run unpatched.
"""
import os
import sys
from importlib import metadata

TESTED = ("0.5.22", "0.5.23")

try:
    _release = metadata.version("sglang")
except metadata.PackageNotFoundError:
    _release = None
if _release is not None and _release not in TESTED:
    sys.stderr.write(f"real_server/cpu: SGLang {_release} is not one of {TESTED}; "
                     "check these CPU stand-ins against it and add it to TESTED\n")
    os._exit(3)  # an exception here would only be printed, SGLang run unpatched


def _unpinned_host_pool(module):
    def alloc(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
        return allocator.allocate(dims, dtype=dtype, device=device)

    module.ALLOC_MEMORY_FUNCS["cpu"] = alloc


def _torch_kv_copy(module):
    import torch

    def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
        for src, dst in zip(src_layers, dst_layers, strict=True):
            rows = src.index_select(0, src_indices.to(src.device, torch.int64))
            dst.index_copy_(0, dst_indices.to(dst.device, torch.int64), rows.to(dst.device))

    module.transfer_kv_direct = transfer_kv_direct


if _release is not None:
    import wrapt

    wrapt.register_post_import_hook(_unpinned_host_pool, "sglang.srt.mem_cache.pool_host.common")
    wrapt.register_post_import_hook(_torch_kv_copy, "sglang.srt.mem_cache.pool_host.mha")
