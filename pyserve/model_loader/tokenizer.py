"""Load the tokenizer of a model: an HF folder's tokenizer files, or the tokenizer embedded in
a GGUF file (converted by transformers, chat template included)."""

from __future__ import annotations

import os

import transformers

from pyserve.model_loader.config import is_gguf_path
from pyserve.model_loader.default_model import ModelNotFoundError


def get_tokenizer(model_path: str, tokenizer_path: str | None = None) -> transformers.PreTrainedTokenizerBase:
    """A transformers fast tokenizer for `model_path` (or `tokenizer_path` when given).

    A folder loads with `AutoTokenizer.from_pretrained(folder)`; a .gguf file loads with
    `AutoTokenizer.from_pretrained(dirname, gguf_file=basename)`, which rebuilds the tokenizer
    and chat template from the GGUF metadata. Reads local files only.
    Raises ModelNotFoundError if the path does not exist.
    """
    path = tokenizer_path or model_path
    if not os.path.exists(path):
        raise ModelNotFoundError(f"tokenizer path does not exist: {path}")
    if is_gguf_path(path):
        folder, name = os.path.split(os.path.abspath(path))
        return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
