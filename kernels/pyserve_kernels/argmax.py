"""Greedy decoding's row argmax (each row's largest logit and its index): the native CPU kernel
for float32 CPU tensors, else torch (`reference.row_argmax`)."""

from __future__ import annotations

import torch

from pyserve_kernels import reference
from pyserve_kernels._native import _cpu, native_applies


def row_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B] int64, maxes [B]) of logits [B, vocab] (vocab > 0), on logits' device: ids[r]
    the index of row r's largest value (ties: the lowest index; a row holding a NaN: its first
    NaN) and maxes[r] that value (NaN for such a row), as `torch.argmax` and `torch.amax`.

    On CPU float32 the native kernel does both in two vectorized passes per row, on torch's
    OpenMP team (`torch.argmax` compares one value at a time: 3.2 ms against ~0.3 ms for a
    [64, 49152] batch on the 2-core test machine). Runs on the calling thread (the worker).
    Raises ValueError for logits that are not 2-D or have no columns.
    """
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"row_argmax takes logits [batch, vocab > 0], got {list(logits.shape)}")
    if not native_applies(logits):
        return reference.row_argmax(logits)
    ids = torch.empty(logits.shape[0], dtype=torch.int64)
    maxes = torch.empty(logits.shape[0], dtype=torch.float32)
    _cpu.row_argmax(logits.numpy(), ids.numpy(), maxes.numpy(), torch.get_num_threads())
    return ids, maxes
