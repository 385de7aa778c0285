"""RMSNorm, plain and with the residual add fused: the Triton kernels on CUDA, the native CPU
kernel for float32 CPU tensors, else the torch reference."""

from __future__ import annotations

import torch

from pyserve_kernels import reference
from pyserve_kernels._native import _cpu, native_applies
from pyserve_kernels._triton import triton_applies


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight (see `reference.rms_norm`).

    x: [..., hidden]; weight: [hidden]. Returns a new [..., hidden] tensor in x.dtype.
    Raises ValueError if the last dim of x differs from weight's length.
    """
    if x.shape[-1:] == weight.shape and triton_applies(x, weight):
        from pyserve_kernels.triton_ops import norm

        # per-head q/k norms (Qwen3) pass strided views of the fused q|k|v row: the kernel
        # takes rows, so such a view is copied (the result is a new tensor anyway)
        return norm.rms_norm(x if x.is_contiguous() else x.contiguous(), weight, eps)
    if x.shape[-1:] != weight.shape or not native_applies(x, weight) or x.numel() == 0:
        return reference.rms_norm(x, weight, eps)
    out = torch.empty_like(x)
    _cpu.rms_norm(x.numpy(), weight.numpy(), float(eps), out.numpy(), torch.get_num_threads())
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): a pre-norm block's residual add and the next
    norm in one pass, as SGLang's and vLLM's `fused_add_rms_norm`.

    x, residual: [..., hidden] same shape and dtype; weight: [hidden].
    Returns (normed, new_residual). On the native and Triton paths both are computed IN PLACE (normed is
    x, new_residual is residual); callers must use the returned tensors and not reuse the
    inputs. Raises ValueError on mismatched shapes or when x, residual and weight overlap in
    memory on the native path.
    """
    if x.shape != residual.shape:
        raise ValueError(f"fused_add_rms_norm: x {tuple(x.shape)} != residual {tuple(residual.shape)}")
    if x.shape[-1:] == weight.shape and triton_applies(x, residual, weight):
        from pyserve_kernels.triton_ops import norm

        return norm.fused_add_rms_norm(x, residual, weight, eps)
    if x.shape[-1:] != weight.shape or not native_applies(x, residual, weight) or x.numel() == 0:
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    _cpu.fused_add_rms_norm(x.numpy(), residual.numpy(), weight.numpy(), float(eps), torch.get_num_threads())
    return x, residual
