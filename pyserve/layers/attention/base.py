"""`AttentionBackend`: the interface every attention backend implements (DESIGN.md section 7).

A backend stores each new token's K/V into the paged KV pool and attends over each request's
cached tokens. Per batch the runner calls `init_forward_metadata(forward_batch)` once, then
each layer calls `forward(...)`. Forward is pure and sync-free on backends that support CUDA
graphs: it reads only the ForwardBatch and the metadata made for it, writes only the KV pool
and its output, and never reads device data on the host.

Backends that can be captured derive from `CapturableAttentionBackend`, which adds the
CUDA-graph hooks (`init_cuda_graph_state`, `init_forward_metadata_capture/replay`) and sets
`supports_cuda_graph`. Only the worker thread calls a backend.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from pyserve.forward_batch_info import ForwardBatch

if TYPE_CHECKING:
    from pyserve.mem_cache.memory_pool import MHATokenToKVPool


class AttentionBackend(abc.ABC):
    """Paged attention over one `MHATokenToKVPool`.

    name: the `--attention-backend` value that selects it (see `registry.py`).
    requirement: what `supported` checks, in words (for the error when it is not met).
    supports_cuda_graph: whether DECODE steps through it can be captured and replayed.
    """

    name: ClassVar[str]
    supports_cuda_graph: ClassVar[bool] = False
    requirement: ClassVar[str] = ""  # what `supported` needs, for error messages

    def __init__(self, kv_pool: MHATokenToKVPool) -> None:
        self.kv_pool = kv_pool

    @classmethod
    def available(cls) -> bool:
        """Whether what the backend needs is installed here (whatever the pool)."""
        return True

    @classmethod
    def supported(cls, kv_pool: MHATokenToKVPool) -> bool:
        """Whether this backend can serve `kv_pool` (its device and dtype) here."""
        return True

    @abc.abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Precompute what every layer of `forward_batch` shares (once per batch)."""

    def native_decode_metadata(self) -> Any:
        """What a whole native decoder layer needs of the current batch
        (`pyserve.models.native_decode`), or None: the batch is not a pure DECODE batch this
        backend can hand over (the default)."""
        return None

    @abc.abstractmethod
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
        """Store k, v at forward_batch.out_cache_loc in layer `layer_id`'s buffers (mutates
        the pool), then attend.

        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (may be strided views
        of a fused q|k|v row); query head h reads KV head h // (num_heads / num_kv_heads).
        scaling: softmax scale. sliding_window: None, or W: a query at position p sees keys
        p - W + 1 .. p only. Returns [T, num_heads, head_dim] in q.dtype.
        """


class CapturableAttentionBackend(AttentionBackend):
    """An AttentionBackend whose DECODE steps can be captured in CUDA graphs and replayed.

    `init_cuda_graph_state(max_bs)` allocates what captured steps of up to max_bs requests
    need at fixed addresses; `init_forward_metadata_capture` / `init_forward_metadata_replay`
    set the metadata of a padded DECODE batch whose tensors are the graph runner's static
    buffers (replay must not allocate or read device data on the host).
    """

    supports_cuda_graph: ClassVar[bool] = True

    @abc.abstractmethod
    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Allocate the fixed-address state of captured DECODE steps of up to max_bs requests."""

    @abc.abstractmethod
    def init_forward_metadata_capture(self, forward_batch: ForwardBatch) -> None:
        """Metadata of the DECODE batch about to be captured (its tensors are static buffers)."""

    @abc.abstractmethod
    def init_forward_metadata_replay(self, forward_batch: ForwardBatch) -> None:
        """Metadata of a captured DECODE batch about to be replayed."""
