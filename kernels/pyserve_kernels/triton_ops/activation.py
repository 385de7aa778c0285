"""Triton SwiGLU gate silu(gate) * up over a fused [gate | up] row (the CUDA path of
`pyserve_kernels.silu_and_mul`; semantics: `pyserve_kernels.reference.silu_and_mul`).

Algorithm: Shazeer, "GLU Variants Improve Transformer" (2020).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    intermediate,
    x_s0,
    x_s1,
    out_s0,
    out_s1,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    x_row = x_ptr + row * x_s0
    gate = tl.load(x_row + cols * x_s1, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + (cols + intermediate) * x_s1, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    # Rounded to the input dtype before the multiply, as the reference's
    # `silu(gate) * up` rounds silu's result (a no-op for float32).
    silu = silu.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_s0 + cols * out_s1, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """t as a [rows, cols] view (no copy, so writes into out reach the caller's tensor)."""
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"silu_and_mul: {name} {tuple(t.shape)} with strides {t.stride()} "
            "cannot be viewed as [rows, cols] without a copy"
        ) from None


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] with d = x.shape[-1] // 2: silu in float32, rounded to
    x.dtype, times up in float32, rounded to x.dtype (as `reference.silu_and_mul`).

    x:   [..., 2 * intermediate] float32 / float16 / bfloat16, cuda (gate then up,
         concatenated); any strides
    out: None (a new tensor is allocated), or [..., intermediate] in x.dtype on x's device,
         written IN PLACE; must not overlap x. x is not modified.
    Returns out (or the new tensor). Host-sync-free: reads only shapes and strides.
    Raises ValueError for an odd (or missing) last dim, an unsupported dtype, an out of the
    wrong shape or dtype, tensors on different devices, a tensor not viewable as [rows, cols],
    or CPU tensors outside TRITON_INTERPRET=1.
    """
    if out is not None and out.device != x.device:
        raise ValueError(f"silu_and_mul: x on {x.device}, out on {out.device}")
    if x.device.type != "cuda" and isinstance(_silu_and_mul_kernel, triton.runtime.JITFunction):
        raise ValueError(
            f"silu_and_mul: x on {x.device}; the Triton kernel needs CUDA tensors "
            "(CPU tensors only under TRITON_INTERPRET=1)"
        )
    if x.dtype not in _DTYPES:
        raise ValueError(f"silu_and_mul: x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim of x {tuple(x.shape)} must be even (gate then up)")
    intermediate = x.shape[-1] // 2
    out_shape = (*x.shape[:-1], intermediate)
    if out is None:
        out = x.new_empty(out_shape)
    elif out.shape != out_shape or out.dtype != x.dtype:
        raise ValueError(f"silu_and_mul: out {tuple(out.shape)} {out.dtype}, want {out_shape} {x.dtype}")
    x2, out2 = _rows(x, "x"), _rows(out, "out")
    if x2.shape[0] == 0 or intermediate == 0:
        return out
    block = min(triton.next_power_of_2(intermediate), _MAX_BLOCK)
    grid = (x2.shape[0], triton.cdiv(intermediate, block))
    _silu_and_mul_kernel[grid](
        x2,
        out2,
        intermediate,
        *x2.stride(),
        *out2.stride(),
        BLOCK=block,
    )
    return out
