"""Every supported family (Llama, Qwen2, Qwen3, Mistral) against HF transformers on tiny
random-weight models built from seeded configs: logits of a prefill, of an extend on a cached
prefix and of 32 decode steps within 1e-4 (float32), greedy tokens identical, at batch sizes 1
and 8 with ragged lengths. Also: loading a saved checkpoint (single and sharded safetensors)
through the registry."""

from __future__ import annotations

import pytest
import torch
import transformers

from pyserve.layers.attention.cpu_backend import CpuAttnBackend
from pyserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from pyserve.layers.rotary_embedding import compute_inv_freq
from pyserve.mem_cache.memory_pool import MHATokenToKVPool
from pyserve.model_executor.model_runner import ModelRunner
from pyserve.models.registry import get_model_class
from tests.unit.test_model_llama import Requests

V5 = int(transformers.__version__.split(".")[0]) >= 5
COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
)


def _rope(kwargs: dict, rope: dict) -> dict:
    if V5:
        kwargs["rope_parameters"] = rope
    else:
        kwargs["rope_theta"] = rope.pop("rope_theta")
        kwargs["rope_scaling"] = rope if rope["rope_type"] != "default" else None
    return kwargs


def family_config(family: str) -> transformers.PretrainedConfig:
    """A tiny seeded config per family exercising what that family adds."""
    if family == "llama":  # llama3 rope scaling, untied head
        return transformers.LlamaConfig(
            **_rope(
                dict(COMMON, tie_word_embeddings=False),
                {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
            )
        )
    if family == "llama_dynamic":  # dynamic NTK rope, MHA, tied head
        return transformers.LlamaConfig(
            **_rope(
                dict(COMMON, num_key_value_heads=4, tie_word_embeddings=True),
                {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
            )
        )
    if family == "qwen2":  # q/k/v bias, tied head
        return transformers.Qwen2Config(
            **_rope(dict(COMMON, tie_word_embeddings=True), {"rope_type": "default", "rope_theta": 1000000.0})
        )
    if family == "qwen3":  # q/k norm, head_dim != hidden / heads
        return transformers.Qwen3Config(
            **_rope(
                dict(COMMON, head_dim=32, tie_word_embeddings=False), {"rope_type": "default", "rope_theta": 1000000.0}
            )
        )
    if family == "mistral":  # sliding window of 8 tokens (shorter than the sequences)
        return transformers.MistralConfig(
            **_rope(
                dict(COMMON, sliding_window=8, tie_word_embeddings=False),
                {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
            )
        )
    raise ValueError(family)


HF_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "llama_dynamic": transformers.LlamaForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "mistral": transformers.MistralForCausalLM,
}


def hf_model(family: str) -> transformers.PreTrainedModel:
    config = family_config(family)
    torch.manual_seed(0)
    model = HF_CLASSES[family](config).eval()
    with torch.no_grad():  # non-trivial norm weights and biases, so a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("attention", ["torch_native", "cpu"])
@pytest.mark.parametrize("prepacked", [False, True], ids=["F.linear", "onednn-packed"])
@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("family", ["llama", "llama_dynamic", "qwen2", "qwen3", "mistral"])
def test_family_matches_transformers(family: str, batch_size: int, prepacked: bool, attention: str) -> None:
    hf = hf_model(family)
    config = hf.config
    model = get_model_class(type(hf).__name__)(config, dtype=torch.float32, device="cpu")
    model.load_weights(hf.state_dict().items())
    if prepacked:  # the CPU float32 path ModelRunner takes (pyserve/layers/linear.py)
        projections = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
        assert model.prepack_linear_weights() == 4 * (projections + model.lm_head_weight().numel())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pool_size = batch_size * 80
    pool = MHATokenToKVPool(
        pool_size, config.num_hidden_layers, config.num_key_value_heads, head_dim, torch.float32, "cpu"
    )
    # cpu: decode through the native kernel (pyserve_kernels.decode_attention)
    backend = {"torch_native": TorchNativeAttnBackend, "cpu": CpuAttnBackend}[attention](pool)
    gen = torch.Generator().manual_seed(batch_size)
    reqs = Requests((torch.randperm(pool_size, generator=gen) + 1).tolist())
    rids = list(range(batch_size))
    prompt_lens = [3 + (7 * i) % 13 for i in rids]  # ragged: 3..15
    prompts = {r: torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for r, n in zip(rids, prompt_lens)}
    ours: dict[int, list[torch.Tensor]] = {r: [] for r in rids}  # logits per step
    positions: dict[int, list[int]] = {r: [] for r in rids}

    def step(batch, order: list[int]) -> list[int]:
        backend.init_forward_metadata(batch)
        logits = model(batch, backend)
        for row, rid in enumerate(order):
            ours[rid].append(logits[row])
            positions[rid].append(len(reqs.tokens[rid]) - 1)
        return logits.argmax(-1).tolist()

    # Prefill the first part of each prompt, then extend with the rest on the cached prefix.
    step(reqs.extend({r: p[: max(1, len(p) // 2)] for r, p in prompts.items()}), rids)
    next_ids = step(reqs.extend({r: p[max(1, len(p) // 2) :] for r, p in prompts.items()}), rids)
    for _ in range(32):
        next_ids = step(reqs.decode(dict(zip(rids, next_ids))), rids)
    with torch.no_grad():
        for rid in rids:
            seq = reqs.tokens[rid]
            ref = hf(torch.tensor([seq]), use_cache=False).logits[0]
            got = torch.stack(ours[rid])
            torch.testing.assert_close(got, ref[positions[rid]], atol=1e-4, rtol=0)
            # greedy tokens: each token we fed back is HF's argmax at the previous position
            fed = seq[len(prompts[rid]) :]
            assert fed == ref[len(prompts[rid]) - 1 : len(seq) - 1].argmax(-1).tolist()
    if batch_size == 1:  # and HF's own greedy generate agrees, KV cache and all
        hf.generation_config.eos_token_id = None
        out = hf.generate(
            torch.tensor([prompts[0]]), max_new_tokens=33, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert out[0, len(prompts[0]) :].tolist() == reqs.tokens[0][len(prompts[0]) :] + [next_ids[0]]


def test_dynamic_rope_beyond_context_matches_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = family_config("llama_dynamic")
    head_dim = config.hidden_size // config.num_attention_heads
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0, "max_position_embeddings": 128}
    for seq_len in (64, 128, 300):
        ref, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=seq_len)
        torch.testing.assert_close(compute_inv_freq(head_dim, rope, seq_len), ref, atol=0, rtol=1e-6)


@pytest.mark.parametrize("sharded", [False, True])
def test_load_saved_checkpoint(tmp_path, sharded: bool) -> None:
    hf = hf_model("qwen3")
    hf.save_pretrained(tmp_path, max_shard_size="40KB" if sharded else "1GB")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert ("model.safetensors.index.json" in names) == sharded
    runner = ModelRunner(str(tmp_path), max_total_tokens=64, load_progress=False)
    assert runner.model_config.architecture == "Qwen3ForCausalLM"
    assert type(runner.model).__name__ == "Qwen3ForCausalLM"
    reqs = Requests(list(range(1, 65)))
    prompt = [5, 9, 11, 40, 3]
    logits = runner.forward(reqs.extend({0: prompt}))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], ref, atol=1e-4, rtol=0)


def test_unsupported_architecture_fails_at_start(tmp_path) -> None:
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"'GPT2LMHeadModel' is not supported; supported: BertModel, LlamaForCausalLM, "
        r"MistralForCausalLM, MixtralForCausalLM, OlmoeForCausalLM, Qwen2ForCausalLM, "
        r"Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM$",
    ):
        ModelRunner(str(tmp_path), max_total_tokens=64, load_progress=False)


def test_load_format_dummy_reads_no_weights(tmp_path) -> None:
    from pyserve.config import ServerArgs, ServerArgsError

    hf = hf_model("qwen2")
    hf.config.architectures = ["Qwen2ForCausalLM"]
    hf.config.save_pretrained(tmp_path)  # config only: no weight file at all
    runner = ModelRunner(str(tmp_path), load_format="dummy", max_total_tokens=32, load_progress=False)
    params = dict(runner.model.named_parameters())
    assert torch.equal(params["model.norm.weight"], torch.ones(COMMON["hidden_size"]))
    assert torch.equal(params["model.layers.0.self_attn.q_proj.bias"], torch.zeros(COMMON["hidden_size"]))
    again = ModelRunner(str(tmp_path), load_format="dummy", max_total_tokens=32, load_progress=False)
    assert torch.equal(
        dict(again.model.named_parameters())["model.embed_tokens.weight"], params["model.embed_tokens.weight"]
    )  # seeded: reproducible benchmarks
    assert ServerArgs(load_format="dummy").load_format == "dummy"
    with pytest.raises(ServerArgsError, match="--load-format: got 'pt'; choose one of auto, dummy"):
        ServerArgs(load_format="pt")
