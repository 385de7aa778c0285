"""GGUF loading of every supported tensor type, on tiny Llama files written in the test with
gguf.GGUFWriter: F32, F16, BF16, Q8_0, Q4_0, Q4_1 (quantized with gguf.quants.quantize) and the
K-quants Q4_K / Q6_K (gguf-py cannot quantize those, so blocks are built from seeded bytes with
valid scales). Loaded weights must equal gguf's own dequantization (q/k rows unpermuted) and
logits must equal HF transformers running those same weights (`--quantization none`). With
`--quantization auto` the quantized matrices stay as the file's blocks and run on the native
kernels: the blocks must decode to the same weights and the logits stay near HF's."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from pyserve.model_executor.model_runner import ModelRunner
from pyserve.model_loader.gguf_loader import unpermute_qk
from pyserve_kernels.quant import QuantizedWeight, dequantize
from tests.unit.test_model_llama import Requests

HIDDEN, HEADS, KV_HEADS, VOCAB = 256, 4, 2, 64  # K-quant rows need multiples of 256
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
# bytes per 256-value block and where the fp16 scales sit (offset of d, of dmin or None)
K_QUANTS = {"Q4_K": (144, 0, 2), "Q6_K": (210, 208, None)}


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    return f"blk.{layer}.{HF_TO_GGUF['.'.join(rest[:-1])]}.{rest[-1]}"


def permute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py row order (the inverse of unpermute_qk)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def k_quant_bytes(rows: int, cols: int, qtype: str, gen: np.random.Generator) -> np.ndarray:
    block, d_off, dmin_off = K_QUANTS[qtype]
    data = gen.integers(0, 256, size=(rows, cols // 256, block), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    data[..., d_off : d_off + 2] = scale
    if dmin_off is not None:
        data[..., dmin_off : dmin_off + 2] = scale
    return data.reshape(rows, -1)


def write_tiny_gguf(path, qtype: str, layers: int = 1) -> dict[str, torch.Tensor]:
    """Write a Llama of `layers` layers; returns the HF-named float32 weights the file decodes to."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    state = transformers.LlamaForCausalLM(config).state_dict()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(HIDDEN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    qt = gguf.GGMLQuantizationType[qtype]
    gen = np.random.default_rng(0)
    expected = {}
    for name, tensor in state.items():
        w = tensor.float()
        if "q_proj" in name:
            w = permute_qk(w, HEADS)
        elif "k_proj" in name:
            w = permute_qk(w, KV_HEADS)
        array = w.numpy()
        if w.ndim == 1 or qtype == "F32":
            data, raw = array, gguf.GGMLQuantizationType.F32
        elif qtype in K_QUANTS:
            data, raw = k_quant_bytes(*array.shape, qtype, gen), qt
        else:
            data, raw = gguf.quants.quantize(array, qt), qt
        writer.add_tensor(gguf_name(name), data, raw_dtype=raw)
        decoded = torch.from_numpy(np.array(gguf.quants.dequantize(data, raw), dtype=np.float32))
        decoded = decoded.reshape(w.shape)
        if "q_proj" in name:
            decoded = unpermute_qk(decoded, HEADS)
        elif "k_proj" in name:
            decoded = unpermute_qk(decoded, KV_HEADS)
        expected[name] = decoded
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_gguf_tensor_types_load_exactly(tmp_path, qtype: str) -> None:
    path = tmp_path / f"tiny-{qtype}.gguf"
    expected = write_tiny_gguf(path, qtype)
    runner = ModelRunner(str(path), max_total_tokens=32, load_progress=False, quantization="none")
    assert runner.quantized_weight_bytes == 0
    params = dict(runner.model.named_parameters())
    assert set(params) == set(expected)
    for name, value in expected.items():
        assert torch.equal(params[name], value), name
    # HF transformers on the same decoded weights gives the same logits
    config = runner.model_config.hf_config
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.load_state_dict(expected)
    prompt = [3, 17, 40, 9, 63, 1]
    logits = runner.forward(Requests(list(range(1, 33))).extend({0: prompt}))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    # 1e-5 relative on top: the runner's CPU float32 GEMMs are oneDNN's (layers/linear.py),
    # which sum in another order than the MKL sgemm HF's F.linear runs.
    torch.testing.assert_close(logits[0], ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_gguf_quantized_matrices_run_on_their_blocks(tmp_path, qtype: str) -> None:
    path = tmp_path / f"tiny-{qtype}.gguf"
    expected = write_tiny_gguf(path, qtype)
    runner = ModelRunner(str(path), max_total_tokens=32, load_progress=False, quantization="auto")
    model = runner.model
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    held = {
        (
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight",
        ): attn.qkv_packed,
        ("model.layers.0.self_attn.o_proj.weight",): attn.o_packed,
        ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"): mlp.gate_up_packed,
        ("model.layers.0.mlp.down_proj.weight",): mlp.down_packed,
        ("model.embed_tokens.weight",): model.model.embed_quantized,
        ("lm_head.weight",): model.lm_head_packed,
    }
    for names, weight in held.items():
        assert isinstance(weight, QuantizedWeight) and weight.qtype == qtype, names
        assert torch.equal(dequantize(weight), torch.cat([expected[n] for n in names])), names
        for name in names:  # the float copy holds no memory
            assert dict(model.named_parameters())[name].numel() == 0
    assert runner.quantized_weight_bytes == sum(w.nbytes for w in held.values())
    file_bytes = sum(t.n_bytes for t in gguf.GGUFReader(str(path)).tensors if t.tensor_type.name == qtype)
    assert runner.quantized_weight_bytes == file_bytes
    # int8 activations: logits near those of HF transformers on the decoded weights
    hf = transformers.LlamaForCausalLM(runner.model_config.hf_config).eval()
    hf.load_state_dict(expected)
    prompt = [3, 17, 40, 9, 63, 1]
    logits = runner.forward(Requests(list(range(1, 33))).extend({0: prompt}))[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    rel = float((logits - ref).abs().max() / ref.abs().max())
    assert rel < 0.02, rel
    assert torch.nn.functional.cosine_similarity(logits, ref, dim=0) > 0.999


def test_gguf_bf16_run_dtype(tmp_path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "Q8_0")
    runner = ModelRunner(str(path), dtype="bfloat16", max_total_tokens=32, load_progress=False)
    assert runner.dtype == torch.bfloat16
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    assert runner.kv_pool.get_key_buffer(0).dtype == torch.bfloat16
    logits = runner.forward(Requests(list(range(1, 33))).extend({0: [3, 17, 40]}))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_gguf_quantization_without_a_dequantizer_is_a_clear_error(tmp_path, monkeypatch) -> None:
    path = tmp_path / "tiny-Q8_0.gguf"
    write_tiny_gguf(path, "Q8_0")
    real = gguf.quants.dequantize

    def no_q8(data, qtype):  # as gguf-py answers for a type it has no dequantizer for
        if qtype == gguf.GGMLQuantizationType.Q8_0:
            raise NotImplementedError("Dequantization for Q8_0 is not yet implemented")
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", no_q8)
    with pytest.raises(ValueError, match=r"GGUF tensor \S+: quantization type Q8_0 is not supported"):
        ModelRunner(str(path), max_total_tokens=32, load_progress=False, quantization="none")
