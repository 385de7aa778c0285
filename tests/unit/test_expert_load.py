"""The expert load record (pyserve/layers/expert_load.py): counts added on the model's device
without a host read (so CUDA graphs can capture a mixture's step), padding rows (KV slot 0)
left out, records as differences of snapshots; and when a mixture's step can be captured."""

from __future__ import annotations

import numpy as np
import torch

from pyserve.layers.expert_load import ExpertLoad
from pyserve.layers.moe import SparseMoeBlock
from pyserve.model_executor.model_runner import ModelRunner
from pyserve.models.moe import Qwen3MoeForCausalLM
from tests.unit.test_model_llama import Requests
from tests.unit.test_moe_models import hf_model, moe_config


def test_counts_leave_out_padding_rows_and_records_are_snapshots() -> None:
    load = ExpertLoad([0, 2], num_experts=4)
    load.add(0, torch.tensor([[3, 3]]))
    load.stop()  # no record yet: still none
    assert np.array_equal(load.recorded, np.zeros((2, 4), np.int64))
    load.counts.zero_()
    load.set_valid(torch.tensor([7, 0, 9]))  # the middle row is a padded graph row
    load.add(0, torch.tensor([[1, 3], [1, 2], [3, 0]]))
    assert load.total.tolist() == [[1, 1, 0, 2], [0, 0, 0, 0]]
    load.start()
    load.valid = None
    load.add(1, torch.tensor([[2, 2]]))
    assert load.recorded.tolist() == [[0, 0, 0, 0], [0, 0, 2, 0]]
    load.stop()
    load.add(1, torch.tensor([[0, 1]]))  # after the record: in the totals only
    load.stop()  # a second stop keeps the record
    assert load.recorded.tolist() == [[0, 0, 0, 0], [0, 0, 2, 0]]
    assert load.total.tolist() == [[1, 1, 0, 2], [1, 1, 2, 0]]
    load.publish()  # CPU: the totals are the counts themselves
    assert load.total.tolist() == load.counts.tolist()


def test_the_published_totals_live_on_the_host_whatever_the_default_device() -> None:
    with torch.device("meta"):  # as a model built on a GPU under `with torch.device("cuda")`
        load = ExpertLoad([0, 1], num_experts=3, device="meta")
    assert load.counts.device.type == "meta"
    assert isinstance(load.total, np.ndarray) and load.total.tolist() == [[0, 0, 0], [0, 0, 0]]


def test_a_mixture_step_counts_its_real_tokens_only(tmp_path) -> None:
    """A batch whose first token is written to slot 0 (as a captured graph's padding rows are)
    counts the other tokens: top_k per token per sparse layer."""
    hf = hf_model("mixtral")
    hf.save_pretrained(tmp_path)
    runner = ModelRunner(str(tmp_path), max_total_tokens=64, load_progress=False)
    load = runner.expert_load()
    assert load is not None and load.total.sum() == 0
    runner.forward(Requests(list(range(0, 64))).extend({0: [5, 9, 11, 40], 1: [3, 17]}))
    top_k = hf.config.num_experts_per_tok
    assert load.total.sum(axis=1).tolist() == [5 * top_k] * hf.config.num_hidden_layers
    assert load.valid is None  # not left over for a later forward


def test_expert_parallelism_or_no_triton_is_not_capturable(monkeypatch) -> None:
    import pyserve.models.moe

    config = moe_config("qwen3_moe")
    model = Qwen3MoeForCausalLM(config)
    monkeypatch.setattr(pyserve.models.moe, "triton_available", lambda: True)
    assert model.graph_capturable()
    monkeypatch.setattr(pyserve.models.moe, "triton_available", lambda: False)
    assert not model.graph_capturable()  # torch's expert loop reads the counts on the host
    monkeypatch.setattr(pyserve.models.moe, "triton_available", lambda: True)
    block = next(layer.mlp for layer in model.model.decoder_layers() if isinstance(layer.mlp, SparseMoeBlock))
    block.expert_range = (0, config.num_experts // 2)
    assert not model.graph_capturable()
