"""ModelConfig: the model facts the engine needs (shapes, context length, dtype, special
tokens), read from an HF folder (config.json) or a GGUF file (its metadata)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

from pyserve.model_loader.default_model import ModelNotFoundError

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """Turn a `--dtype` value into a torch dtype.

    `auto` is float32 on CPU and bfloat16 on CUDA (DESIGN.md section 7).
    Raises ValueError for an unknown name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower()
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[name]


def is_gguf_path(model_path: str) -> bool:
    """True if `model_path` names a .gguf file (a folder whose name ends in .gguf is a folder)."""
    return model_path.lower().endswith(".gguf") and not os.path.isdir(model_path)


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings of `hf_config` as one dict with at least rope_type and rope_theta.

    Accepts both transformers >= 5 (`rope_parameters`) and 4.x (`rope_theta` +
    `rope_scaling`, whose type key may be `type` or `rope_type`).
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        out = dict(params)
    else:
        out = dict(getattr(hf_config, "rope_scaling", None) or {})
        out["rope_theta"] = float(getattr(hf_config, "rope_theta", 10000.0))
    out["rope_type"] = out.get("rope_type", out.get("type", "default")) or "default"
    return out


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, (list, tuple, set)):
        return {int(v) for v in value}
    return {int(value)}


@dataclass
class ModelConfig:
    """Model facts derived from the checkpoint plus the run's context length and dtype.

    hf_config:    the transformers config (from config.json, or built from GGUF metadata)
    architecture: HF class name, e.g. "LlamaForCausalLM"
    head_dim:     per-head size (config.head_dim when given, else hidden_size / num_heads)
    context_len:  tokens per sequence this run allows
    dtype:        torch dtype of weights, activations and KV cache
    eos_token_ids: ids that end generation (config.json plus generation_config.json)
    """

    model_path: str
    hf_config: Any
    architecture: str
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    context_len: int
    dtype: torch.dtype
    eos_token_ids: set[int] = field(default_factory=set)
    bos_token_id: int | None = None
    is_gguf: bool = False

    @classmethod
    def from_path(
        cls,
        model_path: str,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "cpu",
        context_length: int | None = None,
    ) -> ModelConfig:
        """Read the config of an HF folder or a .gguf file.

        context_length: override of the model's max_position_embeddings; a value above it is
          allowed (rope extrapolates, quality may drop) but logged as a warning. Without it, a
          sentence-transformers folder's `max_seq_length` (sentence_bert_config.json) caps
          the context when it is smaller, as sentence-transformers and vLLM cap it.
        Raises ModelNotFoundError if the path does not exist, ValueError for a bad dtype, a
        non-positive context_length, or a config without `architectures`.
        """
        if not os.path.exists(model_path):
            raise ModelNotFoundError(f"model path does not exist: {model_path}")
        gguf = is_gguf_path(model_path)
        if gguf:
            from pyserve.model_loader.gguf_reader import gguf_to_hf_config

            hf_config = gguf_to_hf_config(model_path)
        else:
            hf_config = transformers.AutoConfig.from_pretrained(model_path)
        architectures = getattr(hf_config, "architectures", None) or []
        if not architectures:
            raise ValueError(f"config of {model_path} names no architecture")

        num_heads = int(hf_config.num_attention_heads)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        model_max = int(getattr(hf_config, "max_position_embeddings", 2048))
        context_len = model_max
        st_config = os.path.join(model_path, "sentence_bert_config.json")
        if context_length is None and not gguf and os.path.isfile(st_config):
            with open(st_config) as f:
                st_max = json.load(f).get("max_seq_length")
            if isinstance(st_max, int) and 0 < st_max < context_len:
                context_len = st_max
        if context_length is not None:
            if int(context_length) <= 0:
                raise ValueError(f"context_length must be > 0, got {context_length}")
            if int(context_length) > model_max:
                logger.warning(
                    "context_length %d exceeds the model's max_position_embeddings %d; "
                    "outputs beyond %d tokens may degrade",
                    context_length,
                    model_max,
                    model_max,
                )
            context_len = int(context_length)

        eos = _as_id_set(getattr(hf_config, "eos_token_id", None))
        if not gguf and os.path.exists(os.path.join(model_path, "generation_config.json")):
            try:
                gen = transformers.GenerationConfig.from_pretrained(model_path)
                eos |= _as_id_set(gen.eos_token_id)
            except (OSError, ValueError) as exc:
                logger.warning("could not read generation_config.json: %s", exc)
        bos = getattr(hf_config, "bos_token_id", None)

        return cls(
            model_path=model_path,
            hf_config=hf_config,
            architecture=architectures[0],
            num_hidden_layers=int(hf_config.num_hidden_layers),
            num_attention_heads=num_heads,
            num_key_value_heads=int(getattr(hf_config, "num_key_value_heads", None) or num_heads),
            head_dim=int(head_dim),
            hidden_size=int(hf_config.hidden_size),
            vocab_size=int(hf_config.vocab_size),
            context_len=context_len,
            dtype=resolve_dtype(dtype, device),
            eos_token_ids=eos,
            bos_token_id=None if bos is None else int(bos),
            is_gguf=gguf,
        )
