"""Llama model correctness: pyserve's paged, batched forward against HF transformers (tiny
random configs), and exact greedy token ids on the real stories260k weights."""

from __future__ import annotations

import pytest
import torch
import transformers

from pyserve.forward_batch_info import ForwardBatch, ForwardMode
from pyserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from pyserve.mem_cache.memory_pool import MHATokenToKVPool
from pyserve.model_executor.model_runner import ModelRunner
from pyserve.models.llama import LlamaForCausalLM


class Requests:
    """Hand-built batches: per-request token lists and KV slots, no scheduler involved."""

    def __init__(self, slot_order: list[int]) -> None:
        self.free_slots = list(slot_order)
        self.tokens: dict[int, list[int]] = {}
        self.slots: dict[int, list[int]] = {}

    def extend(self, new_tokens: dict[int, list[int]]) -> ForwardBatch:
        """EXTEND batch: request rid gets new_tokens[rid] on top of what it already cached."""
        ids, pos, locs, seq_lens, prefix_lens, ext_lens, indptr, indices = [], [], [], [], [], [], [0], []
        for rid, toks in new_tokens.items():
            old = self.tokens.setdefault(rid, [])
            slots = self.slots.setdefault(rid, [])
            prefix = len(old)
            new_slots = [self.free_slots.pop(0) for _ in toks]
            old.extend(toks)
            slots.extend(new_slots)
            ids += toks
            pos += list(range(prefix, prefix + len(toks)))
            locs += new_slots
            seq_lens.append(len(old))
            prefix_lens.append(prefix)
            ext_lens.append(len(toks))
            indices += slots
            indptr.append(len(indices))
        t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=len(new_tokens),
            input_ids=t(ids),
            positions=t(pos),
            out_cache_loc=t(locs),
            seq_lens=t(seq_lens),
            kv_indptr=t(indptr),
            kv_indices=t(indices),
            extend_prefix_lens=t(prefix_lens),
            extend_seq_lens=t(ext_lens),
        )

    def decode(self, next_token: dict[int, int]) -> ForwardBatch:
        """DECODE batch: one new token per request."""
        batch = self.extend({rid: [tok] for rid, tok in next_token.items()})
        batch.forward_mode = ForwardMode.DECODE
        batch.extend_prefix_lens = batch.extend_seq_lens = None
        return batch


def _tiny_config(variant: str) -> transformers.LlamaConfig:
    kwargs = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if variant == "tied_llama3_rope":
        kwargs["tie_word_embeddings"] = True
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    elif variant == "head_dim_32_linear_rope":
        kwargs["head_dim"] = 32  # != hidden / heads
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    if int(transformers.__version__.split(".")[0]) >= 5:
        kwargs["rope_parameters"] = rope
    else:
        kwargs["rope_theta"] = rope.pop("rope_theta")
        kwargs["rope_scaling"] = rope if rope["rope_type"] != "default" else None
    return transformers.LlamaConfig(**kwargs)


@pytest.mark.parametrize("variant", ["untied_default_rope", "tied_llama3_rope", "head_dim_32_linear_rope"])
def test_tiny_llama_matches_transformers(variant: str) -> None:
    config = _tiny_config(variant)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norm weights, so a misplaced norm shows
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model = LlamaForCausalLM(config, dtype=torch.float32, device="cpu")
    model.load_weights(hf.state_dict().items())

    head_dim = getattr(config, "head_dim", None) or 16
    pool = MHATokenToKVPool(200, 2, 2, head_dim, torch.float32, "cpu")
    backend = TorchNativeAttnBackend(pool)
    gen = torch.Generator().manual_seed(1)
    # Scattered slots: a request's K/V never sit contiguously in the pool.
    reqs = Requests((torch.randperm(200, generator=gen) + 1).tolist())

    def rand_tokens(n: int) -> list[int]:
        return torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()

    def run_and_check(batch: ForwardBatch, rids: list[int]) -> torch.Tensor:
        backend.init_forward_metadata(batch)
        logits = model(batch, backend)
        assert logits.shape == (len(rids), config.vocab_size) and logits.dtype == torch.float32
        with torch.no_grad():
            for row, rid in enumerate(rids):
                ref = hf(torch.tensor([reqs.tokens[rid]]), use_cache=False).logits[0, -1]
                torch.testing.assert_close(logits[row], ref, atol=1e-4, rtol=0)
        return logits

    # Prefill: 3 ragged prompts (one of length 1, which takes the no-mask path).
    run_and_check(reqs.extend({0: rand_tokens(7), 1: rand_tokens(1), 2: rand_tokens(12)}), [0, 1, 2])
    # Extend on cached prefixes, mixed with a brand-new request in the same batch.
    run_and_check(
        reqs.extend({0: rand_tokens(5), 1: rand_tokens(1), 3: rand_tokens(4), 2: rand_tokens(9)}), [0, 1, 3, 2]
    )
    # Decode steps, feeding back the argmax as a real engine would.
    rids = [0, 1, 2, 3]
    next_ids = {rid: t for rid, t in zip(rids, rand_tokens(4))}
    for _ in range(4):
        logits = run_and_check(reqs.decode(next_ids), rids)
        next_ids = dict(zip(rids, logits.argmax(-1).tolist()))
    # New tokens' K/V landed exactly in their slots: slot 0 (padding) untouched.
    assert torch.count_nonzero(pool.get_key_buffer(0)[0]) == 0


def test_extend_with_cached_prefix_equals_full_prefill() -> None:
    config = _tiny_config("untied_default_rope")
    torch.manual_seed(3)
    model = LlamaForCausalLM(config, dtype=torch.float32, device="cpu")
    model.load_weights(transformers.LlamaForCausalLM(config).state_dict().items())
    prompt = list(range(3, 23))
    results = []
    for split in (20, 11, 1):
        backend = TorchNativeAttnBackend(MHATokenToKVPool(64, 2, 2, 16, torch.float32, "cpu"))
        reqs = Requests(list(range(1, 65)))
        batch = reqs.extend({0: prompt[:split]})
        backend.init_forward_metadata(batch)
        logits = model(batch, backend)
        if split < len(prompt):
            batch = reqs.extend({0: prompt[split:]})
            backend.init_forward_metadata(batch)
            logits = model(batch, backend)
        results.append(logits)
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(results[2], results[0], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def stories_runner(stories_path) -> ModelRunner:
    return ModelRunner(str(stories_path), max_total_tokens=2048, load_progress=False)


def _greedy(runner: ModelRunner, prompts: dict[int, list[int]], max_new: dict[int, int]) -> dict[int, list[int]]:
    """Greedy decode of several requests batched together; slots handed out sequentially from 1."""
    reqs = Requests(list(range(1, runner.max_total_num_tokens + 1)))
    out: dict[int, list[int]] = {rid: [] for rid in prompts}
    logits = runner.forward(reqs.extend(prompts))
    while True:
        live = [rid for rid in prompts if len(out[rid]) < max_new[rid]]
        row_of = {rid: i for i, rid in enumerate(live)}
        next_ids = logits.argmax(-1).tolist()
        for rid in live:
            out[rid].append(next_ids[row_of[rid]])
        live = [rid for rid in live if len(out[rid]) < max_new[rid]]
        if not live:
            return out
        logits = runner.forward(reqs.decode({rid: out[rid][-1] for rid in live}))


def test_stories_model_config(stories_runner: ModelRunner) -> None:
    cfg = stories_runner.model_config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.num_attention_heads) == ("LlamaForCausalLM", 5, 8)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size, cfg.vocab_size) == (4, 8, 64, 512)
    assert (cfg.context_len, cfg.dtype, cfg.eos_token_ids, cfg.bos_token_id) == (512, torch.float32, {2}, 1)
    assert stories_runner.max_total_num_tokens == 2048
    assert stories_runner.kv_cache_bytes == 2049 * 2 * 5 * 4 * 8 * 4


@pytest.mark.parametrize("case_idx", range(5))
def test_stories_greedy_reference(stories_runner: ModelRunner, stories_reference, case_idx: int) -> None:
    case = stories_reference[case_idx]
    out = _greedy(stories_runner, {0: case["input_ids"]}, {0: case["max_new_tokens"]})
    assert out[0] == case["output_ids"]


def test_stories_greedy_reference_batched(stories_runner: ModelRunner, stories_reference) -> None:
    """All five cases in one continuous batch (ragged prompts, requests finishing at different
    steps) give the same ids as alone."""
    prompts = {i: c["input_ids"] for i, c in enumerate(stories_reference)}
    max_new = {i: c["max_new_tokens"] for i, c in enumerate(stories_reference)}
    out = _greedy(stories_runner, prompts, max_new)
    assert out == {i: c["output_ids"] for i, c in enumerate(stories_reference)}
