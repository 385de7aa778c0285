"""Read GGUF metadata into a `transformers.LlamaConfig` (no tensors are read here).

GGUF keys follow the llama.cpp spec (github.com/ggml-org/ggml, docs/gguf.md): `<arch>.block_count`,
`<arch>.attention.head_count`, `tokenizer.ggml.bos_token_id`, ...
"""

from __future__ import annotations

import functools
from typing import Any

import gguf
import transformers

# GGUF architecture name -> (HF architecture class name, HF config class)
_GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", transformers.LlamaConfig),
}


@functools.lru_cache(maxsize=4)
def open_gguf(path: str) -> gguf.GGUFReader:
    """A GGUFReader (memory-maps the file) for `path`, cached because parsing the metadata of a
    large vocabulary takes seconds; config and weight loading share one reader."""
    return gguf.GGUFReader(path)


def _field_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_to_hf_config(path: str) -> transformers.PretrainedConfig:
    """Build the HF config equivalent to the metadata of the GGUF file at `path`.

    tie_word_embeddings is True when the file has no `output.weight` tensor (llama.cpp then
    reuses token_embd for the LM head), matching how transformers reads GGUF files.
    Raises ValueError for a GGUF architecture other than llama, or if a required key is missing.
    """
    reader = open_gguf(path)
    arch = _field_value(reader, "general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(_GGUF_ARCHITECTURES)}")
    hf_arch, config_cls = _GGUF_ARCHITECTURES[arch]

    def need(suffix: str) -> Any:
        value = _field_value(reader, f"{arch}.{suffix}")
        if value is None:
            raise ValueError(f"GGUF file {path} lacks metadata key {arch}.{suffix}")
        return value

    num_heads = int(need("attention.head_count"))
    hidden_size = int(need("embedding_length"))
    head_dim = int(_field_value(reader, f"{arch}.rope.dimension_count", hidden_size // num_heads))
    vocab_size = _field_value(reader, f"{arch}.vocab_size")
    if vocab_size is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError(f"GGUF file {path} has neither {arch}.vocab_size nor a token list")
        vocab_size = len(tokens.data)
    tensor_names = {t.name for t in reader.tensors}

    rope_theta = float(_field_value(reader, f"{arch}.rope.freq_base", 10000.0))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    scaling_type = _field_value(reader, f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        rope = {
            "rope_type": "linear",
            "rope_theta": rope_theta,
            "factor": float(need("rope.scaling.factor")),
        }
    elif scaling_type not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported")

    kwargs: dict[str, Any] = dict(
        architectures=[hf_arch],
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(_field_value(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(need("context_length")),
        rms_norm_eps=float(_field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field_value(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field_value(reader, "tokenizer.ggml.padding_token_id"),
        hidden_act="silu",
    )
    # transformers >= 5 takes rope settings as `rope_parameters`; 4.x as rope_theta/rope_scaling.
    if int(transformers.__version__.split(".")[0]) >= 5:
        kwargs["rope_parameters"] = rope
    else:
        kwargs["rope_theta"] = rope_theta
        if rope["rope_type"] != "default":
            kwargs["rope_scaling"] = {"rope_type": rope["rope_type"], "factor": rope["factor"]}
    return config_cls(**kwargs)
