"""Gated activations as nn.Modules; the math is `pyserve_kernels.silu_and_mul`."""

from __future__ import annotations

import torch

from pyserve_kernels import silu_and_mul


class SiluAndMul(torch.nn.Module):
    """SwiGLU: x = [gate | up] -> silu(gate) * up (Shazeer, "GLU Variants Improve
    Transformer", 2020).

    forward(x [num_tokens, 2 * intermediate]) -> [num_tokens, intermediate], x.dtype.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


def get_act_fn(name: str) -> torch.nn.Module:
    """The gated activation for an HF `hidden_act` name. Raises ValueError if unsupported."""
    if name in ("silu", "swish"):
        return SiluAndMul()
    raise ValueError(f"activation {name!r} is not supported; supported: silu")
