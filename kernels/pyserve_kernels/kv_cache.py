"""Storing new tokens' K and V into their KV-pool slots: the Triton kernel on CUDA, the native
CPU kernel for float32 CPU tensors, else the torch reference (an index_put)."""

from __future__ import annotations

import torch

from pyserve_kernels import reference
from pyserve_kernels._native import _cpu, as_int_array, native_applies
from pyserve_kernels._triton import triton_applies


def store_kv(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_buffer[loc] = k and v_buffer[loc] = v (mutates the buffers).

    k_buffer, v_buffer: [num_slots, num_kv_heads, head_dim]; loc: [num_tokens] integer slots
    in 0..num_slots; k, v: [num_tokens, num_kv_heads, head_dim], cast to the buffers' dtype
    (they may be strided views, e.g. of a fused q|k|v projection). With repeated slots the
    last token wins. Raises IndexError for a slot outside the pool (nothing written on the
    native path; on CUDA the Triton kernel skips such a slot instead, reading no device data
    on the host), ValueError for mismatched shapes, non-integer slots, or k / v overlapping
    the buffers.
    """
    if k.shape != v.shape or k.shape[1:] != k_buffer.shape[1:] or k.shape[0] != loc.shape[0]:
        raise ValueError(
            f"store_kv: buffers {tuple(k_buffer.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}, loc {tuple(loc.shape)} do not fit"
        )
    if triton_applies(k_buffer, v_buffer, loc, k, v):  # no slot check on the host: sync-free
        from pyserve_kernels.triton_ops.kv_store import store_kv as triton_store_kv

        triton_store_kv(k_buffer, v_buffer, loc, k, v)
        return
    rows_contiguous = all(
        t.dim() == 3
        and t.stride(2) == 1
        and t.stride(1) == t.shape[2]
        and t.device.type == "cpu"
        and t.dtype == torch.float32
        for t in (k, v)
    )
    if rows_contiguous and native_applies(k_buffer, v_buffer) and loc.device.type == "cpu":
        _cpu.store_kv(k_buffer.numpy(), v_buffer.numpy(), as_int_array(loc, torch.int32, "loc"), k.numpy(), v.numpy())
        return
    reference.store_kv(k_buffer, v_buffer, loc, k, v)
