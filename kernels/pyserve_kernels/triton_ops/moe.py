"""Triton fused experts: a mixture of experts' feed-forward after routing as two grouped GEMMs
(the CUDA path of a mixture's experts; semantics: `pyserve_kernels.reference.fused_experts`).

A step's T·k (token, expert) assignments are sorted by expert and each expert's run padded to a
multiple of BLOCK_M (`align_block_size`), so every BLOCK_M rows of the sorted list belong to one
expert; one program computes a BLOCK_M x BLOCK_N tile of that expert's product over just those
rows (rows gathered from the activations by index, the expert's weight tile read once per tile).
The gate|up product, SwiGLU, then the down product scaled by the routing weights, and the k
outputs of each token summed. Every shape is fixed by T, k, E and BLOCK_M (the padding is an
upper bound, no count read back to the host), so the launches can be captured in a CUDA graph.

The grouped GEMM over expert-sorted, block-aligned rows is the scheme of SGLang's and vLLM's
`fused_moe` (from the MegaBlocks paper: Gale et al., "MegaBlocks: Efficient Sparse Training
with Mixture-of-Experts", 2022); this implementation is written here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pyserve_kernels.triton_ops.activation import silu_and_mul

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def align_block_size(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The assignments of `ids` [T, k] sorted by expert, each expert's run padded to whole
    blocks of `block_m`: (sorted [P] int32, the flat assignment index t·k + j of each row or
    T·k for padding; block_expert [P / block_m] int32, each block's expert or -1 past the
    last), P = T·k + E·(block_m - 1) rounded up to a block. Token order is kept within an
    expert. No host synchronisation (torch ops on ids' device)."""
    flat = ids.reshape(-1).to(torch.int64)
    total = flat.numel()
    # scatter_add, not bincount: bincount sizes its output from the largest id (a host sync)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first place in `order`
    rank = torch.arange(total, device=ids.device) - first[expert_of]
    size = -(-(total + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((size,), total, dtype=torch.int32, device=ids.device)
    sorted_ids[starts[expert_of] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, size, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weight_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_valid,
    n,
    k,
    row_div,
    a_s0,
    a_s1,
    b_se,
    b_sn,
    b_sk,
    c_s0,
    c_s1,
    MUL_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = rows < num_valid
    src = rows // row_div  # the activation row an assignment reads (its token, or itself)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        a = tl.load(a_ptr + src[:, None] * a_s0 + ks[None, :] * a_s1, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(
            b_ptr + expert * b_se + cols[None, :] * b_sn + ks[:, None] * b_sk,
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if MUL_WEIGHT:
        acc *= tl.load(weight_ptr + rows, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(
        c_ptr + rows[:, None] * c_s0 + cols[None, :] * c_s1,
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & col_ok[None, :],
    )


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    row_div: int,
    weights: torch.Tensor | None,
    block_m: int,
) -> None:
    """out[r] = a[r // row_div] @ w[expert of r]^T (times weights[r] when given) for each
    assignment r of the sorted list; w [E, N, K]."""
    n, k = w.shape[1], w.shape[2]
    block_n, block_k = 64, 32
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        w,
        out,
        weights if weights is not None else out,
        sorted_ids,
        block_expert,
        out.shape[0],
        n,
        k,
        row_div,
        a.stride(0),
        a.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        MUL_WEIGHT=weights is not None,
        IEEE=a.dtype == torch.float32 or a.device.type != "cuda",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    block_m: int = 16,
) -> torch.Tensor:
    """Σ_j weights[t, j] · down_e(silu(gate_e(x[t])) · up_e(x[t])), e = ids[t, j] -> [T, H] in
    x.dtype, accumulated in float32 within each product.

    x: [T, H] float32 / float16 / bfloat16, cuda (or CPU under TRITON_INTERPRET=1); gate_up:
    [E, 2I, H] (gate rows then up rows) and down: [E, H, I] in x.dtype on x's device; weights
    [T, k] (any float dtype) and ids [T, k] (integers in 0..E) from the router. block_m: rows of
    a tile (16 or more; tl.dot's minimum). Intermediate results are rounded to x.dtype (the
    gate|up product, the SwiGLU, each weighted expert output) and the k outputs are summed in
    float32. Raises ValueError for dtypes, devices or shapes that do not fit."""
    if x.dtype not in _DTYPES or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(
            f"fused_experts: x, gate_up, down must share a float dtype, got {x.dtype}, {gate_up.dtype}, {down.dtype}"
        )
    if not (x.device == gate_up.device == down.device == ids.device == weights.device):
        raise ValueError("fused_experts: every tensor must be on x's device")
    t, h = x.shape
    e, two_i, h2 = gate_up.shape
    if h2 != h or down.shape != (e, h, two_i // 2) or two_i % 2 or ids.shape != weights.shape or ids.shape[0] != t:
        raise ValueError(
            f"fused_experts: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}, "
            f"ids {tuple(ids.shape)}, weights {tuple(weights.shape)} do not fit"
        )
    if block_m < 16:
        raise ValueError(f"fused_experts: block_m {block_m} is below tl.dot's 16 rows")
    top_k = ids.shape[1]
    sorted_ids, block_expert = align_block_size(ids, e, block_m)
    assigned = t * top_k
    gate_up_out = x.new_empty(assigned, two_i)
    _grouped_gemm(x, gate_up, gate_up_out, sorted_ids, block_expert, top_k, None, block_m)
    act = silu_and_mul(gate_up_out)
    out = x.new_empty(assigned, h)
    flat_weights = weights.reshape(-1).to(torch.float32)
    _grouped_gemm(act, down, out, sorted_ids, block_expert, 1, flat_weights, block_m)
    return out.view(t, top_k, h).sum(dim=1, dtype=torch.float32).to(x.dtype)
