"""HF folder loading: sharded safetensors through the index file give the same model."""

from __future__ import annotations

import json

import torch
import transformers

from pyserve.forward_batch_info import ForwardBatch, ForwardMode
from pyserve.model_executor.model_runner import ModelRunner
from pyserve.model_loader.hf_loader import safetensors_files


def test_sharded_safetensors_folder(tmp_path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=[2, 5],
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = safetensors_files(str(tmp_path))
    assert len(files) > 1 and len(files) == len(set(index["weight_map"].values()))

    runner = ModelRunner(str(tmp_path), max_total_tokens=32, load_progress=False)
    assert runner.model_config.eos_token_ids == {2, 5}
    prompt = [1, 7, 9, 11, 13]
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    slots = [1, 2, 3, 4, 5]
    batch = ForwardBatch(
        ForwardMode.EXTEND,
        1,
        t(prompt),
        t(range(5)),
        t(slots),
        t([5]),
        t([0, 5]),
        t(slots),
        extend_prefix_lens=t([0]),
        extend_seq_lens=t([5]),
    )
    logits = runner.forward(batch)
    with torch.no_grad():
        ref = hf(t([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], ref, atol=1e-5, rtol=0)
