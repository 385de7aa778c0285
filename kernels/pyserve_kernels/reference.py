"""Slow, exact fp32 torch reference implementations of the ops the pyserve models use.

These define the semantics every faster kernel must match. Each op computes in float32 and
returns the input dtype, so a bf16 model gets fp32-accurate results rounded once at the end.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square layer norm: x / sqrt(mean(x^2) + eps) * weight.

    Algorithm: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019); as in Llama the
    normalisation is done in float32 and the result is cast back to x.dtype before the
    weight multiply.

    x:      [..., hidden] any float dtype, any device
    weight: [hidden] same device
    Returns [..., hidden] in x.dtype (promoted with weight.dtype).
    Raises ValueError if the last dim of x differs from weight's length.
    """
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"rms_norm: hidden {x.shape[-1]} != weight {weight.shape[-1]}")
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    normed = x32 * torch.rsqrt(variance + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): a residual add followed by RMSNorm.

    x, residual: [..., hidden] same shape; weight: [hidden]. Returns new tensors
    (normed [..., hidden] in x.dtype, sum [..., hidden]); the inputs are not modified.
    """
    total = x + residual
    return rms_norm(total, weight, eps), total


def store_kv(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_buffer[loc] = k and v_buffer[loc] = v, cast to the buffers' dtype (mutates them).

    k_buffer, v_buffer: [num_slots, num_kv_heads, head_dim]; loc: [num_tokens] integer;
    k, v: [num_tokens, num_kv_heads, head_dim]. Raises IndexError for a slot out of range.
    """
    k_buffer[loc] = k.to(k_buffer.dtype)
    v_buffer[loc] = v.to(v_buffer.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Map the two halves (a, b) of the last dim to (-b, a).

    x: [..., head_dim] with even head_dim. Returns the same shape and dtype.
    """
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding in the rotate-half (GPT-NeoX / HF Llama) layout.

    Algorithm: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding"
    (2021). Dimension i of a head is paired with dimension i + head_dim/2 (not i + 1).

    q:   [num_tokens, num_heads, head_dim]
    k:   [num_tokens, num_kv_heads, head_dim]
    cos, sin: [num_tokens, head_dim] (each half repeated), float32
    Returns (q_rot, k_rot) with the shapes and dtypes of q and k.
    Raises ValueError on mismatched token counts or head_dim.
    """
    if cos.shape != sin.shape or cos.shape[0] != q.shape[0] or cos.shape[-1] != q.shape[-1]:
        raise ValueError(f"apply_rotary_pos_emb: q {tuple(q.shape)} cos {tuple(cos.shape)} sin {tuple(sin.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"apply_rotary_pos_emb: q {tuple(q.shape)} k {tuple(k.shape)}")
    return rotary(q, cos, sin), rotary(k, cos, sin)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of one tensor (see `apply_rotary_pos_emb`):
    x * cos + rotate_half(x) * sin in float32, returned in x.dtype.

    x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, head_dim].
    """
    x32 = x.float()
    return (x32 * cos.float().unsqueeze(1) + rotate_half(x32) * sin.float().unsqueeze(1)).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate: silu(x[..., :d]) * x[..., d:] where d = x.shape[-1] // 2.

    Algorithm: Shazeer, "GLU Variants Improve Transformer" (2020).

    x: [..., 2 * intermediate] (gate then up, concatenated). Returns [..., intermediate] in
    x.dtype. Raises ValueError if the last dim is odd.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim {x.shape[-1]} is odd")
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    return torch.nn.functional.silu(gate) * up


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scaling: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Paged decode attention, one request at a time: softmax(q k^T * scaling) v.

    Algorithm: scaled dot-product attention (Vaswani et al., "Attention Is All You Need",
    2017) with grouped-query heads (Ainslie et al., "GQA", 2023).

    q:          [batch, num_heads, head_dim]
    k_buffer, v_buffer: [num_slots, num_kv_heads, head_dim]; query head h reads KV head
                h // (num_heads // num_kv_heads)
    kv_indptr:  [batch + 1]; request b's keys are kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
    sliding_window: None, or W: each request attends to its last W keys only
    Returns [batch, num_heads, head_dim] in q.dtype; a request with no keys gets zeros.
    """
    batch, num_heads, head_dim = q.shape
    group = num_heads // k_buffer.shape[1]
    out = torch.zeros(batch, num_heads, head_dim, dtype=torch.float32, device=q.device)
    for b in range(batch):
        start, end = int(kv_indptr[b]), int(kv_indptr[b + 1])
        if sliding_window is not None:
            start = max(start, end - sliding_window)
        if end == start:
            continue
        slots = kv_indices[start:end]  # int32 or int64: torch indexes with either
        keys = k_buffer[slots].float().repeat_interleave(group, dim=1)  # [n, H, D]
        values = v_buffer[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), keys) * scaling
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), values)
    return out.to(q.dtype)


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    scaling: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Paged extend attention, one request at a time: causal softmax(q k^T * scaling) v over
    each request's cached prefix and its new tokens.

    Algorithm: causal scaled dot-product attention (Vaswani et al., "Attention Is All You
    Need", 2017) with grouped-query heads (Ainslie et al., "GQA", 2023).

    q:          [num_tokens, num_heads, head_dim]; request b's new tokens are the next
                extend_lens[b] rows (requests in batch order) and sit at positions
                prefix_lens[b] .. prefix_lens[b] + extend_lens[b] - 1
    k_buffer, v_buffer: [num_slots, num_kv_heads, head_dim], holding the new tokens' K/V too;
                query head h reads KV head h // (num_heads // num_kv_heads)
    req_to_token: [num_rows, max_context]; position j of request b is slot
                req_to_token[req_pool_indices[b], j]
    prefix_lens, extend_lens, req_pool_indices: [batch] integer
    sliding_window: None, or W: the query at position p sees keys p - W + 1 .. p only
    Returns [num_tokens, num_heads, head_dim] in q.dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k_buffer.shape[1]
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    row_start = 0
    for b in range(req_pool_indices.shape[0]):
        prefix, extend = int(prefix_lens[b]), int(extend_lens[b])
        slots = req_to_token[int(req_pool_indices[b]), : prefix + extend]
        keys = k_buffer[slots].float().repeat_interleave(group, dim=1)  # [n, H, D]
        values = v_buffer[slots].float().repeat_interleave(group, dim=1)
        rows = slice(row_start, row_start + extend)
        scores = torch.einsum("thd,nhd->htn", q[rows].float(), keys) * scaling
        q_pos = torch.arange(prefix, prefix + extend, device=q.device)[:, None]
        k_pos = torch.arange(prefix + extend, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[rows] = torch.einsum("htn,nhd->thd", torch.softmax(scores, dim=-1), values)
        row_start += extend
    return out.to(q.dtype)


def varlen_attention(qkv: torch.Tensor, cu_seqlens: torch.Tensor, num_heads: int, scaling: float) -> torch.Tensor:
    """Bidirectional attention within each sequence of a ragged batch, one sequence at a time.

    Algorithm: scaled dot-product attention (Vaswani et al., "Attention Is All You Need",
    2017) without a causal mask, as an encoder (BERT) attends.

    qkv:        [num_tokens, 3 * hidden] (q | k | v per token), hidden = num_heads * head_dim
    cu_seqlens: [batch + 1] integer; sequence b is tokens cu_seqlens[b]:cu_seqlens[b + 1]
    Returns [num_tokens, hidden] in qkv.dtype: softmax(q k^T * scaling) v per sequence and head.
    """
    num_tokens, width = qkv.shape
    hidden = width // 3
    head_dim = hidden // num_heads
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=qkv.device)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds, bounds[1:]):
        q, k, v = qkv[start:end].float().view(end - start, 3, num_heads, head_dim).unbind(1)
        scores = torch.einsum("thd,nhd->htn", q, k) * scaling
        out[start:end] = torch.einsum("htn,nhd->thd", torch.softmax(scores, dim=-1), v).reshape(end - start, hidden)
    return out.to(qkv.dtype)


def check_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """The argument contract of every `apply_token_bitmask_` (reference, native, Triton):
    shapes, dtypes, devices and layout only, so it reads no tensor data (no host sync on CUDA).

    logits: [batch, vocab] float32 with contiguous rows that do not overlap (stride(1) == 1,
    stride(0) >= vocab); bitmask: [num_masked, ceil(vocab / 32)] int32; rows: [num_masked]
    int32; all on one device.
    Raises ValueError naming what does not fit.
    """
    name = "apply_token_bitmask_"
    tensors = {"logits": (logits, torch.float32), "bitmask": (bitmask, torch.int32), "rows": (rows, torch.int32)}
    if len({t.device for t, _ in tensors.values()}) != 1:
        devices = ", ".join(f"{n} {t.device}" for n, (t, _) in tensors.items())
        raise ValueError(f"{name}: tensors on different devices: {devices}")
    for n, (t, dtype) in tensors.items():
        if t.dtype != dtype:
            raise ValueError(f"{name}: {n} must be {dtype}, got {t.dtype}")
    if (
        logits.dim() != 2
        or bitmask.dim() != 2
        or rows.dim() != 1
        or bitmask.shape != (rows.shape[0], (logits.shape[1] + 31) // 32)
    ):
        raise ValueError(
            f"{name}: logits {tuple(logits.shape)}, bitmask {tuple(bitmask.shape)}, rows {tuple(rows.shape)} "
            "do not fit (logits [batch, vocab], bitmask [len(rows), ceil(vocab / 32)], rows [len(rows)])"
        )
    batch, vocab = logits.shape
    if vocab > 1 and logits.stride(1) != 1:
        raise ValueError(f"{name}: each row of logits must be contiguous, got strides {logits.stride()}")
    if batch > 1 and vocab > 0 and logits.stride(0) < vocab:
        # a broadcast (expanded) view: one write would land in several rows
        raise ValueError(f"{name}: rows of logits overlap in memory, got strides {logits.stride()}")


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Grammar mask of structured output, IN PLACE: for each k, logits[rows[k], t] = -inf for
    every token t whose bit in bitmask[k] is 0; other logits keep their bits, and rows of
    logits not in `rows` are untouched. Returns None.

    Layout: xgrammar's token bitmask (`xgrammar.allocate_token_bitmask`,
    `GrammarMatcher.fill_next_token_bitmask`): bit j (least significant first) of int32 word w
    allows token 32 w + j; bits of ids >= vocab are ignored.

    logits:  [batch, vocab] float32, contiguous rows, any device
    bitmask: [num_masked, ceil(vocab / 32)] int32, same device
    rows:    [num_masked] int32, same device, distinct, in 0..batch
    Raises ValueError for a contract `check_token_bitmask` rejects, a row outside 0..batch or
    a repeated row (reads `rows` on the host; nothing written then).
    """
    check_token_bitmask(logits, bitmask, rows)
    batch, vocab = logits.shape
    seen: set[int] = set()
    for k, row in enumerate(rows.tolist()):
        if not 0 <= row < batch:
            raise ValueError(f"apply_token_bitmask_: rows[{k}] = {row} is outside 0..{batch}")
        if row in seen:
            raise ValueError(f"apply_token_bitmask_: row {row} appears twice in rows")
        seen.add(row)
    if not seen or vocab == 0:
        return
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    # an arithmetic shift of a negative word still leaves bit j in place for the & 1
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]  # [num_masked, vocab]
    index = rows.long()
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def row_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's largest logit and where it is: (ids [B] int64, maxes [B] in logits.dtype) of
    logits [B, vocab]. Ties: the lowest index; a row holding a NaN: its first NaN, max NaN."""
    return torch.argmax(logits, dim=-1), logits.amax(dim=-1)


def fused_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """A mixture of experts' feed-forward after routing: out[t] = Σ_j weights[t, j] ·
    down_e(silu(gate_e(x[t])) · up_e(x[t])), e = ids[t, j], in float32, returned in x.dtype.

    x: [T, H]; gate_up: [E, 2I, H] (each expert's gate rows, then its up rows); down: [E, H, I];
    weights: [T, k] routing weights, applied as given; ids: [T, k] expert ids in 0..E."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            act = silu_and_mul(x[t].float() @ gate_up[e].float().T)
            out[t] += float(weights[t, j]) * (act @ down[e].float().T)
    return out.to(x.dtype)
