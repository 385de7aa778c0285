"""`load_model`: build the registered model class for a ModelConfig and fill it with the
checkpoint's weights (HF folder or GGUF file) or seeded random ones."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from pyserve.distributed.group import TensorParallelGroup
from pyserve.distributed.shard import ShardLayout
from pyserve.model_loader.config import ModelConfig
from pyserve.model_loader.weights import iter_weights, keeps_quantized
from pyserve.models.registry import get_model_class

logger = logging.getLogger(__name__)


def load_model(
    model_config: ModelConfig,
    device: str | torch.device,
    progress: bool = True,
    load_format: str = "auto",
    quantization: str = "auto",
    tp: TensorParallelGroup | None = None,
    expert_parallel: bool = False,
) -> torch.nn.Module:
    """Instantiate the registered class of `model_config.architecture` on `device` in
    `model_config.dtype`, load its weights (load_format "auto") or fill it with seeded random
    weights (load_format "dummy", nothing read but the config) and put it in eval mode.
    quantization "auto" keeps a GGUF's quantized matrices quantized when the model runs on CPU
    (`keeps_quantized`); "none" dequantizes every weight to the model's dtype.

    tp: a tensor-parallel rank's group: the model holds and loads that rank's shard (every
    weight dequantized: the native quantized kernels run unsharded only). expert_parallel:
    with `tp`, a mixture of experts holds its rank's whole experts (--ep-size).

    Raises ValueError for an unsupported architecture (or one without tensor parallelism
    when `tp` is given, or without experts to split under `expert_parallel`, or a model that
    does not split `tp.size` ways), KeyError/ValueError
    from the model's `load_weights` for unknown or missing tensors.
    """
    model_cls = get_model_class(model_config.architecture)
    start = time.perf_counter()
    layout = None
    kwargs: dict[str, Any] = {}
    if tp is not None:
        if not getattr(model_cls, "supports_tensor_parallel", False):
            raise ValueError(f"{model_config.architecture} has no tensor-parallel version; use --tp-size 1")
        layout = ShardLayout.of(model_config.hf_config, tp.rank, tp.size, expert_parallel)
        kwargs["tp"] = tp
        if expert_parallel:
            if not getattr(model_cls, "supports_expert_parallel", False):
                raise ValueError(f"{model_config.architecture} has no experts to split; use --ep-size 1")
            kwargs["expert_parallel"] = True
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
