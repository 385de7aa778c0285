"""The BERT encoder and the poolers: a tiny seeded BertModel against HF transformers' on a
ragged batch (each row also equal to its sequence run alone), every pooling mode against its
definition, and the pooling a sentence-transformers folder declares."""

from __future__ import annotations

import json
import types

import pytest
import torch
import torch.nn.functional as F
import transformers

from pyserve.layers.pooler import PoolingSpec, pool, sentence_transformers_pooling
from pyserve.models import bert
from pyserve.models.bert import BertModel, RaggedLayout, ragged_attention
from pyserve.models.registry import get_model_class

CONFIG = dict(
    vocab_size=120,
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=96,
    max_position_embeddings=64,
    type_vocab_size=2,
    layer_norm_eps=1e-12,
    hidden_act="gelu",
)
PROMPTS = [[101, 7, 19, 33, 102], [101, 5, 102], [101] + list(range(20, 60)) + [102], [3]]


def hf_bert() -> transformers.BertModel:
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(**CONFIG)).eval()
    with torch.no_grad():  # non-trivial LayerNorms and biases, so a misplaced one shows
        for name, p in model.named_parameters():
            if "LayerNorm.weight" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def ours(hf: transformers.BertModel, prepacked: bool) -> BertModel:
    model = BertModel(hf.config)
    model.load_weights(("bert." + k if i % 2 else k, v) for i, (k, v) in enumerate(hf.state_dict().items()))
    if prepacked:
        assert model.prepack_linear_weights() > 0
    return model


def batch_of(prompts: list[list[int]]) -> types.SimpleNamespace:
    """What BertModel reads of a ForwardBatch: ids, positions restarting per sequence, lengths."""
    return types.SimpleNamespace(
        input_ids=torch.tensor([t for p in prompts for t in p], dtype=torch.int32),
        positions=torch.tensor([i for p in prompts for i in range(len(p))], dtype=torch.int32),
        extend_seq_lens=torch.tensor([len(p) for p in prompts], dtype=torch.int32),
    )


@pytest.mark.parametrize("prepacked", [False, True], ids=["F.linear", "onednn-packed"])
def test_bert_matches_transformers_on_a_ragged_batch(prepacked: bool) -> None:
    hf = hf_bert()
    model = ours(hf, prepacked)
    assert get_model_class("BertModel") is BertModel
    hidden = model(batch_of(PROMPTS))
    assert hidden.shape == (sum(map(len, PROMPTS)), CONFIG["hidden_size"])
    start = 0
    for prompt in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).last_hidden_state[0]
        rows = hidden[start : start + len(prompt)]
        torch.testing.assert_close(rows, ref, atol=1e-5, rtol=0)
        alone = model(batch_of([prompt]))  # the same sequence without the others
        torch.testing.assert_close(rows, alone, atol=1e-6, rtol=0)
        start += len(prompt)


@pytest.mark.parametrize(("group_size", "native"), [(1, False), (2, False), (16, False), (16, True)])
def test_ragged_attention_is_per_sequence_sdpa(monkeypatch, group_size: int, native: bool) -> None:
    monkeypatch.setattr(bert, "GROUP_SIZE", group_size)
    torch.manual_seed(1)
    lens, heads, dim = [3, 1, 6, 2, 5], 2, 4
    qkv = torch.randn(sum(lens), 3 * heads * dim)
    layout = RaggedLayout(lens, qkv.device, native=native)
    assert (layout.cu_seqlens is not None) == native and (not layout.groups) == native
    out = ragged_attention(qkv, layout, heads)
    start = 0
    for n in lens:
        q, k, v = (t.view(n, heads, dim).transpose(0, 1) for t in qkv[start : start + n].split(heads * dim, dim=1))
        ref = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(n, heads * dim)
        torch.testing.assert_close(out[start : start + n], ref, atol=1e-6, rtol=0)
        start += n


def test_poolers_follow_their_definitions() -> None:
    hidden = torch.arange(18, dtype=torch.float32).view(6, 3)  # sequences of 2, 3 and 1 tokens
    lens = [2, 3, 1]
    torch.testing.assert_close(
        pool(hidden, lens, PoolingSpec("mean", normalize=False)),
        torch.tensor([[1.5, 2.5, 3.5], [9.0, 10.0, 11.0], [15.0, 16.0, 17.0]]),
    )
    cls = pool(hidden, lens, PoolingSpec("cls", normalize=False))
    assert cls.tolist() == [[0.0, 1.0, 2.0], [6.0, 7.0, 8.0], [15.0, 16.0, 17.0]]
    last = pool(hidden, lens, PoolingSpec("last", normalize=False))
    assert last.tolist() == [[3.0, 4.0, 5.0], [12.0, 13.0, 14.0], [15.0, 16.0, 17.0]]
    normed = pool(hidden, lens, PoolingSpec("last"))
    torch.testing.assert_close(normed, last / last.norm(dim=1, keepdim=True))
    with pytest.raises(ValueError, match="pooling mode 'max' is not supported"):
        PoolingSpec("max")


def _st_folder(tmp_path, pooling: dict, normalize: bool) -> str:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **pooling}))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("key", "mode", "normalize"),
    [
        ("pooling_mode_mean_tokens", "mean", True),
        ("pooling_mode_cls_token", "cls", False),
        ("pooling_mode_lasttoken", "last", True),
    ],
)
def test_sentence_transformers_pooling_is_read_from_the_folder(tmp_path, key, mode, normalize) -> None:
    folder = _st_folder(tmp_path, {key: True, "pooling_mode_max_tokens": False}, normalize)
    assert sentence_transformers_pooling(folder) == PoolingSpec(mode, normalize)


def test_unknown_pooling_is_refused_and_a_plain_folder_declares_none(tmp_path) -> None:
    assert sentence_transformers_pooling(str(tmp_path)) is None
    folder = _st_folder(tmp_path, {"pooling_mode_max_tokens": True}, True)
    with pytest.raises(ValueError, match=r"pooling \['pooling_mode_max_tokens'\] is not supported"):
        sentence_transformers_pooling(folder)


def test_a_pipeline_pyserve_does_not_run_is_refused(tmp_path) -> None:
    folder = _st_folder(tmp_path, {"pooling_mode_mean_tokens": True}, True)
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="the sentence-transformers module sentence_transformers.models.Dense"):
        sentence_transformers_pooling(folder)


def test_relative_position_embeddings_are_refused() -> None:
    config = transformers.BertConfig(**dict(CONFIG, position_embedding_type="relative_key"))
    with pytest.raises(ValueError, match="position_embedding_type 'relative_key' is not supported"):
        BertModel(config)
