"""Triton rotary position embedding applied in place to the leading heads of each row, e.g. the
q and k heads of a fused q|k|v projection (the CUDA path of `pyserve_kernels.rotary_embedding_`;
semantics: `pyserve_kernels.reference.rotary`).

Algorithm: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021),
in the rotate-half (GPT-NeoX / HF Llama) layout: dimension i of a head pairs with
i + head_dim / 2. The rope variants (default, linear, llama3, dynamic NTK) differ only in the
cos / sin the caller passes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Elements of x one program rotates at most (heads * head_dim / 2 pairs).
_MAX_TILE = 2048


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    num_heads,
    half,
    x_s0,
    x_s1,
    cos_s0,
    cos_s1,
    sin_s0,
    sin_s1,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    dim_mask = dims < half
    mask = (heads < num_heads) & dim_mask

    # Both halves of cos / sin are read (not assumed equal), as the reference multiplies by
    # the full [head_dim] rows.
    cos_row = cos_ptr + token * cos_s0
    sin_row = sin_ptr + token * sin_s0
    cos_a = tl.load(cos_row + dims * cos_s1, mask=dim_mask, other=0.0).to(tl.float32)
    cos_b = tl.load(cos_row + (dims + half) * cos_s1, mask=dim_mask, other=0.0).to(tl.float32)
    sin_a = tl.load(sin_row + dims * sin_s1, mask=dim_mask, other=0.0).to(tl.float32)
    sin_b = tl.load(sin_row + (dims + half) * sin_s1, mask=dim_mask, other=0.0).to(tl.float32)

    first = x_ptr + token * x_s0 + (heads * (2 * half) + dims) * x_s1
    second = first + half * x_s1
    a = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(second, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin with rotate_half((a, b)) = (-b, a)
    tl.store(first, (a * cos_a - b * sin_a).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(second, (b * cos_b + a * sin_b).to(x_ptr.dtype.element_ty), mask=mask)


def rotary_embedding_(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int
) -> torch.Tensor:
    """Rotate, IN PLACE, heads 0..num_heads of every row of x (rotate-half layout; equals
    `reference.rotary` on x[:, :num_heads * head_dim] viewed as [num_tokens, num_heads,
    head_dim], computed in float32 and rounded to x.dtype). Columns past
    num_heads * head_dim (e.g. the V part of a fused q|k|v row) are untouched.

    x:        [num_tokens, row_len] float32 / float16 / bfloat16, cuda, any strides (e.g. a
              fused q|k|v projection, or a column slice of one such as qkv[:, q_size:] to
              rotate only the k heads); row_len >= num_heads * head_dim
    cos, sin: [num_tokens, head_dim] float (float32 in pyserve; each half repeated as built
              by pyserve's RotaryEmbedding), same device, any strides
    num_heads: heads to rotate (e.g. num_heads + num_kv_heads for q and k of a fused row)
    head_dim:  even, > 0
    Returns x. Host-sync-free: reads only shapes and strides.
    Raises ValueError for a non-2-D x, an odd or non-positive head_dim, a negative num_heads,
    rows shorter than num_heads * head_dim, cos / sin not [num_tokens, head_dim], unsupported
    dtypes, tensors on different devices, or CPU tensors outside TRITON_INTERPRET=1.
    """
    tensors = {"x": x, "cos": cos, "sin": sin}
    if len({t.device for t in tensors.values()}) != 1:
        raise ValueError(
            "rotary_embedding_: tensors on different devices: "
            + ", ".join(f"{n} {t.device}" for n, t in tensors.items())
        )
    if x.device.type != "cuda" and isinstance(_rotary_kernel, triton.runtime.JITFunction):
        raise ValueError(
            f"rotary_embedding_: tensors on {x.device}; the Triton kernel needs "
            "CUDA tensors (CPU tensors only under TRITON_INTERPRET=1)"
        )
    if x.dtype not in _DTYPES:
        raise ValueError(f"rotary_embedding_: x must be float32, float16 or bfloat16, got {x.dtype}")
    if not (cos.is_floating_point() and sin.is_floating_point()):
        raise ValueError(f"rotary_embedding_: cos / sin must be float, got {cos.dtype} / {sin.dtype}")
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rotary_embedding_: head_dim {head_dim} must be even and positive")
    if num_heads < 0:
        raise ValueError(f"rotary_embedding_: num_heads {num_heads} is negative")
    if (
        x.dim() != 2
        or x.shape[1] < num_heads * head_dim
        or cos.shape != (x.shape[0], head_dim)
        or sin.shape != cos.shape
    ):
        raise ValueError(
            f"rotary_embedding_: x {tuple(x.shape)}, cos {tuple(cos.shape)}, "
            f"sin {tuple(sin.shape)} do not fit {num_heads} heads of {head_dim} "
            "(want x [num_tokens, >= num_heads * head_dim], cos / sin "
            "[num_tokens, head_dim])"
        )
    num_tokens = x.shape[0]
    if num_tokens == 0 or num_heads == 0:
        return x
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(num_heads), max(1, _MAX_TILE // block_half))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _rotary_kernel[grid](
        x,
        cos,
        sin,
        num_heads,
        half,
        *x.stride(),
        *cos.stride(),
        *sin.stride(),
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
    )
    return x
