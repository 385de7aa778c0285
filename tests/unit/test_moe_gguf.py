"""Mixtures of experts from GGUF files written in the test with gguf.GGUFWriter (seeded random
weights of tiny OLMoE, Qwen2-MoE, Qwen3-MoE and Mixtral configs, experts stacked as llama.cpp
stores them: `ffn_{gate,up,down}_exps`, the router `ffn_gate_inp`, Qwen2-MoE's shared expert
`*_shexp`). Dequantized (`--quantization none`) the model must give HF transformers' logits on
the decoded weights; kept quantized, the experts run on their blocks on the native kernel
(kernels/cpu/src/moe.rs), near the dequantized model (int8 activations), and a request's
logits are the same bits whatever batch it runs in."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from pyserve.model_executor.model_runner import ModelRunner
from pyserve.models.llama import LlamaForCausalLM
from pyserve_kernels.quant import QuantizedWeight, dequantize
from tests.unit.test_loader_gguf_quant import permute_qk
from tests.unit.test_model_llama import Requests
from tests.unit.test_moe_models import moe_config

ARCH = {"olmoe": "olmoe", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama"}
NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def gguf_config(family: str) -> transformers.PretrainedConfig:
    """The family's tiny test config as a GGUF can state it: every layer sparse, no q/k/v clip;
    Qwen2-MoE's shared expert as wide as whole blocks of 32 (so it runs quantized too)."""
    config = moe_config(family)
    if family == "qwen2_moe":
        config.mlp_only_layers = []
        config.shared_expert_intermediate_size = 64
    if family == "qwen3_moe":
        config.decoder_sparse_step = 1
    if family == "olmoe":
        config.clip_qkv = None
    return config


def write_moe_gguf(path, family: str, qtype: str) -> tuple[transformers.PretrainedConfig, dict[str, torch.Tensor]]:
    """Write the family's seeded random model; matrices whose rows are whole blocks in `qtype`
    (the router and 1-D tensors stay F32). Returns the config and the HF state dict the file
    decodes to."""
    config = gguf_config(family)
    torch.manual_seed(0)
    state = transformers.AutoModelForCausalLM.from_config(config).state_dict()
    arch = ARCH[family]
    experts = config.num_local_experts if family == "mixtral" else config.num_experts
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(128)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(
        config.head_dim if family == "qwen3_moe" else config.hidden_size // config.num_attention_heads
    )
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(inter)
    if family == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    qt = gguf.GGMLQuantizationType[qtype]
    decoded: dict[str, torch.Tensor] = {}

    def add(gguf_name: str, w: torch.Tensor, quantize: bool = True) -> torch.Tensor:
        array = w.float().numpy()
        if not quantize or w.ndim == 1 or array.shape[-1] % 32:
            data, raw = array, gguf.GGMLQuantizationType.F32
        else:
            data, raw = gguf.quants.quantize(array, qt), qt
        writer.add_tensor(gguf_name, data, raw_dtype=raw)
        return torch.from_numpy(np.array(gguf.quants.dequantize(data, raw), dtype=np.float32)).reshape(w.shape)

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for name, tensor in state.items():
        if name in NAMES:
            decoded[name] = add(NAMES[name], tensor)
            continue
        _, _, layer, *rest = name.split(".")
        stem, suffix = ".".join(rest[:-1]), rest[-1]
        blk = f"blk.{layer}"
        if stem == "mlp.experts":  # stacked: gate|up [E, 2I, H] as two tensors, down [E, H, I]
            if suffix == "gate_up_proj":
                gate = add(f"{blk}.ffn_gate_exps.weight", tensor[:, :inter])
                up = add(f"{blk}.ffn_up_exps.weight", tensor[:, inter:])
                decoded[name] = torch.cat([gate, up], dim=1)
            else:
                decoded[name] = add(f"{blk}.ffn_down_exps.weight", tensor)
            continue
        w = tensor
        permute = family == "mixtral" and stem in ("self_attn.q_proj", "self_attn.k_proj")
        if permute:
            w = permute_qk(w, heads if stem.endswith("q_proj") else kv_heads)
        if stem == "mlp.shared_expert_gate":
            w = w.reshape(-1)
        out = add(f"{blk}.{BLOCK[stem]}.{suffix}", w, quantize=stem != "mlp.gate")
        if permute:  # back to HF's row order
            from pyserve.model_loader.gguf_loader import unpermute_qk

            out = unpermute_qk(out, heads if stem.endswith("q_proj") else kv_heads)
        decoded[name] = out.reshape(tensor.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return config, decoded


FAMILIES = ["olmoe", "qwen2_moe", "qwen3_moe", "mixtral"]
PROMPT = [3, 17, 40, 9, 63, 1, 22, 5]


def hf_logits(config, state: dict[str, torch.Tensor], prompt: list[int]) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.load_state_dict(state)
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, -1]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_dequantized_gguf_mixture_equals_hf(tmp_path, family: str) -> None:
    path = tmp_path / f"{family}.gguf"
    config, decoded = write_moe_gguf(path, family, "Q8_0")
    runner = ModelRunner(str(path), max_total_tokens=64, load_progress=False, quantization="none")
    assert runner.model_config.architecture == type(transformers.AutoModelForCausalLM.from_config(config)).__name__
    logits = runner.forward(Requests(list(range(1, 33))).extend({0: PROMPT}))[0]
    torch.testing.assert_close(logits, hf_logits(config, decoded, PROMPT), atol=1e-4, rtol=1e-5)


def quantized_runner(path) -> ModelRunner:
    return ModelRunner(str(path), max_total_tokens=512, load_progress=False, quantization="auto")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantized_experts_run_on_their_blocks_near_the_dequantized_model(tmp_path, family: str, qtype: str) -> None:
    path = tmp_path / f"{family}-{qtype}.gguf"
    config, decoded = write_moe_gguf(path, family, qtype)
    runner = quantized_runner(path)
    model = runner.model
    assert isinstance(model, LlamaForCausalLM)
    for i, layer in enumerate(model.model.decoder_layers()):
        experts = layer.mlp.experts
        assert isinstance(experts.gate_up_quant, QuantizedWeight) and experts.gate_up_quant.qtype == qtype
        assert isinstance(experts.down_quant, QuantizedWeight)
        e = experts.num_experts
        stacked = decoded[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        assert torch.equal(dequantize(experts.gate_up_quant), stacked.reshape(-1, stacked.shape[-1]))
        down = decoded[f"model.layers.{i}.mlp.experts.down_proj"]
        assert torch.equal(dequantize(experts.down_quant), down.reshape(e * down.shape[1], -1))
        assert experts.gate_up_proj.numel() == 0 and experts.down_proj.numel() == 0
    file_bytes = sum(t.n_bytes for t in gguf.GGUFReader(str(path)).tensors if t.tensor_type.name == qtype)
    assert runner.quantized_weight_bytes == file_bytes
    # int8 activations: near the dequantized weights' logits (the dense layers' bound, as
    # tests/unit/test_loader_gguf_quant.py holds them)
    logits = runner.forward(Requests(list(range(1, 33))).extend({0: PROMPT}))[0]
    ref = hf_logits(config, decoded, PROMPT)
    rel = float((logits - ref).abs().max() / ref.abs().max())
    assert rel < 0.02, rel
    assert torch.nn.functional.cosine_similarity(logits, ref, dim=0) > 0.999


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantized_experts_give_the_same_bits_at_any_batch_size(tmp_path, family: str, qtype: str) -> None:
    """Each MoE layer of the loaded model (router, quantized experts and, for Qwen2-MoE, the
    quantized shared expert): a token's output alone equals its row in a batch of 1 to 8, bit
    for bit. (The whole model is not batch-invariant: its float attention and norms are not
    held to that.)"""
    path = tmp_path / f"{family}-{qtype}.gguf"
    config, _ = write_moe_gguf(path, family, qtype)
    runner = quantized_runner(path)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, config.hidden_size, generator=gen)
    for layer in runner.model.model.decoder_layers():
        moe = layer.mlp
        assert moe.experts.gate_up_quant is not None
        with torch.no_grad():
            alone = [moe(x[t : t + 1]) for t in range(8)]
            for batch in (2, 5, 8):
                together = moe(x[:batch])
                for t in range(batch):
                    assert torch.equal(together[t : t + 1], alone[t]), (batch, t)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_dequantized_gguf_experts_come_out_per_expert_and_shard_by_rank(tmp_path, family: str) -> None:
    """`--quantization none` (and every rank under --tp-size): a GGUF's stacked experts come out
    as the per-expert tensors an HF checkpoint holds, so they load and shard as those do; rank
    1 of 2 gets the second half of each expert's intermediate size."""
    from pyserve.distributed.shard import ShardLayout
    from pyserve.model_loader.config import ModelConfig
    from pyserve.model_loader.weights import iter_weights
    from tests.unit.test_moe_models import per_expert

    path = tmp_path / f"{family}.gguf"
    config, decoded = write_moe_gguf(path, family, "Q8_0")
    model_config = ModelConfig.from_path(str(path), dtype="float32")
    got = dict(iter_weights(model_config, progress=False))
    want = dict(per_expert(decoded, mixtral=False))  # Qwen's per-expert names for every family
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    layout = ShardLayout.of(config, 1, 2, expert_parallel=False)
    rank1 = dict(iter_weights(model_config, progress=False, layout=layout))
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    gate = want["model.layers.1.mlp.experts.3.gate_proj.weight"]
    assert torch.equal(rank1["model.layers.1.mlp.experts.3.gate_proj.weight"], gate[inter // 2 :])
    down = want["model.layers.0.mlp.experts.0.down_proj.weight"]
    assert torch.equal(rank1["model.layers.0.mlp.experts.0.down_proj.weight"], down[:, inter // 2 :])


def test_a_gguf_without_tokenizer_metadata_says_what_to_give(tmp_path) -> None:
    from pyserve.model_loader.tokenizer import get_tokenizer

    path = tmp_path / "olmoe-Q8_0.gguf"
    write_moe_gguf(path, "olmoe", "Q8_0")  # the writer adds no tokenizer.ggml.* fields
    with pytest.raises(ValueError, match=r"holds no tokenizer \(no tokenizer.ggml.model\): give --tokenizer-path$"):
        get_tokenizer(str(path))
