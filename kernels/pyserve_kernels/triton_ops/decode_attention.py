"""Paged decode attention in Triton: one new query token per request against its KV pages.

Algorithm: flash-decoding (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context
inference", 2023). Stage 1 splits each request's keys into `num_kv_splits` contiguous ranges
and computes, per range, the softmax-normalised partial output and its log-sum-exp with the
online softmax of Milakov & Gimelshein ("Online normalizer calculation for softmax", 2018);
stage 2 merges the ranges by the log-sum-exp rule. Keys are read through req_to_token in
place (no gather copy). The launcher never reads device data on the host, so it can be
captured in a CUDA graph.
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from pyserve_kernels.triton_ops.paged_kv import load_kv_tile, online_softmax_step, tile_scores

DEFAULT_NUM_KV_SPLITS = 8
_BLOCK_N = 32


@triton.jit
def _decode_stage1_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    req_to_token_ptr,
    req_pool_indices_ptr,
    seq_lens_ptr,
    mid_ptr,
    scaling,
    window,
    head_dim,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_row,
    stride_mb,
    stride_mh,
    stride_ms,
    GROUP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program: request b, the GROUP query heads of KV head kvh, one split of the keys.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(req_pool_indices_ptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    kv_start = seq_len * 0
    if HAS_WINDOW:
        kv_start = tl.maximum(seq_len - window, 0)
    # Splits are whole multiples of BLOCK_N so only the last block of a split is ragged.
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_start = kv_start + split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)

    h_idx = tl.arange(0, BLOCK_H)
    h_mask = h_idx < GROUP
    heads = kvh * GROUP + h_idx
    d_offs = tl.arange(0, BLOCK_D)
    d_mask = d_offs < head_dim
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d_offs[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(split_start, split_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        n_mask = pos < split_end
        k, v = load_kv_tile(
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
        )
        s = tl.where(n_mask[None, :], tile_scores(q, k, DOT_FP32) * scaling, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_FP32)

    # An empty split stores output 0 and lse -inf: it then weighs nothing in stage 2.
    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    lse = tl.where(nonempty, m_i + tl.log(l_safe), float("-inf"))
    mid = mid_ptr + b * stride_mb + heads * stride_mh + split * stride_ms
    tl.store(mid[:, None] + d_offs[None, :], acc / l_safe[:, None], mask=h_mask[:, None] & d_mask[None, :])
    tl.store(mid + head_dim, lse, mask=h_mask)


@triton.jit
def _decode_stage2_kernel(
    mid_ptr,
    out_ptr,
    head_dim,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s_offs = tl.arange(0, BLOCK_S)
    s_mask = s_offs < NUM_SPLITS
    d_offs = tl.arange(0, BLOCK_D)
    d_mask = d_offs < head_dim
    mid = mid_ptr + b * stride_mb + h * stride_mh + s_offs * stride_ms
    lse = tl.load(mid + head_dim, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a request with no keys: all weights 0
    w = tl.exp(lse - m)
    o = tl.load(mid[:, None] + d_offs[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d_offs, res.to(out_ptr.dtype.element_ty), mask=d_mask)


def is_host_int(value: object, minimum: int) -> bool:
    """True for a host integer (Python or numpy, not bool, not a tensor) >= minimum."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= minimum


def check_paged_kv(
    name: str,
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    indices: dict[str, torch.Tensor],
    sliding_window: int | None,
) -> int:
    """Shared argument checks of the paged attention launchers; returns the GQA group size.

    Raises ValueError naming `name` when q is not 3-D, the buffers' shapes, dtypes or devices
    disagree with q, head counts do not divide, an index tensor is not integer / 1-D, or the
    sliding window is not a positive int.
    """
    if q.dim() != 3:
        raise ValueError(f"{name}: q must be 3-D [tokens, num_heads, head_dim], got {tuple(q.shape)}")
    if not q.is_floating_point():
        raise ValueError(f"{name}: q must be floating point, got {q.dtype}")
    for label, buf in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if buf.dim() != 3:
            raise ValueError(f"{name}: {label} must be 3-D [num_slots, num_kv_heads, head_dim], got {tuple(buf.shape)}")
        if buf.dtype != q.dtype:
            raise ValueError(f"{name}: {label} dtype {buf.dtype} != q dtype {q.dtype}")
        if buf.device != q.device:
            raise ValueError(f"{name}: {label} on {buf.device} but q on {q.device}")
        if buf.stride(-1) != 1:
            raise ValueError(f"{name}: {label} must be contiguous in head_dim")
    if k_buffer.shape != v_buffer.shape:
        raise ValueError(f"{name}: k_buffer {tuple(k_buffer.shape)} != v_buffer {tuple(v_buffer.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    if k_buffer.shape[2] != head_dim:
        raise ValueError(f"{name}: head_dim of q {head_dim} != head_dim of k_buffer {k_buffer.shape[2]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"{name}: num_heads {num_heads} not divisible by num_kv_heads {num_kv_heads}")
    if q.stride(-1) != 1:
        raise ValueError(f"{name}: q must be contiguous in head_dim")
    if req_to_token.dim() != 2:
        raise ValueError(f"{name}: req_to_token must be 2-D [num_rows, max_context], got {tuple(req_to_token.shape)}")
    for label, t in (("req_to_token", req_to_token), *indices.items()):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: {label} must be int32 or int64, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: {label} on {t.device} but q on {q.device}")
        if label != "req_to_token" and (t.dim() != 1 or t.stride(0) != 1):
            raise ValueError(f"{name}: {label} must be a contiguous 1-D tensor, got {tuple(t.shape)}")
    if req_to_token.stride(1) != 1:
        raise ValueError(f"{name}: req_to_token must be contiguous in its last dim")
    if sliding_window is not None and not is_host_int(sliding_window, minimum=1):
        raise ValueError(f"{name}: sliding_window must be None or an int >= 1, got {sliding_window!r}")
    return num_heads // num_kv_heads


def check_out(name: str, out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """`out`, or a new empty tensor like q; raises ValueError if out's shape/dtype/device differ."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"{name}: out must be {tuple(q.shape)} {q.dtype} on {q.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if out.stride(-1) != 1:
        raise ValueError(f"{name}: out must be contiguous in head_dim")
    return out


def decode_workspace(
    batch: int,
    num_heads: int,
    head_dim: int,
    num_kv_splits: int = DEFAULT_NUM_KV_SPLITS,
    device: torch.device | str = "cuda",
) -> torch.Tensor:
    """A float32 workspace for `decode_attention_fwd`: [batch, num_heads, num_kv_splits,
    head_dim + 1] (each split's partial output, then its log-sum-exp). Allocate it once for the
    largest captured batch to replay decode in a CUDA graph."""
    return torch.empty(batch, num_heads, num_kv_splits, head_dim + 1, dtype=torch.float32, device=device)


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scaling: float,
    sliding_window: int | None = None,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged decode attention (flash-decoding): out[b, h] = softmax(q[b, h] K_b^T * scaling) V_b.

    q:            [batch, num_heads, head_dim] float32 / float16 / bfloat16, cuda (or cpu under
                  TRITON_INTERPRET=1); any head_dim (padded to a power of two inside)
    k_buffer, v_buffer: [num_slots, num_kv_heads, head_dim] the KV pool of one layer, q.dtype;
                  query head h reads KV head h // (num_heads // num_kv_heads)
    req_to_token: [num_rows, max_context] int32/int64: slot of position j of request row r
    req_pool_indices: [batch] int32/int64 rows of req_to_token
    seq_lens:     [batch] int32/int64 keys per request, including the new token (whose K/V is
                  already stored); values are not checked (no host sync)
    sliding_window: None, or W >= 1: each request attends to its last W keys only
    num_kv_splits: key ranges per request (default DEFAULT_NUM_KV_SPLITS); a host int, never
                  derived from device data. Splits beyond a request's keys are empty.
    out:          optional [batch, num_heads, head_dim] q.dtype, written in place
    workspace:    optional float32 [>= batch, num_heads, num_kv_splits, head_dim + 1] (see
                  `decode_workspace`); allocated per call when None
    Returns out; a request with no keys gets zeros. Computes in float32 inside.
    Raises ValueError on bad shapes, dtypes, devices or arguments (see `check_paged_kv`).
    """
    name = "decode_attention_fwd"
    group = check_paged_kv(
        name,
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        {"req_pool_indices": req_pool_indices, "seq_lens": seq_lens},
        sliding_window,
    )
    batch, num_heads, head_dim = q.shape
    if req_pool_indices.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(
            f"{name}: req_pool_indices {tuple(req_pool_indices.shape)} and seq_lens "
            f"{tuple(seq_lens.shape)} must both be [{batch}]"
        )
    if num_kv_splits is None:
        num_kv_splits = DEFAULT_NUM_KV_SPLITS
    if not is_host_int(num_kv_splits, minimum=1):
        raise ValueError(f"{name}: num_kv_splits must be an int >= 1, got {num_kv_splits!r}")
    num_kv_splits = int(num_kv_splits)
    out = check_out(name, out, q)
    if workspace is None:
        workspace = decode_workspace(batch, num_heads, head_dim, num_kv_splits, q.device)
    elif (
        workspace.dim() != 4
        or workspace.shape[0] < batch
        or tuple(workspace.shape[1:]) != (num_heads, num_kv_splits, head_dim + 1)
        or workspace.dtype != torch.float32
        or workspace.device != q.device
        or workspace.stride(-1) != 1
    ):
        raise ValueError(
            f"{name}: workspace must be float32 [>={batch}, {num_heads}, "
            f"{num_kv_splits}, {head_dim + 1}] on {q.device}, got "
            f"{tuple(workspace.shape)} {workspace.dtype} on {workspace.device}"
        )
    if batch == 0:
        return out

    num_kv_heads = k_buffer.shape[1]
    block_d = max(16, triton.next_power_of_2(head_dim))
    # tl.dot needs at least 16 rows on GPU; padded head rows are masked.
    block_h = max(16, triton.next_power_of_2(group))
    # Off CUDA (the interpreter) low-precision tl.dot is unreliable, so dot in float32 there.
    dot_fp32 = q.dtype == torch.float32 or q.device.type != "cuda"
    _decode_stage1_kernel[(batch, num_kv_heads, num_kv_splits)](
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        workspace,
        float(scaling),
        int(sliding_window or 0),
        head_dim,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        workspace.stride(0),
        workspace.stride(1),
        workspace.stride(2),
        GROUP=group,
        NUM_SPLITS=num_kv_splits,
        HAS_WINDOW=sliding_window is not None,
        DOT_FP32=dot_fp32,
        BLOCK_H=block_h,
        BLOCK_N=_BLOCK_N,
        BLOCK_D=block_d,
    )
    _decode_stage2_kernel[(batch, num_heads)](
        workspace,
        out,
        head_dim,
        workspace.stride(0),
        workspace.stride(1),
        workspace.stride(2),
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=num_kv_splits,
        BLOCK_S=triton.next_power_of_2(num_kv_splits),
        BLOCK_D=block_d,
    )
    return out
