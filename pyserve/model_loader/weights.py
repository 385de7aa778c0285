"""Stream a checkpoint's weights (HF folder or GGUF file) as (name, tensor) pairs, a rank's
shard of each when tensor-parallel; whether quantized GGUF blocks stay quantized."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pyserve.distributed.shard import ShardLayout, shard
from pyserve.model_loader.config import ModelConfig
from pyserve_kernels.quant import QuantizedWeight, quantized_kernels_available


def iter_weights(
    model_config: ModelConfig, progress: bool = True, keep_quantized: bool = False, layout: ShardLayout | None = None
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield (hf_name, tensor) pairs of the checkpoint of `model_config`, CPU tensors in
    `model_config.dtype`; with `keep_quantized`, a GGUF's quantized matrices as their blocks
    (see `iter_gguf_weights`). With a tensor-parallel `layout`, each tensor's slice for that
    rank (`pyserve.distributed.shard`): read alone from safetensors; a GGUF tensor is
    dequantized whole, one at a time, then cut. Raises ModelNotFoundError when no weight
    file is found."""
    if model_config.is_gguf:
        from pyserve.model_loader.gguf_loader import iter_gguf_weights

        if layout is not None:
            assert not keep_quantized, "a tensor-parallel rank dequantizes its GGUF slices"
            full = iter_gguf_weights(
                model_config.model_path,
                model_config.num_attention_heads,
                model_config.num_key_value_heads,
                model_config.dtype,
                progress=progress,
            )
            return _cut(full, layout)
        return iter_gguf_weights(
            model_config.model_path,
            model_config.num_attention_heads,
            model_config.num_key_value_heads,
            model_config.dtype,
            progress=progress,
            keep_quantized=keep_quantized,
        )
    from pyserve.model_loader.hf_loader import iter_safetensors_weights

    return iter_safetensors_weights(model_config.model_path, model_config.dtype, progress=progress, layout=layout)


def _cut(
    weights: Iterator[tuple[str, torch.Tensor | QuantizedWeight]], layout: ShardLayout
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Each (name, whole float tensor) as (name, this rank's slice, copied: the whole one is
    dropped before the next is read)."""
    for name, tensor in weights:
        assert isinstance(tensor, torch.Tensor)
        yield name, shard(layout, name, tuple(tensor.shape), lambda index, t=tensor: t[index].clone())


def keeps_quantized(model_config: ModelConfig, device: str | torch.device, quantization: str) -> bool:
    """Whether a model's quantized GGUF matrices run quantized: quantization "auto", a GGUF
    file, a CPU device and the native kernels built. On CUDA they are dequantized to the run
    dtype (no CUDA kernels for the blocks yet)."""
    if quantization not in ("auto", "none"):
        raise ValueError(f"quantization {quantization!r} is not supported; supported: auto, none")
    return (
        quantization == "auto"
        and model_config.is_gguf
        and torch.device(device).type == "cpu"
        and quantized_kernels_available()
    )
