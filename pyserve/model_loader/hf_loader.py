"""Stream the tensors of an HF checkpoint folder (safetensors, single file or sharded) as
(HF parameter name, torch tensor) pairs."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from pyserve.distributed.shard import ShardLayout, shard
from pyserve.model_loader.default_model import ModelNotFoundError


def safetensors_files(folder: str) -> list[str]:
    """The safetensors files of an HF folder, in load order.

    Uses `model.safetensors.index.json` (sharded) when present, else `model.safetensors`, else
    every `*.safetensors` in the folder, sorted.
    Raises ModelNotFoundError when there is none (e.g. a pytorch_model.bin-only checkpoint).
    """
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(folder, "model.safetensors")
    if os.path.exists(single):
        return [single]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelNotFoundError(f"no .safetensors weights in {folder}")
    return files


def iter_safetensors_weights(
    folder: str, dtype: torch.dtype, progress: bool = True, layout: ShardLayout | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the folder's safetensors files, cast to `dtype`
    (floating tensors only), on CPU. Names are the checkpoint's own (HF) names.
    layout: a tensor-parallel rank's `ShardLayout`: only the rank's slice of each tensor is
      read from the file (`pyserve.distributed.shard`), so no rank holds the whole model.
    progress: show a tqdm bar over tensors (hidden when stderr is not a TTY).
    Raises ModelNotFoundError when the folder holds no safetensors file.
    """
    files = safetensors_files(folder)
    handles = [safe_open(path, framework="pt", device="cpu") for path in files]
    names = [(h, key) for h in handles for key in h.keys()]
    for handle, key in tqdm(names, desc="Loading safetensors", unit="tensor", disable=not progress or None):
        if layout is None:
            tensor = handle.get_tensor(key)
        else:
            lazy = handle.get_slice(key)
            tensor = shard(layout, key, tuple(lazy.get_shape()), lambda index, lazy=lazy: lazy[index])
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield key, tensor
