"""CPU attention backend (float32): DECODE batches run the native paged decode-attention
kernel of `pyserve_kernels`, which reads each request's K/V rows in place from the KV pool;
EXTEND batches run the torch reference (`TorchNativeAttnBackend`, one batched SDPA call).

Why: in a decode step the reference gathers every request's cached K/V into a padded copy and
SDPA then reads that copy again; on the 2-core test machine that took ~2.4 ms per layer for 64
requests of ~180 tokens (SmolLM2-135M), the kernel ~0.6 ms. Prefill attention is a small part
of a prefill next to its GEMMs, so EXTEND keeps the reference. Only the worker thread calls it.
"""

from __future__ import annotations

import torch
from pyserve_kernels import native_available
from pyserve_kernels._native import _cpu

from pyserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from pyserve.forward_batch_info import ForwardBatch, ForwardMode


class CpuAttnBackend(TorchNativeAttnBackend):
    """Paged attention over an `MHATokenToKVPool` whose buffers are float32 on CPU.

    `CpuAttnBackend.supported(kv_pool)` says whether it can serve a pool. Same interface as
    `TorchNativeAttnBackend`: `init_forward_metadata(forward_batch)` once per batch, then
    `forward(...)` once per layer. In DECODE it calls `pyserve_kernels._cpu` directly on
    numpy views (no copies) of the pool, made once, and of the batch's index arrays, made
    once per batch and checked there, so a layer costs two native calls and no per-layer
    conversions (about 5 ms less per 30-layer step than through the checked public wrappers
    `pyserve_kernels.decode_attention` / `store_kv`, which compute the same).
    """

    name = "cpu"
    requirement = "float32 KV buffers on CPU and the native pyserve_kernels._cpu module"

    def __init__(self, kv_pool) -> None:
        super().__init__(kv_pool)
        if not self.supported(kv_pool):
            raise ValueError("CpuAttnBackend needs a float32 CPU KV pool and pyserve_kernels._cpu")
        self._k_views = [kv_pool.get_key_buffer(i).numpy() for i in range(kv_pool.num_layers)]
        self._v_views = [kv_pool.get_value_buffer(i).numpy() for i in range(kv_pool.num_layers)]

    @classmethod
    def supported(cls, kv_pool) -> bool:
        """Whether the pool's buffers are float32 on CPU and the native kernel is built."""
        k = kv_pool.get_key_buffer(0)
        return k.device.type == "cpu" and k.dtype == torch.float32 and native_available()

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """EXTEND: as `TorchNativeAttnBackend`. DECODE: keeps kv_indptr (int64) and kv_indices
        (int32) for the kernel. Raises ValueError if a DECODE batch's kv_indptr does not span
        its seq_lens."""
        self.decode = forward_batch.forward_mode == ForwardMode.DECODE
        if not self.decode:
            super().init_forward_metadata(forward_batch)
            return
        forward_batch.ensure_kv_indices()
        assert forward_batch.kv_indptr is not None and forward_batch.kv_indices is not None
        kv_indptr = forward_batch.kv_indptr.to(torch.int64)
        if kv_indptr.shape[0] != forward_batch.batch_size + 1 or not torch.equal(
                kv_indptr[1:] - kv_indptr[:-1], forward_batch.seq_lens.to(torch.int64)):
            raise ValueError("kv_indptr does not match seq_lens / batch_size")
        # The kernel checks these again on every call (cheap); only their layout is set here.
        self._kv_indptr = kv_indptr.contiguous().numpy()
        self._kv_indices = forward_batch.kv_indices.to(torch.int32).contiguous().numpy()
        self._out_cache_loc = forward_batch.out_cache_loc.to(torch.int64).contiguous().numpy()
        self._num_threads = torch.get_num_threads()

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
        """As `TorchNativeAttnBackend.forward` (q [T, num_heads, head_dim], k, v [T,
        num_kv_heads, head_dim] float32; stores k, v at out_cache_loc, then attends); DECODE
        through the native kernel. Returns [T, num_heads, head_dim] float32."""
        if not self.decode:
            return super().forward(q, k, v, layer_id, scaling, forward_batch, sliding_window)
        k_view, v_view = self._k_views[layer_id], self._v_views[layer_id]
        # k, v may be strided views of the fused q|k|v row: the kernel takes contiguous rows.
        _cpu.store_kv(k_view, v_view, self._out_cache_loc, k.numpy(), v.numpy())
        q = q.contiguous()
        out = torch.empty_like(q)
        _cpu.decode_attention(q.numpy(), k_view, v_view, self._kv_indptr, self._kv_indices,
                              out.numpy(), scaling, sliding_window, self._num_threads)
        return out
