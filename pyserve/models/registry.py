"""Map HF `architectures` names (config.json) to pyserve model classes."""

from __future__ import annotations

import importlib

# architecture name -> (module, class name); imported lazily so one broken model file does not
# break the others.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("pyserve.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("pyserve.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("pyserve.models.qwen3", "Qwen3ForCausalLM"),
    "MistralForCausalLM": ("pyserve.models.mistral", "MistralForCausalLM"),
    "Qwen2MoeForCausalLM": ("pyserve.models.moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("pyserve.models.moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("pyserve.models.moe", "MixtralForCausalLM"),
    "OlmoeForCausalLM": ("pyserve.models.moe", "OlmoeForCausalLM"),
    "BertModel": ("pyserve.models.bert", "BertModel"),
}


def supported_architectures() -> list[str]:
    """Sorted names of all supported architectures."""
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type:
    """The model class for `architecture` (e.g. "LlamaForCausalLM").

    Raises ValueError naming the supported architectures when it is not supported.
    """
    if architecture not in _MODELS:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    module_name, class_name = _MODELS[architecture]
    return getattr(importlib.import_module(module_name), class_name)
