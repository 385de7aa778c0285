"""Linear projections of the model layers: `F.linear`, or, on CPU in float32, a oneDNN matmul
on a prepacked copy of the weight.

`F.linear` on CPU runs MKL's sgemm, which repacks the weight on every call and, on non-Intel
CPUs, may not use AVX-512. oneDNN picks its kernels from the CPU's instruction sets, and a
weight reordered once into its blocked layout (`prepack`) is reused by every call. On the
2-core AVX-512 (AMD) machine the tests run on, SmolLM2-135M's projections took, per call:
64-token decode GEMMs 1.2-2.0x less time (the 49152-row LM head 2.0x), 2048-token prefill GEMMs
1.25x less. The result differs from `F.linear` by float32 rounding only (another summation
order: about 1e-6 relative). The packed copy costs as much memory as the weight.

`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise` are the ops PyTorch's own
Inductor CPU backend uses for packed linears; they exist in every x86 PyTorch build with
oneDNN (`torch.backends.mkldnn.is_available()`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pyserve_kernels.quant import QuantizedWeight, quantized_linear


def prepack_supported(weight: torch.Tensor) -> bool:
    """Whether `weight` ([out, in]) can be prepacked: float32 on CPU, with oneDNN present."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN-packed copy of `weight` [out, in] float32 (an opaque mkldnn-layout tensor, only
    for `linear(..., packed=)`). Raises RuntimeError where `prepack_supported` is False."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | QuantizedWeight | None = None,
) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T + bias [out] -> [..., out], in x.dtype.

    With `packed` = `prepack(weight)`, runs oneDNN on the packed copy; with a
    `QuantizedWeight` (the checkpoint's GGUF blocks; `weight` is then empty), the native
    quantized kernel; else `F.linear`."""
    if packed is None:
        return F.linear(x, weight, bias)
    if isinstance(packed, QuantizedWeight):
        return quantized_linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")


def linear_gelu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """gelu(x @ weight.T + bias), GELU with erf (HF's "gelu"). With `packed`, the GELU runs as
    oneDNN's post-op inside the matmul (one pass over the output instead of two)."""
    if packed is None:
        return F.gelu(F.linear(x, weight, bias))
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "gelu", [None], "none")
