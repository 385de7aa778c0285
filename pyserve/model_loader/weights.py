"""Build a model for a ModelConfig and fill it with the checkpoint's weights (HF folder or
GGUF file)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import torch

from pyserve.distributed.group import TensorParallelGroup
from pyserve.distributed.shard import ShardLayout, shard
from pyserve.model_loader.config import ModelConfig
from pyserve_kernels.quant import QuantizedWeight, quantized_kernels_available

logger = logging.getLogger(__name__)


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


def load_model(
    model_config: ModelConfig,
    device: str | torch.device,
    progress: bool = True,
    load_format: str = "auto",
    quantization: str = "auto",
    tp: TensorParallelGroup | None = None,
) -> torch.nn.Module:
    """Instantiate the registered class of `model_config.architecture` on `device` in
    `model_config.dtype`, load its weights (load_format "auto") or fill it with seeded random
    weights (load_format "dummy", nothing read but the config) and put it in eval mode.
    quantization "auto" keeps a GGUF's quantized matrices quantized when the model runs on CPU
    (`keeps_quantized`); "none" dequantizes every weight to the model's dtype.

    tp: a tensor-parallel rank's group: the model holds and loads that rank's shard (every
    weight dequantized: the native quantized kernels run unsharded only).

    Raises ValueError for an unsupported architecture (or one without tensor parallelism
    when `tp` is given, or a model that does not split `tp.size` ways), KeyError/ValueError
    from the model's `load_weights` for unknown or missing tensors.
    """
    from pyserve.models.registry import get_model_class

    model_cls = get_model_class(model_config.architecture)
    start = time.perf_counter()
    layout = None
    kwargs = {}
    if tp is not None:
        if not getattr(model_cls, "supports_tensor_parallel", False):
            raise ValueError(f"{model_config.architecture} has no tensor-parallel version; use --tp-size 1")
        layout = ShardLayout.of(model_config.hf_config, tp.rank, tp.size)
        kwargs["tp"] = tp
    with torch.device(device):
        model = model_cls(model_config.hf_config, dtype=model_config.dtype, device=device, **kwargs)
    if load_format == "dummy":
        model.init_dummy_weights()
    elif load_format == "auto":
        keep = tp is None and keeps_quantized(model_config, device, quantization)
        model.load_weights(iter_weights(model_config, progress=progress, keep_quantized=keep, layout=layout))
        if keep:  # the blocks were copied out: unmap the file
            from pyserve.model_loader.gguf_reader import open_gguf

            open_gguf.cache_clear()
    else:
        raise ValueError(f"load_format {load_format!r} is not supported; supported: auto, dummy")
    model.eval()
    logger.info(
        "loaded %s (%s) in %.2f s",
        model_config.model_path,
        model_config.architecture,
        time.perf_counter() - start,
    )
    return model
