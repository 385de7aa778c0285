"""The native decoder layer (kernels/cpu/src/decoder_layer.rs) on GGUF mixtures and q/k-normed
attention: OLMoE (q and k normed across all heads), Qwen3-MoE (per head) and Mixtral decode
natively with the same logits, K/V and expert-load counts, bit for bit, as the Python layers;
Qwen2-MoE (q/k/v biases, a shared expert) keeps the Python layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyserve_kernels._native import _cpu
from tests.unit.test_model_llama import Requests
from tests.unit.test_moe_gguf import quantized_runner, write_moe_gguf
from tests.unit.test_native_decode import decode_both_ways

pytestmark = pytest.mark.skipif(_cpu is None, reason="pyserve_kernels._cpu is not built")

PROMPTS = {0: [3, 17, 40, 9], 1: [5, 2], 2: [60, 61, 62, 1, 7, 8, 9], 3: [8], 4: [2, 4, 6], 5: [1, 1]}
STEPS = [{0: 11, 1: 12, 2: 13}, {0: 20}, {2: 4, 1: 33}, {r: 40 + r for r in range(6)}]


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_native_mixture_decode_equals_the_python_layers(tmp_path, family: str, qtype: str) -> None:
    path = tmp_path / f"{family}-{qtype}.gguf"
    write_moe_gguf(path, family, qtype)
    runner = quantized_runner(path)
    load = runner.model.expert_load
    requests = Requests(list(range(1, 128)))
    runner.forward(requests.extend(PROMPTS))
    at_start = load.total.copy()
    load.start()
    top_k = runner.model_config.hf_config.num_experts_per_tok
    for step, tokens in enumerate(STEPS):
        (nl, nk, nv, used, nc), (pl, pk, pv, _, pc) = decode_both_ways(runner, requests, tokens)
        assert used, "the quantized mixture should run its decode steps natively"
        assert torch.equal(nl, pl), (step, (nl - pl).abs().max())
        assert torch.equal(nk, pk) and torch.equal(nv, pv), step
        assert np.array_equal(nc, pc), step  # the same experts counted
        assert (nc.sum(axis=1) == len(tokens) * top_k).all(), step  # every token, k experts, each layer
        runner.forward(requests.decode(tokens))
    assert np.array_equal(load.recorded, load.total - at_start)


def test_a_mixture_with_biases_and_a_shared_expert_keeps_the_python_layers(tmp_path) -> None:
    path = tmp_path / "qwen2_moe-Q8_0.gguf"
    write_moe_gguf(path, "qwen2_moe", "Q8_0")
    assert quantized_runner(path).model.model.native_layers() is None


def test_bad_mixture_arguments_raise(tmp_path) -> None:
    path = tmp_path / "olmoe-Q8_0.gguf"
    config, _ = write_moe_gguf(path, "olmoe", "Q8_0")
    runner = quantized_runner(path)
    (native, *_) = runner.model.model.native_layers()
    layer = runner.model.model.layers[0]
    attn, block = layer.self_attn, layer.mlp
    norm = layer.input_layernorm.weight.numpy()
    router = block.gate.weight.numpy()
    heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
    projections = [attn.qkv_packed, attn.o_packed, block.experts.gate_up_quant, block.experts.down_quant]
    args = [norm, norm, 1e-5] + [a for w in projections for a in (w.data, w.type_id)] + list(heads)
    qk = {"q_norm": attn.q_norm.weight.numpy(), "k_norm": attn.k_norm.weight.numpy()}

    def make(**kw):
        return _cpu.QuantDecoderLayer(*args, **{**qk, "router": router, "top_k": 2, **kw})

    make()  # the arguments as the model passes them
    with pytest.raises(ValueError, match=r"top_k 9 must be in 1..=8"):
        make(top_k=9)
    with pytest.raises(ValueError, match=r"router of \d+ floats is not \[E, "):
        make(router=router[:, :-1].copy())
    with pytest.raises(ValueError, match=r"gate_up is \[\d+, \d+\], expected"):
        make(router=router[:4].copy())  # 4 experts' router over 8 experts' rows
    with pytest.raises(ValueError, match="q/k norm weights do not fit"):
        make(qk_norm_per_head=True)
    with pytest.raises(ValueError, match="q_norm and k_norm come together"):
        make(k_norm=None)
    hidden = np.ones((1, config.hidden_size), np.float32)
    residual = np.zeros_like(hidden)
    cos = np.ones((1, attn.head_dim), np.float32)
    k = runner.kv_pool.get_key_buffer(0).numpy()
    v = runner.kv_pool.get_value_buffer(0).numpy()
    ints = lambda *xs: np.array(xs, dtype=np.int32)  # noqa: E731
    with pytest.raises(ValueError, match="an expert count row has 7 entries for 8 experts"):
        counts = [np.zeros(7, np.int64)]
        k1, v1 = k[1].copy(), v[1].copy()
        native.forward(hidden, residual, True, cos, cos, k, v, ints(1), ints(0, 1), ints(1), 0.125, None, 1, counts)
    # refused before any write: the residual, the pool and the input as they were
    assert not residual.any() and (hidden == 1).all()
    assert np.array_equal(k[1], k1) and np.array_equal(v[1], v1)
