"""Triton RMSNorm, plain and fused with the residual add (the CUDA path of
`pyserve_kernels.rms_norm` / `fused_add_rms_norm`; semantics: `pyserve_kernels.reference`).

Algorithm: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019), in the Llama
order: normalise in float32, round to the input dtype, then multiply by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows up to this many elements are normalised from registers in one pass; longer rows are
# walked in chunks of this size (read twice). Tests lower it to exercise the chunked path.
MAX_BLOCK_SIZE = 8192

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _load_row(x_row, res_row, cols, mask, x_s1, res_s1, in_dtype, HAS_RESIDUAL: tl.constexpr):
    """Columns `cols` of one row: x, or with a residual x + residual rounded to the input
    dtype (as the reference's `total = x + residual`), which is stored back into residual."""
    x = tl.load(x_row + cols * x_s1, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_row + cols * res_s1, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(in_dtype)
        tl.store(res_row + cols * res_s1, x, mask=mask)
    return x


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    hidden,
    eps,
    x_s0,
    x_s1,
    res_s0,
    res_s1,
    w_s0,
    out_s0,
    out_s1,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_s0
    res_row = residual_ptr + row * res_s0
    out_row = out_ptr + row * out_s0
    in_dtype = x_ptr.dtype.element_ty

    if NUM_CHUNKS == 1:
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        x32 = _load_row(x_row, res_row, cols, mask, x_s1, res_s1, in_dtype, HAS_RESIDUAL).to(tl.float32)
        variance = tl.sum(x32 * x32, axis=0) / hidden
        rstd = tl.div_rn(1.0, tl.sqrt_rn(variance + eps))
        normed = (x32 * rstd).to(in_dtype).to(tl.float32)
        w = tl.load(weight_ptr + cols * w_s0, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + cols * out_s1, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for chunk in range(NUM_CHUNKS):
            cols = chunk * BLOCK + tl.arange(0, BLOCK)
            mask = cols < hidden
            x32 = _load_row(x_row, res_row, cols, mask, x_s1, res_s1, in_dtype, HAS_RESIDUAL).to(tl.float32)
            acc += x32 * x32
        variance = tl.sum(acc, axis=0) / hidden
        rstd = tl.div_rn(1.0, tl.sqrt_rn(variance + eps))
        # The second pass rereads the sum this program just stored in residual.
        tl.debug_barrier()
        for chunk in range(NUM_CHUNKS):
            cols = chunk * BLOCK + tl.arange(0, BLOCK)
            mask = cols < hidden
            if HAS_RESIDUAL:
                x32 = tl.load(res_row + cols * res_s1, mask=mask, other=0.0).to(tl.float32)
            else:
                x32 = tl.load(x_row + cols * x_s1, mask=mask, other=0.0).to(tl.float32)
            normed = (x32 * rstd).to(in_dtype).to(tl.float32)
            w = tl.load(weight_ptr + cols * w_s0, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + cols * out_s1, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, name: str, op: str) -> torch.Tensor:
    """t as a [rows, hidden] view (no copy, so in-place writes reach t)."""
    if t.dim() == 2:
        return t
    if t.dim() < 1:
        raise ValueError(f"{op}: {name} must have a hidden dim, got shape {tuple(t.shape)}")
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"{op}: {name} {tuple(t.shape)} with strides {t.stride()} cannot be viewed as [rows, hidden] without a copy"
        ) from None


def _check(op: str, kernel, named: dict[str, torch.Tensor], weight: torch.Tensor) -> None:
    tensors = {**named, "weight": weight}
    if len({t.device for t in tensors.values()}) != 1:
        raise ValueError(
            f"{op}: tensors on different devices: " + ", ".join(f"{n} {t.device}" for n, t in tensors.items())
        )
    if weight.device.type != "cuda" and isinstance(kernel, triton.runtime.JITFunction):
        raise ValueError(
            f"{op}: tensors on {weight.device}; the Triton kernel needs CUDA tensors "
            "(CPU tensors only under TRITON_INTERPRET=1)"
        )
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise ValueError(f"{op}: {name} must be float32, float16 or bfloat16, got {t.dtype}")
    x = named["x"]
    if weight.dim() != 1 or x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"{op}: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)} "
            "(want x [..., hidden], weight [hidden])"
        )


def _launch(
    x2: torch.Tensor, residual2: torch.Tensor | None, weight: torch.Tensor, out2: torch.Tensor, eps: float
) -> None:
    num_rows, hidden = x2.shape
    if num_rows == 0 or hidden == 0:
        return
    block = min(triton.next_power_of_2(hidden), MAX_BLOCK_SIZE)
    num_warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    res = residual2 if residual2 is not None else x2
    _rms_norm_kernel[(num_rows,)](
        x2,
        res,
        weight,
        out2,
        hidden,
        float(eps),
        *x2.stride(),
        *res.stride(),
        weight.stride(0),
        *out2.stride(),
        HAS_RESIDUAL=residual2 is not None,
        BLOCK=block,
        NUM_CHUNKS=triton.cdiv(hidden, block),
        num_warps=num_warps,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight, normalised in float32 and rounded to x.dtype
    before the weight multiply (as `reference.rms_norm`).

    x:      [..., hidden] float32 / float16 / bfloat16, cuda; any hidden size
    weight: [hidden] float32 / float16 / bfloat16, same device
    out:    None (a new tensor is allocated), or [..., hidden] (x's shape) in the result dtype
            torch.promote_types(x.dtype, weight.dtype), same device; written IN PLACE. May be
            x itself. x is not modified otherwise.
    Returns out (or the new tensor). Host-sync-free: reads only shapes and strides.
    Raises ValueError for a hidden size that differs from weight's, a dtype other than those
    above, an out of the wrong shape or dtype, tensors on different devices, a tensor not
    viewable as [rows, hidden], or CPU tensors outside TRITON_INTERPRET=1.
    """
    named = {"x": x} if out is None else {"x": x, "out": out}
    _check("rms_norm", _rms_norm_kernel, named, weight)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != out_dtype:
        raise ValueError(f"rms_norm: out {tuple(out.shape)} {out.dtype}, want {tuple(x.shape)} {out_dtype}")
    _launch(_rows(x, "x", "rms_norm"), None, weight, _rows(out, "out", "rms_norm"), eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's residual add and the next RMSNorm in one pass, IN PLACE:
    residual <- x + residual (rounded to the dtype), x <- rms_norm(residual) (as
    `reference.fused_add_rms_norm`, rounded to x.dtype).

    x, residual: [..., hidden] same shape and dtype (float32 / float16 / bfloat16), cuda
    weight:      [hidden] float32 / float16 / bfloat16, same device
    Returns (x, residual), the mutated inputs. x and residual must not overlap.
    Host-sync-free: reads only shapes and strides.
    Raises ValueError for mismatched shapes or dtypes, a hidden size that differs from
    weight's, tensors on different devices, a tensor not viewable as [rows, hidden], or CPU
    tensors outside TRITON_INTERPRET=1.
    """
    _check("fused_add_rms_norm", _rms_norm_kernel, {"x": x, "residual": residual}, weight)
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(
            f"fused_add_rms_norm: x {tuple(x.shape)} {x.dtype} != residual {tuple(residual.shape)} {residual.dtype}"
        )
    x2 = _rows(x, "x", "fused_add_rms_norm")
    _launch(x2, _rows(residual, "residual", "fused_add_rms_norm"), weight, x2, eps)
    return x, residual
