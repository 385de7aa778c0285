"""Read GGUF metadata into a transformers config (no tensors are read here): Llama (Mixtral when
it has experts), OLMoE, Qwen2-MoE and Qwen3-MoE.

GGUF keys follow the llama.cpp spec (github.com/ggml-org/ggml, docs/gguf.md): `<arch>.block_count`,
`<arch>.attention.head_count`, `tokenizer.ggml.bos_token_id`, ...
"""

from __future__ import annotations

import functools
from typing import Any

import gguf
import transformers

# GGUF architecture name -> (HF architecture class name, HF config class); a "llama" file with
# experts is a Mixtral (llama.cpp writes Mixtral as llama)
_GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", transformers.LlamaConfig),
    "olmoe": ("OlmoeForCausalLM", transformers.OlmoeConfig),
    "qwen2moe": ("Qwen2MoeForCausalLM", transformers.Qwen2MoeConfig),
    "qwen3moe": ("Qwen3MoeForCausalLM", transformers.Qwen3MoeConfig),
}
# whether each mixture family renormalises its top-k routing weights when the file does not say
# (`<arch>.expert_weights_norm`): as llama.cpp runs them
_NORM_TOPK = {"llama": True, "olmoe": False, "qwen2moe": False, "qwen3moe": True}


def gguf_field(path: str, key: str) -> Any:
    """The value of metadata `key` of the GGUF file at `path`, or None."""
    return _field_value(open_gguf(path), key)


def gguf_architecture(path: str) -> str:
    """The file's `general.architecture` (e.g. "llama", "olmoe")."""
    return str(gguf_field(path, "general.architecture"))


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
    A mixture's experts come from `<arch>.expert_count`, `expert_used_count`,
    `expert_feed_forward_length` (else `feed_forward_length`) and, for Qwen2-MoE,
    `expert_shared_feed_forward_length`.
    Raises ValueError for an architecture outside `_GGUF_ARCHITECTURES`, or if a required key is
    missing.
    """
    reader = open_gguf(path)
    arch = _field_value(reader, "general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(_GGUF_ARCHITECTURES)}")
    hf_arch, config_cls = _GGUF_ARCHITECTURES[arch]
    experts = int(_field_value(reader, f"{arch}.expert_count", 0) or 0)
    if arch == "llama" and experts:
        hf_arch, config_cls = "MixtralForCausalLM", transformers.MixtralConfig

    def need(suffix: str) -> Any:
        value = _field_value(reader, f"{arch}.{suffix}")
        if value is None:
            raise ValueError(f"GGUF file {path} lacks metadata key {arch}.{suffix}")
        return value

    num_heads = int(need("attention.head_count"))
    hidden_size = int(need("embedding_length"))
    head_dim = int(
        _field_value(
            reader,
            f"{arch}.attention.key_length",
            _field_value(reader, f"{arch}.rope.dimension_count", hidden_size // num_heads),
        )
    )
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
    if experts:
        kwargs.update(
            _experts(arch, experts, need, lambda key, default=None: _field_value(reader, f"{arch}.{key}", default))
        )
    # transformers >= 5 takes rope settings as `rope_parameters`; 4.x as rope_theta/rope_scaling.
    if int(transformers.__version__.split(".")[0]) >= 5:
        kwargs["rope_parameters"] = rope
    else:
        kwargs["rope_theta"] = rope_theta
        if rope["rope_type"] != "default":
            kwargs["rope_scaling"] = {"rope_type": rope["rope_type"], "factor": rope["factor"]}
    return config_cls(**kwargs)


def _experts(arch: str, experts: int, need: Any, get: Any) -> dict[str, Any]:
    """The HF config fields of a mixture's experts from the GGUF keys (`need` / `get` read
    `<arch>.<key>`)."""
    inter = int(get("expert_feed_forward_length") or need("feed_forward_length"))
    fields: dict[str, Any] = {
        "num_experts_per_tok": int(need("expert_used_count")),
        "norm_topk_prob": bool(get("expert_weights_norm", _NORM_TOPK[arch])),
    }
    if arch == "llama":
        return {**fields, "num_local_experts": experts, "intermediate_size": inter}
    fields["num_experts"] = experts
    if arch == "olmoe":
        return {**fields, "intermediate_size": inter, "clip_qkv": None}
    fields.update(moe_intermediate_size=inter, decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "qwen2moe":
        fields["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length", 0) or 0)
    return fields
