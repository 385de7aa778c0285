"""When the top-level ops run their Triton kernels: every tensor on CUDA and triton importable.
(On CPU the native kernels or the references run; tests call `triton_ops` directly under
TRITON_INTERPRET=1.)"""

from __future__ import annotations

import functools

import torch


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_applies(*tensors: torch.Tensor) -> bool:
    """True when all `tensors` are CUDA tensors and triton is importable."""
    return all(t.is_cuda for t in tensors) and triton_available()
