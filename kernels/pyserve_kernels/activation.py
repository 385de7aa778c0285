"""SwiGLU's silu(gate) * up: the Triton kernel on CUDA, the native CPU kernel for float32 CPU
tensors, else the torch reference."""

from __future__ import annotations

import torch

from pyserve_kernels import reference
from pyserve_kernels._native import _cpu, native_applies
from pyserve_kernels._triton import triton_applies


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] with d = x.shape[-1] // 2 (see `reference.silu_and_mul`).

    x: [..., 2 * intermediate]. Returns a new [..., intermediate] tensor in x.dtype.
    Raises ValueError if the last dim is odd.
    """
    if x.shape[-1] % 2 == 0 and triton_applies(x):
        from pyserve_kernels.triton_ops.activation import silu_and_mul as triton_silu_and_mul

        return triton_silu_and_mul(x)
    if x.shape[-1] % 2 or not native_applies(x) or x.numel() == 0:
        return reference.silu_and_mul(x)
    out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    _cpu.silu_and_mul(x.numpy(), out.numpy(), torch.get_num_threads())
    return out
