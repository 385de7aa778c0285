"""`CudaGraphRunner`: DECODE steps replayed from CUDA graphs (DESIGN.md section 7).

A decode step of a small batch is mostly kernel-launch overhead on a fast GPU. At start-up the
worker captures the model's decode forward (embedding to logits) once per padded batch size,
on its own stream, into one shared memory pool; a step of B requests then copies its inputs
into the graphs' static buffers, pads them to the smallest captured size >= B and replays
that graph (one launch). Padding rows decode token 0 at position 0 over one key and write
their K/V into slot 0, the padding slot no request owns; their logits are dropped. Every
kernel is run once before its capture (Triton compiles on first launch). Batches larger than
the largest captured size, EXTEND batches and batches asking for prompt logits run eagerly.

Batch sizes: SGLang's rule: 1, 2, 4, 8, then every multiple of 8 up to `--cuda-graph-max-bs`
(default 256; itself included), or exactly `--cuda-graph-bs`; sizes above what the server can run
(`--max-running-requests`) are dropped, keeping the smallest one that covers it.
Worker thread only.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import Any

import torch

from pyserve.forward_batch_info import ForwardBatch, ForwardMode
from pyserve.layers.attention.base import CapturableAttentionBackend

logger = logging.getLogger(__name__)

DEFAULT_CUDA_GRAPH_MAX_BS = 256


def capture_batch_sizes(
    max_running_requests: int, cuda_graph_max_bs: int | None = None, cuda_graph_bs: list[int] | None = None
) -> list[int]:
    """The padded batch sizes to capture, ascending (see the module docstring).

    Raises ValueError for a non-positive size."""
    if cuda_graph_bs:
        sizes = sorted(set(int(b) for b in cuda_graph_bs))
    else:
        max_bs = DEFAULT_CUDA_GRAPH_MAX_BS if cuda_graph_max_bs is None else int(cuda_graph_max_bs)
        sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 8))
        if max_bs not in sizes:
            sizes.append(max_bs)
    if not sizes or sizes[0] <= 0:
        raise ValueError(f"CUDA graph batch sizes must be >= 1, got {sizes}")
    needed = [b for b in sizes if b < max_running_requests]
    cover = [b for b in sizes if b >= max_running_requests]
    return needed + cover[:1]


def padded_batch_size(sizes: list[int], batch_size: int) -> int | None:
    """The smallest of `sizes` (ascending) holding `batch_size` requests, or None (eager)."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


class CudaGraphRunner:
    """Captured decode graphs of `forward` (ForwardBatch -> logits [B, vocab] float32).

    forward: the model's forward over an attention backend already given its metadata;
    attn_backend: an AttentionBackend with supports_cuda_graph; req_to_token: the worker's
    table (DeviceState.req_to_token), whose address the graphs keep; sizes: ascending batch
    sizes; stream: the worker's CUDA stream.
    """

    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor],
        attn_backend: CapturableAttentionBackend,
        req_to_token: torch.Tensor,
        sizes: list[int],
        stream: torch.cuda.Stream,
    ) -> None:
        self.forward = forward
        self.attn_backend = attn_backend
        self.req_to_token = req_to_token
        self.sizes = sizes
        self.max_bs = sizes[-1]
        device = req_to_token.device
        # int32, as the worker's batches are: the replay copies convert nothing
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int32, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int32, device=device)
        self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int32, device=device)
        self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # [max_bs, vocab] float32: every graph's output
        self.pool: Any = None  # the graphs' shared memory pool (torch's handle type is private)
        attn_backend.init_cuda_graph_state(self.max_bs)
        self._capture_all(stream)

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            seq_lens=self.seq_lens[:bs],
            kv_indptr=None,
            kv_indices=None,
            req_pool_indices=self.req_pool_indices[:bs],
            req_to_token=self.req_to_token,
        )

    def _capture_all(self, stream: torch.cuda.Stream) -> None:
        # largest first: the smaller graphs reuse the pool the largest one sized
        with torch.cuda.stream(stream), torch.inference_mode():
            for bs in reversed(self.sizes):
                batch = self._batch(bs)
                for _ in range(2):  # warm up: every kernel compiled and autotuned before capture
                    self.attn_backend.init_forward_metadata_capture(batch)
                    warm = self.forward(batch)
                if self.logits is None:
                    self.logits = torch.empty(self.max_bs, warm.shape[1], dtype=warm.dtype, device=warm.device)
                del warm
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                self.attn_backend.init_forward_metadata_capture(batch)
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    # into the one shared buffer: no graph keeps its own logits alive, so the
                    # pool holds only the largest graph's transient activations
                    self.logits[:bs].copy_(self.forward(batch))
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bs] = graph
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether `batch` replays a graph: DECODE, at most max_bs requests, the captured
        req_to_token table, no prompt logits asked."""
        return (
            batch.forward_mode == ForwardMode.DECODE
            and batch.batch_size <= self.max_bs
            and batch.req_to_token is self.req_to_token
            and batch.input_logits_rows is None
        )

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, vocab] float32 of `batch` (see can_run), from its padded graph. The
        static buffers' padding rows are reset on every replay (a larger batch before may
        have left real values there)."""
        bs = batch.batch_size
        padded = padded_batch_size(self.sizes, bs)
        assert padded is not None
        self.input_ids[:bs].copy_(batch.input_ids, non_blocking=True)
        self.positions[:bs].copy_(batch.positions, non_blocking=True)
        self.out_cache_loc[:bs].copy_(batch.out_cache_loc, non_blocking=True)
        self.seq_lens[:bs].copy_(batch.seq_lens, non_blocking=True)
        assert batch.req_pool_indices is not None
        self.req_pool_indices[:bs].copy_(batch.req_pool_indices, non_blocking=True)
        if padded > bs:
            pad_rows(self, bs, padded)
        self.attn_backend.init_forward_metadata_replay(self._batch(padded))
        self.graphs[padded].replay()
        assert self.logits is not None
        return self.logits[:bs]  # valid until the next replay (the worker samples before it)


def pad_rows(buffers: CudaGraphRunner, start: int, end: int) -> None:
    """Padding rows start..end-1 of the static buffers: token 0 at position 0, one key, K/V
    into slot 0 (the padding slot), request row 0 (only read)."""
    buffers.input_ids[start:end].zero_()
    buffers.positions[start:end].zero_()
    buffers.out_cache_loc[start:end].zero_()
    buffers.seq_lens[start:end].fill_(1)
    buffers.req_pool_indices[start:end].zero_()
