"""Model loading: locate the model, read its config, stream its weights, load its tokenizer
(building the model from them is `pyserve.models.loader.load_model`).

The names below load lazily: `pyserve.model_loader.default_model` and `.model_path` (what the
CLI checks before anything loads) must not import torch or transformers."""

from typing import Any

from pyserve.model_loader.default_model import ModelNotFoundError, default_model_path

_LAZY = {
    "ModelConfig": "pyserve.model_loader.config",
    "resolve_dtype": "pyserve.model_loader.config",
    "get_tokenizer": "pyserve.model_loader.tokenizer",
    "iter_weights": "pyserve.model_loader.weights",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pyserve.model_loader' has no attribute {name!r}")


__all__ = [
    "ModelConfig",
    "ModelNotFoundError",
    "default_model_path",
    "get_tokenizer",
    "iter_weights",
    "resolve_dtype",
]
