"""RMSNorm as an nn.Module holding its weight; the math is `pyserve_kernels.rms_norm`."""

from __future__ import annotations

import torch
from pyserve_kernels import rms_norm


class RMSNorm(torch.nn.Module):
    """Root-mean-square norm with a learned scale (Zhang & Sennrich, 2019).

    weight: [hidden_size] in `dtype`, initialised to ones.
    forward(x [num_tokens, hidden_size]) -> [num_tokens, hidden_size] in x.dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device),
                                         requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
