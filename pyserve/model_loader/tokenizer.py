"""Load the tokenizer of a model: an HF folder's tokenizer files, or the tokenizer embedded in
a GGUF file (converted by transformers, chat template included); give it the --chat-template."""

from __future__ import annotations

import logging
import os

import transformers

from pyserve.model_loader.chat_template import (
    WARNING_HEADER,
    ignores_tools,
    load_chat_template,
    sample_problem,
    tools_template,
)
from pyserve.model_loader.config import is_gguf_path
from pyserve.model_loader.default_model import ModelNotFoundError

logger = logging.getLogger(__name__)


# GGUF tokenizer models (`tokenizer.ggml.model`) -> the transformers tokenizer type to build
# one with, for a file whose architecture transformers' GGUF support does not cover
_GGUF_TOKENIZER_TYPES = {"gpt2": "gpt2", "llama": "llama"}


def _gguf_tokenizer_model(path: str) -> str | None:
    from pyserve.model_loader.gguf_reader import gguf_field

    return gguf_field(path, "tokenizer.ggml.model")


def get_tokenizer(model_path: str, tokenizer_path: str | None = None) -> transformers.PreTrainedTokenizerBase:
    """A transformers fast tokenizer for `model_path` (or `tokenizer_path` when given).

    A folder loads with `AutoTokenizer.from_pretrained(folder)`; a .gguf file loads with
    `AutoTokenizer.from_pretrained(dirname, gguf_file=basename)`, which rebuilds the tokenizer
    and chat template from the GGUF metadata (for an architecture transformers cannot read a
    config of, such as OLMoE, by naming the tokenizer type from `tokenizer.ggml.model`). Reads
    local files only.
    Raises ModelNotFoundError if the path does not exist.
    """
    path = tokenizer_path or model_path
    if not os.path.exists(path):
        raise ModelNotFoundError(f"tokenizer path does not exist: {path}")
    if is_gguf_path(path):
        folder, name = os.path.split(os.path.abspath(path))
        try:
            return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        except ValueError as exc:  # transformers reads no config of this architecture (e.g. olmoe)
            model = _gguf_tokenizer_model(path)
            if model is None:
                raise ValueError(f"{path} holds no tokenizer (no tokenizer.ggml.model): give --tokenizer-path") from exc
            kind = _GGUF_TOKENIZER_TYPES.get(str(model))
            if kind is None or "not supported" not in str(exc):
                raise
            # the tokenizer itself is the GGUF's own: only the class is named here
            return transformers.AutoTokenizer.from_pretrained(
                folder, gguf_file=name, tokenizer_type=kind, local_files_only=True
            )
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def set_chat_template(tokenizer: transformers.PreTrainedTokenizerBase, chat_template: str | None) -> None:
    """Give `tokenizer` the template of `--chat-template` (a file or a built-in name; None keeps
    the model's), then log a warning for a chat template that will not serve well: one that
    fails on a sample conversation (the model's own: --chat-template was checked before) and
    one that ignores `tools` (requests with tools then carry an x-pyserve-warning header).
    Mutates `tokenizer.chat_template`. Raises ChatTemplateError for a bad --chat-template.
    Loading thread."""
    if chat_template is not None:
        tokenizer.chat_template = load_chat_template(chat_template)
    if not getattr(tokenizer, "chat_template", None):
        return  # (an embedding model's usually: chat requests get a 400 saying what to do)
    source = f"--chat-template {chat_template}" if chat_template is not None else "the model's chat template"
    template = tools_template(tokenizer)
    specials = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
    problem = sample_problem(template, specials) if template is not None else None
    if problem is not None:
        logger.warning("%s fails: %s; chat requests may fail", source, problem)
    elif template is not None and ignores_tools(template):
        logger.warning(
            "%s ignores tools: the prompt of a request with tools does not show them (its response carries "
            "an %s header); give a --chat-template that renders tools to use them",
            source,
            WARNING_HEADER,
        )
