"""Copying a checkpoint's tensors into a model's parameters, by HF name (every model family)."""

from __future__ import annotations

from collections.abc import Container, Iterable

import torch


def copy_checkpoint(
    module: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], held_elsewhere: Container[str] = ()
) -> None:
    """Copy each (name, tensor) of `weights` into the parameter of `module` of that name, cast
    to its dtype; the caller has renamed or dropped what the model does not hold. Parameters
    named in `held_elsewhere` (read after `weights` is consumed) count as provided: the model
    keeps them in another form (quantized blocks). Raises KeyError for a name with no
    parameter, ValueError for a shape mismatch or for parameters the checkpoint did not
    provide."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if name not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(module).__name__}")
        param = params[name]
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor.to(dtype=param.dtype))
        loaded.add(name)
    missing = sorted(name for name in set(params) - loaded if name not in held_elsewhere)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")
