"""Build a model for a ModelConfig and fill it with the checkpoint's weights (HF folder or
GGUF file)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import torch

from pyserve.model_loader.config import ModelConfig

logger = logging.getLogger(__name__)


def iter_weights(model_config: ModelConfig, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) pairs of the checkpoint of `model_config`, CPU tensors in
    `model_config.dtype`. Raises ModelNotFoundError when no weight file is found."""
    if model_config.is_gguf:
        from pyserve.model_loader.gguf_loader import iter_gguf_weights

        return iter_gguf_weights(
            model_config.model_path,
            model_config.num_attention_heads,
            model_config.num_key_value_heads,
            model_config.dtype,
            progress=progress,
        )
    from pyserve.model_loader.hf_loader import iter_safetensors_weights

    return iter_safetensors_weights(model_config.model_path, model_config.dtype, progress=progress)


def load_model(
    model_config: ModelConfig,
    device: str | torch.device,
    progress: bool = True,
    load_format: str = "auto",
) -> torch.nn.Module:
    """Instantiate the registered class of `model_config.architecture` on `device` in
    `model_config.dtype`, load its weights (load_format "auto") or fill it with seeded random
    weights (load_format "dummy", nothing read but the config) and put it in eval mode.

    Raises ValueError for an unsupported architecture, KeyError/ValueError from the model's
    `load_weights` for unknown or missing tensors.
    """
    from pyserve.models.registry import get_model_class

    model_cls = get_model_class(model_config.architecture)
    start = time.perf_counter()
    with torch.device(device):
        model = model_cls(model_config.hf_config, dtype=model_config.dtype, device=device)
    if load_format == "dummy":
        model.init_dummy_weights()
    elif load_format == "auto":
        model.load_weights(iter_weights(model_config, progress=progress))
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
