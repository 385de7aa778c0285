"""Reference attention backend in plain torch: writes each token's K/V into the paged KV pool,
then, request by request, gathers that request's K/V by slot and runs
`torch.nn.functional.scaled_dot_product_attention`.

Slow (a Python loop over requests) but simple and exact; faster backends are tested against it.
Only the worker thread calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pyserve.model_executor.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from pyserve.mem_cache.memory_pool import MHATokenToKVPool


@dataclass
class _ReqSpan:
    q_start: int  # first row of this request in the batch's token dim
    q_len: int  # new tokens of this request
    kv_start: int  # first entry of this request in kv_indices
    kv_len: int  # tokens the request attends to (prefix + new)
    mask: torch.Tensor | None  # [q_len, kv_len] bool, True = may attend; None = attend to all


class TorchNativeAttnBackend:
    """Paged attention over an `MHATokenToKVPool` using torch SDPA.

    Call `init_forward_metadata(forward_batch)` once per batch (it reads the batch's length
    arrays on the host), then `forward(...)` once per layer.
    """

    def __init__(self, kv_pool: "MHATokenToKVPool") -> None:
        self.kv_pool = kv_pool
        self._spans: list[_ReqSpan] = []

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Precompute per-request token ranges and causal masks of `forward_batch`.

        EXTEND: request i's new tokens sit at positions prefix_len .. seq_len - 1 and the new
        token at position p attends to keys 0..p (causal within the request).
        DECODE: one new token per request that attends to all seq_len keys.
        Raises ValueError if the batch's lengths are inconsistent.
        """
        seq_lens = forward_batch.seq_lens.tolist()
        kv_indptr = forward_batch.kv_indptr.tolist()
        if len(seq_lens) != forward_batch.batch_size or len(kv_indptr) != forward_batch.batch_size + 1:
            raise ValueError("seq_lens / kv_indptr do not match batch_size")
        device = forward_batch.input_ids.device
        spans: list[_ReqSpan] = []
        if forward_batch.forward_mode == ForwardMode.DECODE:
            for i, seq_len in enumerate(seq_lens):
                spans.append(_ReqSpan(i, 1, kv_indptr[i], seq_len, None))
        else:
            if forward_batch.extend_seq_lens is None or forward_batch.extend_prefix_lens is None:
                raise ValueError("EXTEND batch needs extend_seq_lens and extend_prefix_lens")
            extend_lens = forward_batch.extend_seq_lens.tolist()
            prefix_lens = forward_batch.extend_prefix_lens.tolist()
            q_start = 0
            for i, (seq_len, ext, pre) in enumerate(zip(seq_lens, extend_lens, prefix_lens)):
                if pre + ext != seq_len:
                    raise ValueError(f"request {i}: prefix {pre} + extend {ext} != seq_len {seq_len}")
                q_pos = torch.arange(pre, seq_len, device=device)
                k_pos = torch.arange(seq_len, device=device)
                mask = None if ext == 1 else k_pos[None, :] <= q_pos[:, None]
                spans.append(_ReqSpan(q_start, ext, kv_indptr[i], seq_len, mask))
                q_start += ext
        for i, span in enumerate(spans):
            if kv_indptr[i + 1] - kv_indptr[i] != span.kv_len:
                raise ValueError(f"request {i}: kv_indptr range != seq_len {span.kv_len}")
        self._spans = spans

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        scaling: float,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """Store k, v at forward_batch.out_cache_loc in layer `layer_id`'s buffers (mutates the
        pool), then attend.

        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]; num_heads must be a
        multiple of num_kv_heads (grouped-query attention: query head h reads KV head
        h // (num_heads / num_kv_heads)).
        scaling: softmax scale, usually head_dim ** -0.5.
        Returns [T, num_heads, head_dim] in q.dtype.
        """
        self.kv_pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k, v)
        k_buf = self.kv_pool.get_key_buffer(layer_id)
        v_buf = self.kv_pool.get_value_buffer(layer_id)
        num_heads, num_kv_heads = q.shape[1], k_buf.shape[1]
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        kv_indices = forward_batch.kv_indices
        for span in self._spans:
            slots = kv_indices[span.kv_start : span.kv_start + span.kv_len]
            # [kv_len, H_kv, D] -> [H_kv, kv_len, D]; repeat so each query head has its KV head.
            keys = k_buf[slots].transpose(0, 1).to(q.dtype)
            values = v_buf[slots].transpose(0, 1).to(q.dtype)
            if group > 1:
                keys = keys.repeat_interleave(group, dim=0)
                values = values.repeat_interleave(group, dim=0)
            query = q[span.q_start : span.q_start + span.q_len].transpose(0, 1)
            attn = F.scaled_dot_product_attention(
                query.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                attn_mask=span.mask, scale=scaling,
            )
            out[span.q_start : span.q_start + span.q_len] = attn.squeeze(0).transpose(0, 1)
        return out
