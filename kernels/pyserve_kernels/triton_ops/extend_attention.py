"""Paged extend (prefill) attention in Triton: each request's new tokens attend causally to its
cached prefix and to themselves, all keys read through req_to_token.

Algorithm: FlashAttention (Dao et al., "FlashAttention: Fast and Memory-Efficient Exact
Attention with IO-Awareness", 2022): tiles of BLOCK_M queries loop over BLOCK_N-key tiles
with the online softmax of Milakov & Gimelshein ("Online normalizer calculation for softmax",
2018) in float32, and key tiles past the causal limit are skipped. The launcher never reads
device data on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pyserve_kernels.triton_ops.decode_attention import check_out, check_paged_kv, is_host_int
from pyserve_kernels.triton_ops.paged_kv import load_kv_tile, online_softmax_step, tile_scores


@triton.jit
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    req_to_token_ptr,
    req_pool_indices_ptr,
    prefix_lens_ptr,
    extend_lens_ptr,
    qo_indptr_ptr,
    scaling,
    window,
    head_dim,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_row,
    GROUP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program: request b, query head h, the BLOCK_M new tokens of tile mb.
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_start = tl.program_id(2) * BLOCK_M
    extend_len = tl.load(extend_lens_ptr + b).to(tl.int32)
    if m_start >= extend_len:
        return
    prefix_len = tl.load(prefix_lens_ptr + b).to(tl.int32)
    qo_start = tl.load(qo_indptr_ptr + b).to(tl.int64)
    row = tl.load(req_pool_indices_ptr + b).to(tl.int64)
    kvh = h // GROUP

    m_offs = m_start + tl.arange(0, BLOCK_M)
    m_mask = m_offs < extend_len
    q_pos = prefix_len + m_offs
    d_offs = tl.arange(0, BLOCK_D)
    d_mask = d_offs < head_dim
    q_rows = qo_start + m_offs
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + d_offs[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    # Causal limit of this tile: its last query's position (or the request's last key).
    kv_end = prefix_len + tl.minimum(extend_len, m_start + BLOCK_M)
    kv_start = prefix_len * 0
    if HAS_WINDOW:
        kv_start = tl.maximum(prefix_len + m_start - window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(kv_start, kv_end, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        n_mask = k_pos < kv_end
        k, v = load_kv_tile(
            k_ptr,
            v_ptr,
            req_to_token_ptr,
            row,
            stride_row,
            k_pos,
            n_mask,
            kvh,
            stride_kn,
            stride_kh,
            stride_vn,
            stride_vh,
            d_offs,
            d_mask,
        )
        s = tile_scores(q, k, DOT_FP32)
        allowed = n_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s * scaling, float("-inf"))
        # a row may have seen no allowed key yet (sliding window): the step keeps it finite
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_FP32)

    res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + d_offs[None, :],
        res.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def extend_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    max_extend_len: int,
    scaling: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of a batch's new tokens over their prefix and themselves.

    q:            [num_tokens, num_heads, head_dim] float32 / float16 / bfloat16, cuda (or cpu
                  under TRITON_INTERPRET=1); request b's rows are qo_indptr[b]:qo_indptr[b + 1]
                  and sit at positions prefix_lens[b] .. prefix_lens[b] + extend_lens[b] - 1
    k_buffer, v_buffer: [num_slots, num_kv_heads, head_dim] the KV pool of one layer, q.dtype,
                  already holding the new tokens' K/V; query head h reads KV head
                  h // (num_heads // num_kv_heads)
    req_to_token: [num_rows, max_context] int32/int64: slot of position j of request row r
    req_pool_indices, prefix_lens, extend_lens: [batch] int32/int64
    qo_indptr:    [batch + 1] int32/int64, the cumulative sum of extend_lens (from 0)
    max_extend_len: host int >= max(extend_lens) (sizes the grid; device data is never read)
    sliding_window: None, or W >= 1: the query at position p sees keys p - W + 1 .. p only
    out:          optional [num_tokens, num_heads, head_dim] q.dtype, written in place
    Returns out. Computes in float32 inside; index values are not checked (no host sync).
    Raises ValueError on bad shapes, dtypes, devices or arguments.
    """
    name = "extend_attention_fwd"
    group = check_paged_kv(
        name,
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        {
            "req_pool_indices": req_pool_indices,
            "prefix_lens": prefix_lens,
            "extend_lens": extend_lens,
            "qo_indptr": qo_indptr,
        },
        sliding_window,
    )
    batch = req_pool_indices.shape[0]
    if prefix_lens.shape[0] != batch or extend_lens.shape[0] != batch:
        raise ValueError(
            f"{name}: prefix_lens {tuple(prefix_lens.shape)} and extend_lens "
            f"{tuple(extend_lens.shape)} must both be [{batch}] like req_pool_indices"
        )
    if qo_indptr.shape[0] != batch + 1:
        raise ValueError(f"{name}: qo_indptr must be [{batch + 1}], got {tuple(qo_indptr.shape)}")
    if not is_host_int(max_extend_len, minimum=0):
        raise ValueError(f"{name}: max_extend_len must be a host int >= 0, got {max_extend_len!r}")
    max_extend_len = int(max_extend_len)
    out = check_out(name, out, q)
    num_tokens, num_heads, head_dim = q.shape
    if batch == 0 or num_tokens == 0 or max_extend_len == 0:
        return out

    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = 64 if block_d <= 128 else 32
    block_n = 64 if block_d <= 64 else 32
    # Off CUDA (the interpreter) low-precision tl.dot is unreliable, so dot in float32 there.
    dot_fp32 = q.dtype == torch.float32 or q.device.type != "cuda"
    grid = (batch, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        k_buffer,
        v_buffer,
        out,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        qo_indptr,
        float(scaling),
        int(sliding_window or 0),
        head_dim,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        GROUP=group,
        HAS_WINDOW=sliding_window is not None,
        DOT_FP32=dot_fp32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    return out
