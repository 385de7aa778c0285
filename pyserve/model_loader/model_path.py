"""`check_model_path`: refuse a `--model-path` that cannot be a model, in one line, before
anything (torch, the tokenizer, the weights) loads."""

from __future__ import annotations

import os

from pyserve.model_loader.default_model import ModelNotFoundError

GGUF_MAGIC = b"GGUF"  # the first 4 bytes of every GGUF file (GGUF spec, "File Structure")


def check_model_path(path: str) -> None:
    """Accepts a folder holding `config.json` (a Hugging Face checkpoint) or a GGUF file.

    Raises ModelNotFoundError (a ValueError) with a one-line reason otherwise: the path does
    not exist or cannot be read; a folder without config.json (naming a .gguf inside it, the
    file to pass instead); a file that is not GGUF (by its magic bytes, whatever its name).
    Any thread; reads at most 4 bytes and one folder listing."""
    where = f"--model-path {path}"
    try:
        if os.path.isdir(path):
            if os.path.isfile(os.path.join(path, "config.json")):
                return
            ggufs = sorted(n for n in os.listdir(path) if n.lower().endswith(".gguf"))
            if ggufs:
                hint = f"to serve the GGUF in it, pass --model-path {os.path.join(path, ggufs[0])}"
            else:
                hint = "a model folder holds config.json and its *.safetensors weights"
            raise ModelNotFoundError(f"{where}: a folder without config.json ({hint})")
        if not os.path.exists(path):
            raise ModelNotFoundError(f"{where}: no such file or folder")
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ModelNotFoundError(f"{where}: cannot be read ({exc.strerror or exc})") from None
    if magic != GGUF_MAGIC:
        raise ModelNotFoundError(
            f"{where}: a file that is not a GGUF model (pass a .gguf file, or the folder holding config.json)"
        )
