"""The two sgl_kernel CPU ops SGLang imports under SGLANG_USE_CPU_ENGINE=1 for a dense model; any
other name is a function that raises. torch.ops.sgl_kernel stays unregistered: no AMX, so SGLang's
torch-native layers run."""
import ctypes

__version__ = "0.0.0+cpu-stand-in"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    # per request, req_to_token[row, start:end] = the next end - start slots of out_cache_loc
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        if end > start:
            req_to_token[row, start:end] = out_cache_loc[offset:offset + end - start].to(req_to_token.dtype)
        offset += max(0, end - start)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    # in every buffer, row tgt[j] <- row src[j] (a row is strides[b] bytes at data_ptrs[b])
    pairs = [(t, s) for t, s in zip(tgt_loc.tolist(), src_loc.tolist()) if t != s]
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for t, s in pairs:
            ctypes.memmove(base + t * stride, base + s * stride, stride)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel CPU stand-in: {name} is not provided")

    missing.__name__ = name
    return missing
