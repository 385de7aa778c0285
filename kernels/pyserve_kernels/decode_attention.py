"""Paged decode attention on CPU in float32: the native kernel `pyserve_kernels._cpu`
(Rust, kernels/cpu/src/decode_attention.rs) behind a torch API.

Each request's new token attends to its cached keys and values read in place from the KV pool
through its slot list, with nothing gathered or padded, on torch's intra-op thread count.
"""

from __future__ import annotations

import torch

from pyserve_kernels._native import _cpu, as_int_array


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scaling: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scaling) v for one new token per request, over a paged KV pool.

    q:          [batch, num_heads, head_dim] float32 cpu
    k_buffer, v_buffer: [num_slots, num_kv_heads, head_dim] float32 cpu, C-contiguous (one
                layer of the pool); num_heads must be a multiple of num_kv_heads (query head h
                reads KV head h // (num_heads // num_kv_heads))
    kv_indptr:  [batch + 1] integer: request b's keys are the slots
                kv_indices[kv_indptr[b]:kv_indptr[b + 1]], in position order
    kv_indices: [kv_indptr[-1]] integer slots, each in 0..num_slots
    sliding_window: None, or W: each request attends to its last W keys only
    out:        optional [batch, num_heads, head_dim] float32 cpu C-contiguous to write into
    Returns out (a new tensor when not given). A request with no keys gets zeros.
    Raises RuntimeError if the native module is missing, ValueError for wrong dtypes, devices,
    shapes or layouts or for `out` overlapping an input, IndexError for a bad kv_indptr or a
    slot outside the pool. Runs on up to
    torch.get_num_threads() threads (torch's OpenMP team where _native.py could attach to
    it), the GIL released.
    """
    if _cpu is None:
        raise RuntimeError("pyserve_kernels._cpu is not built; reinstall pyserve-kernels")
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if t.device.type != "cpu" or t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 on cpu, got {t.dtype} on {t.device}")
    q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a C-contiguous float32 tensor of shape {tuple(q.shape)}")
    _cpu.decode_attention(
        q.numpy(),
        k_buffer.numpy(),
        v_buffer.numpy(),
        as_int_array(kv_indptr, torch.int32, "kv_indptr"),
        as_int_array(kv_indices, torch.int32, "kv_indices"),
        out.numpy(),
        float(scaling),
        sliding_window,
        torch.get_num_threads(),
    )
    return out
