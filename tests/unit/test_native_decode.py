"""The native decoder layer of quantized decode steps (pyserve/models/native_decode.py,
kernels/cpu/src/decoder_layer.rs): a DECODE batch through it gives the same logits, bit for
bit, as through the Python layers, and writes the same K/V into the pool; models it cannot run
keep the Python layers; bad arguments raise before anything runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyserve.model_executor.model_runner import ModelRunner
from pyserve_kernels._native import _cpu
from pyserve_kernels.quant import QUANT_TYPES
from tests.unit.test_loader_gguf_quant import write_tiny_gguf
from tests.unit.test_model_llama import Requests

pytestmark = pytest.mark.skipif(_cpu is None, reason="pyserve_kernels._cpu is not built")


def decode_both_ways(runner: ModelRunner, requests: Requests, tokens: dict[int, int]):
    """Logits, pool K/V, whether the native layers ran, and the expert-load counts the step
    added (a mixture's; else None) of one DECODE batch run natively, then again through Python."""
    model = runner.model.model
    layers = len(list(model.decoder_layers()))
    out = []
    for native in (True, False):
        model._native_layers = False if native else None  # False: build on first use
        batch = requests.decode(tokens)
        load = getattr(runner.model, "expert_load", None)
        before = None if load is None else load.total.copy()
        logits = runner.forward(batch)
        counts = None if load is None else load.total - before
        k = torch.stack([runner.kv_pool.get_key_buffer(i)[batch.out_cache_loc] for i in range(layers)])
        v = torch.stack([runner.kv_pool.get_value_buffer(i)[batch.out_cache_loc] for i in range(layers)])
        out.append((logits, k, v, model.native_layers() is not None, counts))
        for rid in tokens:  # forget the step, so the second run decodes the same positions
            requests.tokens[rid].pop()
            requests.free_slots.insert(0, requests.slots[rid].pop())
    return out


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_native_decode_equals_the_python_layers(tmp_path, qtype: str) -> None:
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_tiny_gguf(path, qtype, layers=2)
    runner = ModelRunner(str(path), max_total_tokens=64, load_progress=False, quantization="auto")
    requests = Requests(list(range(1, 64)))
    prompts = {0: [3, 17, 40, 9], 1: [5, 2], 2: [60, 61, 62, 1, 7, 8, 9], 3: [8], 4: [2, 4, 6], 5: [1, 1]}
    runner.forward(requests.extend(prompts))
    # one request (a one-row product), three (row by row), six (a tile of activation rows)
    steps = [{0: 11, 1: 12, 2: 13}, {0: 20}, {2: 4, 1: 33}, {r: 40 + r for r in range(6)}]
    for step, tokens in enumerate(steps):
        (nl, nk, nv, used, _), (pl, pk, pv, _, _) = decode_both_ways(runner, requests, tokens)
        assert used, "the quantized model should run its decode steps natively"
        assert torch.equal(nl, pl), (step, (nl - pl).abs().max())
        assert torch.equal(nk, pk) and torch.equal(nv, pv), step
        batch = requests.decode(tokens)  # keep the step, so the next one has a longer context
        runner.forward(batch)


def test_float_model_keeps_the_python_layers(tmp_path) -> None:
    path = tmp_path / "tiny-f32.gguf"
    write_tiny_gguf(path, "F32", layers=2)
    runner = ModelRunner(str(path), max_total_tokens=32, load_progress=False, quantization="auto")
    assert runner.model.model.native_layers() is None


def test_bad_arguments_raise(tmp_path) -> None:
    path = tmp_path / "tiny-q8.gguf"
    write_tiny_gguf(path, "Q8_0", layers=1)
    runner = ModelRunner(str(path), max_total_tokens=32, load_progress=False, quantization="auto")
    (native,) = runner.model.model.native_layers()
    layer = runner.model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    norm = layer.input_layernorm.weight.numpy()
    q8 = QUANT_TYPES["Q8_0"][0]
    with pytest.raises(ValueError, match=r"qkv is \[\d+, \d+\], expected"):
        _cpu.QuantDecoderLayer(
            norm,
            norm,
            1e-5,
            mlp.down_packed.data,
            q8,
            attn.o_packed.data,
            q8,
            mlp.gate_up_packed.data,
            q8,
            mlp.down_packed.data,
            q8,
            4,
            2,
            64,
        )
    hidden = np.zeros((1, 256), np.float32)
    residual = np.zeros_like(hidden)
    cos = np.ones((1, 64), np.float32)
    k = runner.kv_pool.get_key_buffer(0).numpy()
    v = runner.kv_pool.get_value_buffer(0).numpy()
    ints = lambda *xs: np.array(xs, dtype=np.int32)  # noqa: E731
    with pytest.raises(IndexError, match="outside the pool"):
        native.forward(hidden, residual, True, cos, cos, k, v, ints(k.shape[0]), ints(0, 1), ints(0), 0.125)
    same = torch.zeros(1, 256)  # two numpy views of one tensor: numpy cannot see they overlap
    with pytest.raises(ValueError, match="overlaps"):
        native.forward(same.numpy(), same.numpy(), True, cos, cos, k, v, ints(0), ints(0, 1), ints(0), 0.125)
    with pytest.raises(ValueError, match=r"cos/sin must be"):
        native.forward(hidden, residual, True, cos[:, :32], cos[:, :32], k, v, ints(0), ints(0, 1), ints(0), 0.125)
