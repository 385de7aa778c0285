"""Bidirectional attention over a ragged batch on CPU in float32, for encoders: the native
kernel `pyserve_kernels._cpu` (Rust, kernels/cpu/src/varlen_attention.rs) behind a torch API.

Each sequence's tokens attend to every token of their own sequence, read from the fused QKV
projection as it is, with nothing gathered or padded, on torch's intra-op thread count.
"""

from __future__ import annotations

import math

import torch

from pyserve_kernels._native import _cpu, as_int_array, native_applies


def varlen_attention_applies(qkv: torch.Tensor) -> bool:
    """Whether `varlen_attention` can take `qkv`: the native module built, float32 on CPU."""
    return native_applies(qkv)


def varlen_attention(
    qkv: torch.Tensor, cu_seqlens: torch.Tensor, num_heads: int, scaling: float | None = None
) -> torch.Tensor:
    """softmax(q k^T * scaling) v within each sequence of a ragged batch (no causal mask).

    qkv:        [num_tokens, 3 * hidden] float32 cpu, C-contiguous: each token's q | k | v,
                hidden = num_heads * head_dim
    cu_seqlens: [batch + 1] integer: sequence b is tokens cu_seqlens[b]:cu_seqlens[b + 1]
                (rising from 0 to num_tokens, as FlashAttention's varlen API takes them)
    scaling:    default 1 / sqrt(head_dim)
    Returns a new [num_tokens, hidden] float32 tensor. Raises RuntimeError if the native
    module is missing, ValueError for wrong dtypes, devices or shapes, IndexError for a bad
    cu_seqlens. Runs on up to torch.get_num_threads() threads (torch's OpenMP team where
    _native.py could attach to it), the GIL released.
    """
    if _cpu is None:
        raise RuntimeError("pyserve_kernels._cpu is not built; reinstall pyserve-kernels")
    if not varlen_attention_applies(qkv):
        raise ValueError(f"qkv must be a C-contiguous float32 cpu tensor, got {qkv.dtype} on {qkv.device}")
    if num_heads < 1:
        raise ValueError(f"num_heads must be positive, got {num_heads}")
    if qkv.dim() != 2 or qkv.shape[1] == 0 or qkv.shape[1] % (3 * num_heads):
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [num_tokens, 3 * {num_heads} * head_dim]")
    if cu_seqlens.dim() != 1 or cu_seqlens.device.type != "cpu":
        raise ValueError(f"cu_seqlens must be a 1-D cpu tensor, got {tuple(cu_seqlens.shape)} on {cu_seqlens.device}")
    hidden = qkv.shape[1] // 3
    if scaling is None:
        scaling = 1.0 / math.sqrt(hidden // num_heads)
    out = qkv.new_empty(qkv.shape[0], hidden)
    _cpu.varlen_attention(
        qkv.numpy(),
        as_int_array(cu_seqlens, torch.int32, "cu_seqlens"),
        out.numpy(),
        num_heads,
        float(scaling),
        torch.get_num_threads(),
    )
    return out
