"""Model loading: locate the model, read its config, stream its weights, load its tokenizer."""

from pyserve.model_loader.config import ModelConfig, resolve_dtype
from pyserve.model_loader.default_model import ModelNotFoundError, default_model_path
from pyserve.model_loader.tokenizer import get_tokenizer
from pyserve.model_loader.weights import iter_weights, load_model

__all__ = [
    "ModelConfig",
    "ModelNotFoundError",
    "default_model_path",
    "get_tokenizer",
    "iter_weights",
    "load_model",
    "resolve_dtype",
]
