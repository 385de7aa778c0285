"""Triton device functions shared by the paged attention kernels (extend and decode): a K/V
tile read in place by slot through a request's req_to_token row, its scores, and one step
of the online softmax (Milakov & Gimelshein, "Online normalizer calculation for softmax",
2018) in float32."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    k_ptr,
    v_ptr,
    req_to_token_ptr,
    row,
    stride_row,
    pos,
    n_mask,
    kvh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    d_offs,
    d_mask,
):
    """K and V tiles [BLOCK_N, BLOCK_D] of KV head kvh at key positions `pos` (masked by
    n_mask) of request row `row`: slot = req_to_token[row, pos], 0 where masked."""
    slots = tl.load(req_to_token_ptr + row * stride_row + pos, mask=n_mask, other=0).to(tl.int64)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + slots[:, None] * stride_kn + kvh * stride_kh + d_offs[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + slots[:, None] * stride_vn + kvh * stride_vh + d_offs[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def tile_scores(q, k, DOT_FP32: tl.constexpr):
    """q [M, BLOCK_D] . k [BLOCK_N, BLOCK_D]^T -> [M, BLOCK_N] float32 (fp32 operands in
    IEEE precision when DOT_FP32, else the inputs' dtype with float32 accumulation)."""
    if DOT_FP32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, DOT_FP32: tl.constexpr):
    """Fold one tile into the running (max m_i [M], sum l_i [M], output acc [M, BLOCK_D]):
    s [M, BLOCK_N] scaled scores, -inf where a key is not allowed; v [BLOCK_N, BLOCK_D].
    A row that has seen no allowed key yet keeps exp() free of inf - inf."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_use)
    p = tl.exp(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv
