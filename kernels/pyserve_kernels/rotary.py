"""Rotary position embedding applied in place to the q and k heads of a fused q|k|v row: the
Triton kernel on CUDA, the native CPU kernel for float32 CPU tensors, else the torch
reference."""

from __future__ import annotations

import torch

from pyserve_kernels import reference
from pyserve_kernels._native import _cpu, native_applies
from pyserve_kernels._triton import triton_applies


def rotary_embedding_(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int
) -> torch.Tensor:
    """Rotate, IN PLACE, heads 0..num_heads of every row of x (rotate-half layout; see
    `reference.apply_rotary_pos_emb`, whose results this equals bit for bit on the native
    path too). Columns past num_heads * head_dim (e.g. V) are untouched.

    x: [num_tokens, row_len] with row_len >= num_heads * head_dim; cos, sin:
    [num_tokens, head_dim] float32. Returns x. Raises ValueError on mismatched shapes or an
    odd head_dim.
    """
    if (
        x.dim() != 2
        or head_dim <= 0
        or head_dim % 2
        or x.shape[1] < num_heads * head_dim
        or cos.shape != (x.shape[0], head_dim)
        or sin.shape != cos.shape
    ):
        raise ValueError(
            f"rotary_embedding_: x {tuple(x.shape)}, cos {tuple(cos.shape)}, "
            f"sin {tuple(sin.shape)}, {num_heads} heads of {head_dim}"
        )
    if triton_applies(x, cos, sin):
        from pyserve_kernels.triton_ops.rotary import rotary_embedding_ as triton_rotary

        return triton_rotary(x, cos, sin, num_heads, head_dim)
    if native_applies(x, cos, sin):
        _cpu.rotary_embedding(x.numpy(), cos.numpy(), sin.numpy(), num_heads, head_dim, torch.get_num_threads())
        return x
    heads = x[:, : num_heads * head_dim].unflatten(1, (num_heads, head_dim))
    heads.copy_(reference.rotary(heads, cos, sin))
    return x
