"""The device-side description of one model step (ForwardBatch) and its mode.

A ForwardBatch is built on the loop thread from the arrays the Rust core returns
(`pyserve._rs.KVCache.prepare_extend` / `prepare_decode`) and consumed on the worker thread by
`ModelRunner.forward`. It holds only tensors and plain numbers, never request objects.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class ForwardMode(enum.Enum):
    """EXTEND computes new tokens on top of a (possibly empty) cached prefix; DECODE computes
    exactly one new token per request."""

    EXTEND = enum.auto()
    DECODE = enum.auto()


@dataclass
class SamplingBatchInfo:
    """Per-request sampling parameters of one batch, as tensors on the model device.

    temperatures: [batch] float32; 0 means greedy.
    top_ps:       [batch] float32 in (0, 1].
    top_ks:       [batch] int64; a value >= vocab_size means "all tokens".
    generators:   one `torch.Generator` or None per request (seeded requests).
    """

    temperatures: torch.Tensor
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    generators: list = field(default_factory=list)

    @property
    def is_all_greedy(self) -> bool:
        return bool((self.temperatures == 0).all())


@dataclass
class ForwardBatch:
    """All inputs of one forward pass.

    Shapes (B = batch_size, T = num_tokens; T == B in DECODE):
      input_ids:     [T] int64   token ids to compute
      positions:     [T] int64   absolute position of each token in its sequence
      out_cache_loc: [T] int64   KV pool slot that receives each token's K and V
      seq_lens:      [B] int64   tokens per request after this step (prefix + new)
      extend_prefix_lens / extend_seq_lens: [B] int64 (EXTEND only) cached and new tokens
      kv_indptr:     [B + 1] int64  CSR offsets into kv_indices
      kv_indices:    [sum(seq_lens)] int64  KV slots of every token of request i, in order,
                     at kv_indices[kv_indptr[i]:kv_indptr[i + 1]] (new tokens included)
    All tensors are on the model device.
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    extend_prefix_lens: torch.Tensor | None = None
    extend_seq_lens: torch.Tensor | None = None
    sampling_info: SamplingBatchInfo | None = None
