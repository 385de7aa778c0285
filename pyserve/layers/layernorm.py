"""RMSNorm as an nn.Module holding its weight; the math is `pyserve_kernels.rms_norm` and
`pyserve_kernels.fused_add_rms_norm`."""

from __future__ import annotations

import torch

from pyserve_kernels import fused_add_rms_norm, rms_norm


class RMSNorm(torch.nn.Module):
    """Root-mean-square norm with a learned scale (Zhang & Sennrich, 2019).

    weight: [hidden_size] in `dtype`, initialised to ones.
    forward(x [..., hidden_size]) -> [..., hidden_size] in x.dtype.
    forward(x, residual) -> (norm(x + residual), x + residual): the residual add fused in;
      may reuse x's and residual's memory for the results (use only the returned tensors).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
