"""Reference attention backend in plain torch: writes each token's K/V into the paged KV pool,
gathers every request's K/V by slot into one padded [B, H_kv, L, D] tensor per layer and runs
ONE `torch.nn.functional.scaled_dot_product_attention` call for the whole batch (EXTEND or
DECODE), with a boolean mask for causality, padding and sliding windows.

Per batch, `init_forward_metadata` builds the padded slot table and the masks once; per layer,
`forward` costs one gather of K and V, one SDPA call and one scatter of the outputs (no Python
loop over requests). Only the worker thread calls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pyserve.forward_batch_info import ForwardBatch, ForwardMode
from pyserve.layers.attention.base import AttentionBackend

if TYPE_CHECKING:
    from pyserve.mem_cache.memory_pool import MHATokenToKVPool


class TorchNativeAttnBackend(AttentionBackend):
    """Paged attention over an `MHATokenToKVPool` using batched torch SDPA.

    Call `init_forward_metadata(forward_batch)` once per batch (it reads the batch's lengths
    on the host), then `forward(...)` once per layer.

    Batch metadata (B requests, Q = longest extend length (1 in DECODE), L = longest seq_len):
      slot_table: [B, L] kv_indices' dtype (int32 from the worker)  KV slot of key j of
                  request b (0, the padding slot, past its end)
      key_pos:    [L] seq_lens' dtype  position of each key (j)
      query_pos:  [B, Q] seq_lens' dtype  absolute position of each padded query row
      query_rows: [T] seq_lens' dtype  row b * Q + j of the padded query grid for each token
    """

    name = "torch_native"
    requirement = "any device and dtype"

    def __init__(self, kv_pool: MHATokenToKVPool) -> None:
        super().__init__(kv_pool)
        self._masks: dict[tuple[int, int | None, torch.dtype], torch.Tensor] = {}

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Precompute the padded slot table, query layout and (lazily) masks of the batch.

        EXTEND: request b's new tokens sit at positions prefix_len .. seq_len - 1; the token at
        position p attends to keys 0..p (causal within the request).
        DECODE: one new token per request that attends to all seq_len keys.
        Raises ValueError if the batch's lengths are inconsistent.
        """
        forward_batch.ensure_kv_indices()
        batch = forward_batch.batch_size
        seq_lens = forward_batch.seq_lens
        kv_indptr = forward_batch.kv_indptr
        assert kv_indptr is not None and forward_batch.kv_indices is not None
        if seq_lens.shape[0] != batch or kv_indptr.shape[0] != batch + 1:
            raise ValueError("seq_lens / kv_indptr do not match batch_size")
        if not torch.equal(kv_indptr[1:] - kv_indptr[:-1], seq_lens):
            i = int(torch.nonzero(kv_indptr[1:] - kv_indptr[:-1] != seq_lens)[0, 0])
            raise ValueError(f"request {i}: kv_indptr range != seq_len {int(seq_lens[i])}")
        device = forward_batch.input_ids.device
        max_len = int(seq_lens.max()) if batch else 0
        idx = seq_lens.dtype  # int32 from the worker: the metadata stays in the batch's dtype
        key_pos = torch.arange(max_len, device=device, dtype=idx)
        key_valid = key_pos[None, :] < seq_lens[:, None]
        flat = (kv_indptr[:-1, None] + key_pos[None, :]).clamp_(max=max(forward_batch.kv_indices.numel() - 1, 0))
        self.slot_table = torch.where(key_valid, forward_batch.kv_indices[flat], 0)
        if forward_batch.forward_mode == ForwardMode.DECODE:
            self.max_q = 1
            self.query_pos = (seq_lens - 1)[:, None]
            self.query_valid = torch.ones(batch, 1, dtype=torch.bool, device=device)
            self.query_rows = None
        else:
            prefix_lens, extend_lens = forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens
            if extend_lens is None or prefix_lens is None:
                raise ValueError("EXTEND batch needs extend_seq_lens and extend_prefix_lens")
            if not torch.equal(prefix_lens + extend_lens, seq_lens):
                i = int(torch.nonzero(prefix_lens + extend_lens != seq_lens)[0, 0])
                raise ValueError(
                    f"request {i}: prefix {int(prefix_lens[i])} + extend "
                    f"{int(extend_lens[i])} != seq_len {int(seq_lens[i])}"
                )
            self.max_q = int(extend_lens.max())
            q_idx = torch.arange(self.max_q, device=device, dtype=idx)
            self.query_pos = prefix_lens[:, None] + q_idx[None, :]
            self.query_valid = q_idx[None, :] < extend_lens[:, None]
            self.query_rows = (torch.arange(batch, device=device, dtype=idx)[:, None] * self.max_q + q_idx[None, :])[
                self.query_valid
            ]
            # Every request extends by max_q tokens: the padded grid is the batch itself.
            self.query_dense = self.query_rows.shape[0] == batch * self.max_q
        self.key_pos = key_pos
        self.key_valid = key_valid
        self._masks = {}

    def _mask(self, group: int, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """Additive float mask, 0 = may attend, -inf = may not: [B, 1, 1, L] in DECODE (shared
        by the query heads of a group), [B, 1, group * Q, L] in EXTEND (query rows are
        head-group-major). Additive float masks run torch's CPU SDPA about 2x faster than
        boolean ones."""
        key = (group, sliding_window, dtype)
        mask = self._masks.get(key)
        if mask is None:
            q_pos = self.query_pos[:, :, None]
            k_pos = self.key_pos[None, None, :]
            allowed = (k_pos <= q_pos) & self.key_valid[:, None, :]
            if sliding_window is not None:
                allowed &= k_pos > q_pos - sliding_window
            # Padding query rows would see no key (NaN); let them see key 0, output is dropped.
            allowed[:, :, 0] |= ~self.query_valid
            batch, max_q, max_len = allowed.shape
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            mask.masked_fill_(~allowed, float("-inf"))
            if self.query_rows is None:
                mask = mask[:, None]
            else:
                mask = mask[:, None].expand(batch, group, max_q, max_len).reshape(batch, 1, group * max_q, max_len)
            self._masks[key] = mask
        return mask

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        scaling: float,
        forward_batch: ForwardBatch,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Store k, v at forward_batch.out_cache_loc in layer `layer_id`'s buffers (mutates the
        pool), then attend.

        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]; num_heads must be a
        multiple of num_kv_heads (grouped-query attention: query head h reads KV head
        h // (num_heads / num_kv_heads)).
        scaling: softmax scale, usually head_dim ** -0.5.
        sliding_window: None, or W: a query at position p sees keys p - W + 1 .. p only.
        Returns [T, num_heads, head_dim] in q.dtype.
        """
        self.kv_pool.set_kv_buffer(layer_id, forward_batch.out_cache_loc, k, v)
        k_buf = self.kv_pool.get_key_buffer(layer_id)
        v_buf = self.kv_pool.get_value_buffer(layer_id)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_buf.shape[1]
        group = num_heads // num_kv_heads
        batch, max_q = self.slot_table.shape[0], self.max_q
        # [B, L, H_kv, D] -> [B, H_kv, L, D]; index_select on the flat table is ~3x faster on
        # CPU than advanced indexing with the 2-D table.
        max_len = self.slot_table.shape[1]
        flat = self.slot_table.reshape(-1)
        keys = k_buf.index_select(0, flat).view(batch, max_len, num_kv_heads, head_dim)
        values = v_buf.index_select(0, flat).view(batch, max_len, num_kv_heads, head_dim)
        keys = keys.transpose(1, 2).to(q.dtype)
        values = values.transpose(1, 2).to(q.dtype)
        if self.query_rows is None:  # DECODE: one query per request
            query = q.view(batch, num_kv_heads, group, head_dim)
        else:
            if self.query_dense:
                padded = q
            else:
                padded = q.new_zeros(batch * max_q, num_heads, head_dim)
                padded[self.query_rows] = q
            # [B, Q, H_kv, G, D] -> [B, H_kv, G * Q, D] so each KV head serves its query heads.
            query = (
                padded.view(batch, max_q, num_kv_heads, group, head_dim)
                .permute(0, 2, 3, 1, 4)
                .reshape(batch, num_kv_heads, group * max_q, head_dim)
            )
        attn = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=self._mask(group, sliding_window, q.dtype), scale=scaling
        )
        if self.query_rows is None:
            return attn.reshape(num_tokens, num_heads, head_dim)
        out = (
            attn.view(batch, num_kv_heads, group, max_q, head_dim)
            .permute(0, 3, 1, 2, 4)
            .reshape(batch * max_q, num_heads, head_dim)
        )
        return out if self.query_dense else out[self.query_rows]
