"""CPU attention backend (float32): DECODE batches run the native paged decode-attention
kernel of `pyserve_kernels`, which reads each request's K/V rows in place from the KV pool;
EXTEND batches run the torch reference (`TorchNativeAttnBackend`, one batched SDPA call),
except their one-token rows when longer rows share the batch (a mixed chunk: running
requests decoding inside a prefill step), which run the decode kernel: the reference pads
every row to the longest extend, so four decode rows beside a 256-token chunk would cost
five chunks' attention.

Why: in a decode step the reference gathers every request's cached K/V into a padded copy and
SDPA then reads that copy again; on the 2-core test machine that took ~2.4 ms per layer for 64
requests of ~180 tokens (SmolLM2-135M), the kernel ~0.6 ms. Prefill attention is a small part
of a prefill next to its GEMMs, so EXTEND keeps the reference. Only the worker thread calls it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pyserve.forward_batch_info import ForwardBatch, ForwardMode, kv_indptr_of
from pyserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from pyserve_kernels import native_available
from pyserve_kernels._native import _cpu, as_int_array


@dataclasses.dataclass(frozen=True)
class NativeDecodeMetadata:
    """A DECODE batch as the native decoder layer takes it: per layer the pool's K and V numpy
    views [num_slots, num_kv_heads, head_dim]; out_cache_loc [B], kv_indptr [B + 1] and
    kv_indices int32; the thread count of the kernels."""

    k_views: list[Any]
    v_views: list[Any]
    out_cache_loc: Any
    kv_indptr: Any
    kv_indices: Any
    num_threads: int


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
        """EXTEND: as `TorchNativeAttnBackend`. DECODE: keeps kv_indptr, kv_indices and
        out_cache_loc (int32 numpy views) for the kernels. Raises ValueError if a DECODE batch's kv_indptr does not span
        its seq_lens."""
        self.decode = forward_batch.forward_mode == ForwardMode.DECODE
        self.split: tuple[ForwardBatch, torch.Tensor, torch.Tensor] | None = None
        if not self.decode:
            extend_lens = forward_batch.extend_seq_lens
            single = None if extend_lens is None else extend_lens == 1
            if single is None or not bool(single.any()) or bool(single.all()):
                super().init_forward_metadata(forward_batch)
                return
            self._init_split(forward_batch, single)
            return
        self._init_decode(forward_batch)

    def native_decode_metadata(self) -> NativeDecodeMetadata | None:
        """The current batch's `NativeDecodeMetadata` when it is a pure DECODE batch, else None."""
        if not self.decode:
            return None
        return NativeDecodeMetadata(
            self._k_views, self._v_views, self._out_cache_loc, self._kv_indptr, self._kv_indices, self._num_threads
        )

    def _init_split(self, forward_batch: ForwardBatch, single: torch.Tensor) -> None:
        """A mixed EXTEND batch: the reference's metadata for its longer rows, the decode
        kernel's for its one-token rows (`single`: [B] bool)."""
        forward_batch.ensure_kv_indices()
        assert forward_batch.kv_indptr is not None and forward_batch.kv_indices is not None
        extend_lens = forward_batch.extend_seq_lens
        assert extend_lens is not None and forward_batch.extend_prefix_lens is not None
        token_single = torch.repeat_interleave(single, extend_lens)
        # rows and tokens selected by mask from an arange in the batch's index dtype (int32
        # from the worker), not by torch.nonzero, whose indices are always int64
        idx = extend_lens.dtype
        rows = torch.arange(single.shape[0], dtype=idx, device=single.device)
        tokens = torch.arange(token_single.shape[0], dtype=idx, device=single.device)
        long_rows, single_rows = rows[~single], rows[single]
        long_tokens, single_tokens = tokens[~token_single], tokens[token_single]
        indptr = forward_batch.kv_indptr
        long_seq = forward_batch.seq_lens[long_rows]
        long_indices = torch.cat(
            [forward_batch.kv_indices[int(indptr[r]) : int(indptr[r + 1])] for r in long_rows.tolist()]
        )
        sub = dataclasses.replace(
            forward_batch,
            batch_size=int(long_rows.shape[0]),
            input_ids=forward_batch.input_ids[long_tokens],
            positions=forward_batch.positions[long_tokens],
            out_cache_loc=forward_batch.out_cache_loc[long_tokens],
            seq_lens=long_seq,
            kv_indptr=kv_indptr_of(long_seq),
            kv_indices=long_indices,
            extend_prefix_lens=forward_batch.extend_prefix_lens[long_rows],
            extend_seq_lens=extend_lens[long_rows],
            req_pool_indices=None,
            max_extend_len=None,
        )
        super().init_forward_metadata(sub)
        single_seq = forward_batch.seq_lens[single_rows]
        single_indices = torch.cat(
            [forward_batch.kv_indices[int(indptr[r]) : int(indptr[r + 1])] for r in single_rows.tolist()]
        )
        dec = dataclasses.replace(
            forward_batch,
            forward_mode=ForwardMode.DECODE,
            batch_size=int(single_rows.shape[0]),
            out_cache_loc=forward_batch.out_cache_loc[single_tokens],
            seq_lens=single_seq,
            kv_indptr=kv_indptr_of(single_seq),
            kv_indices=single_indices,
        )
        self._init_decode(dec)
        self.split = (sub, long_tokens, single_tokens)

    def _init_decode(self, forward_batch: ForwardBatch) -> None:
        forward_batch.ensure_kv_indices()
        assert forward_batch.kv_indptr is not None and forward_batch.kv_indices is not None
        kv_indptr = forward_batch.kv_indptr
        if kv_indptr.shape[0] != forward_batch.batch_size + 1 or not torch.equal(
            kv_indptr[1:] - kv_indptr[:-1], forward_batch.seq_lens
        ):
            raise ValueError("kv_indptr does not match seq_lens / batch_size")
        # The kernels take int32, which a worker-built batch already is (no copy then); a
        # hand-built int64 batch is converted here, range-checked. The kernel checks the
        # values again on every call (cheap); only their layout is set here.
        self._kv_indptr = as_int_array(kv_indptr, torch.int32, "kv_indptr")
        self._kv_indices = as_int_array(forward_batch.kv_indices, torch.int32, "kv_indices")
        self._out_cache_loc = as_int_array(forward_batch.out_cache_loc, torch.int32, "out_cache_loc")
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
        if self.split is not None:  # a mixed EXTEND batch: long rows, then one-token rows
            sub, long_tokens, single_tokens = self.split
            out = torch.empty_like(q)
            out[long_tokens] = super().forward(
                q[long_tokens], k[long_tokens], v[long_tokens], layer_id, scaling, sub, sliding_window
            )
            out[single_tokens] = self._decode_forward(
                q[single_tokens], k[single_tokens], v[single_tokens], layer_id, scaling, sliding_window
            )
            return out
        if not self.decode:
            return super().forward(q, k, v, layer_id, scaling, forward_batch, sliding_window)
        return self._decode_forward(q, k, v, layer_id, scaling, sliding_window)

    def _decode_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        scaling: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Store k, v at the decode metadata's slots, then the native kernel."""
        k_view, v_view = self._k_views[layer_id], self._v_views[layer_id]
        # k, v may be strided views of the fused q|k|v row: the kernel takes contiguous rows.
        _cpu.store_kv(k_view, v_view, self._out_cache_loc, k.numpy(), v.numpy())
        q = q.contiguous()
        out = torch.empty_like(q)
        _cpu.decode_attention(
            q.numpy(),
            k_view,
            v_view,
            self._kv_indptr,
            self._kv_indices,
            out.numpy(),
            scaling,
            sliding_window,
            self._num_threads,
        )
        return out
