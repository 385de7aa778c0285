"""Triton attention backend: the default on CUDA (DESIGN.md section 7).

K/V of the new tokens are stored by the Triton K/V-store kernel; EXTEND runs the paged
extend-attention kernel (a cached prefix read in place, causal within the new tokens) and
DECODE the split-KV decode kernel (flash-decoding), both reading each request's slots through
its row of the worker's req_to_token table, so no per-batch kv_indices are built. Nothing here
reads device data on the host: DECODE steps can be captured in CUDA graphs (what a captured
launcher allocates, e.g. the split-KV partial results, comes from the graph's private memory
pool and keeps its address on every replay). On CPU it runs only under
TRITON_INTERPRET=1 (tests, small shapes). Only the worker thread calls it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from pyserve.forward_batch_info import ForwardBatch, ForwardMode
from pyserve.layers.attention.base import CapturableAttentionBackend
from pyserve_kernels._triton import triton_available

if TYPE_CHECKING:
    from pyserve.mem_cache.memory_pool import MHATokenToKVPool

# KV splits of a decode step: fixed, so a captured step needs no host decision (a request
# shorter than the splits leaves some of them empty).
NUM_KV_SPLITS = 8


class TritonAttnBackend(CapturableAttentionBackend):
    """Paged attention through `pyserve_kernels.triton_ops` over an `MHATokenToKVPool`.

    Per batch: EXTEND keeps qo_indptr ([B + 1], the new tokens' CSR offsets, computed on the
    device in extend_seq_lens' dtype: int32 from the worker) and the host int max_extend_len
    of the plan; DECODE keeps nothing but the batch's own tensors (req_to_token rows,
    req_pool_indices, seq_lens).
    """

    name = "triton"
    requirement = "triton, and a CUDA KV pool (on CPU only with TRITON_INTERPRET=1)"

    def __init__(self, kv_pool: MHATokenToKVPool) -> None:
        super().__init__(kv_pool)
        from pyserve_kernels.triton_ops import decode_attention, extend_attention, kv_store

        self._decode = decode_attention.decode_attention_fwd
        self._extend = extend_attention.extend_attention_fwd
        self._store = kv_store.store_kv
        self.decode = False

    @classmethod
    def available(cls) -> bool:
        return triton_available()

    @classmethod
    def supported(cls, kv_pool: MHATokenToKVPool) -> bool:
        if not triton_available():
            return False
        device = kv_pool.get_key_buffer(0).device.type
        return device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """EXTEND: qo_indptr on the device and max_extend_len from the plan (host). Raises
        ValueError when the batch lacks its request rows or an EXTEND batch its lengths."""
        if forward_batch.req_to_token is None or forward_batch.req_pool_indices is None:
            raise ValueError("the triton backend reads K/V through req_to_token rows: the batch has none")
        self.decode = forward_batch.forward_mode == ForwardMode.DECODE
        if self.decode:
            return
        lens = forward_batch.extend_seq_lens
        if lens is None or forward_batch.extend_prefix_lens is None:
            raise ValueError("EXTEND batch needs extend_seq_lens and extend_prefix_lens")
        if forward_batch.max_extend_len is None:
            raise ValueError("EXTEND batch needs max_extend_len (the host maximum of extend_seq_lens)")
        self.qo_indptr = torch.zeros(lens.shape[0] + 1, dtype=lens.dtype, device=lens.device)
        torch.cumsum(lens, dim=0, dtype=lens.dtype, out=self.qo_indptr[1:])

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
        """As `AttentionBackend.forward`: stores k, v, then attends; [T, H, D] in q.dtype (q
        may be a strided view of the fused q|k|v row: the kernels take its strides)."""
        k_buf = self.kv_pool.get_key_buffer(layer_id)
        v_buf = self.kv_pool.get_value_buffer(layer_id)
        self._store(k_buf, v_buf, forward_batch.out_cache_loc, k, v)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        req_to_token, rows = forward_batch.req_to_token, forward_batch.req_pool_indices
        # (init_forward_metadata raised if any of these were missing; this narrows the types)
        assert req_to_token is not None and rows is not None
        if self.decode:
            return self._decode(
                q,
                k_buf,
                v_buf,
                req_to_token,
                rows,
                forward_batch.seq_lens,
                scaling,
                sliding_window=sliding_window,
                num_kv_splits=NUM_KV_SPLITS,
                out=out,
            )
        prefix_lens, extend_lens = forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens
        max_extend_len = forward_batch.max_extend_len
        assert prefix_lens is not None and extend_lens is not None and max_extend_len is not None
        return self._extend(
            q,
            k_buf,
            v_buf,
            req_to_token,
            rows,
            prefix_lens,
            extend_lens,
            self.qo_indptr,
            max_extend_len,
            scaling,
            sliding_window=sliding_window,
            out=out,
        )

    # ---- CUDA graphs ---------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Nothing to preallocate: captured launchers allocate from the graph's pool."""

    def init_forward_metadata_capture(self, forward_batch: ForwardBatch) -> None:
        self.init_forward_metadata(forward_batch)

    def init_forward_metadata_replay(self, forward_batch: ForwardBatch) -> None:
        self.decode = True
