"""Mixture-of-experts families (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE) against HF transformers
on tiny random-weight models from seeded configs: logits of a prefill, of an extend on a
cached prefix and of 32 decode steps within 1e-4 (float32), greedy tokens identical, at batch
sizes 1 and 8; the experts' routing alone against a per-token loop; per-expert checkpoints
(Qwen and Mixtral names) loading into the stacked experts, and refused when one is missing or
mis-shaped; a saved folder served through ModelRunner and the Engine (chunked prefill, radix
hits), with SGLang's expert distribution record."""

from __future__ import annotations

import pytest
import torch
import transformers

from pyserve.layers.activation import SiluAndMul
from pyserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from pyserve.layers.moe import fused_experts, route
from pyserve.mem_cache.memory_pool import MHATokenToKVPool
from pyserve.model_executor.model_runner import ModelRunner
from pyserve.models.registry import get_model_class
from tests.unit.test_model_families import COMMON, _rope
from tests.unit.test_model_llama import Requests

ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def moe_config(family: str) -> transformers.PretrainedConfig:
    """A tiny seeded config per family exercising what that family adds."""
    if family == "qwen2_moe":  # shared expert + sigmoid gate, q/k/v biases, layer 1 dense
        return transformers.Qwen2MoeConfig(
            **_rope(
                dict(
                    COMMON,
                    num_experts=8,
                    num_experts_per_tok=2,
                    moe_intermediate_size=32,
                    shared_expert_intermediate_size=48,
                    norm_topk_prob=False,
                    decoder_sparse_step=1,
                    mlp_only_layers=[1],
                    tie_word_embeddings=False,
                ),
                dict(ROPE),
            )
        )
    if family == "qwen3_moe":  # per-head q/k norm, renormalised top-k, layer 0 dense (step 2)
        return transformers.Qwen3MoeConfig(
            **_rope(
                dict(
                    COMMON,
                    head_dim=32,
                    num_experts=8,
                    num_experts_per_tok=3,
                    moe_intermediate_size=32,
                    norm_topk_prob=True,
                    decoder_sparse_step=2,
                    tie_word_embeddings=False,
                ),
                dict(ROPE),
            )
        )
    if family == "mixtral":  # every layer sparse, always renormalised
        return transformers.MixtralConfig(
            **_rope(
                dict(
                    COMMON, intermediate_size=32, num_local_experts=6, num_experts_per_tok=2, tie_word_embeddings=False
                ),
                dict(ROPE),
            )
        )
    if family == "olmoe":  # q/k normed across heads, clipped q/k/v, not renormalised
        return transformers.OlmoeConfig(
            **_rope(
                dict(
                    COMMON,
                    intermediate_size=32,
                    num_experts=8,
                    num_experts_per_tok=2,
                    norm_topk_prob=False,
                    clip_qkv=0.8,
                    tie_word_embeddings=False,
                ),
                dict(ROPE),
            )
        )
    raise ValueError(family)


HF_CLASSES = {
    "qwen2_moe": transformers.Qwen2MoeForCausalLM,
    "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    "mixtral": transformers.MixtralForCausalLM,
    "olmoe": transformers.OlmoeForCausalLM,
}
FAMILIES = list(HF_CLASSES)


def hf_model(family: str) -> transformers.PreTrainedModel:
    config = moe_config(family)
    torch.manual_seed(0)
    model = HF_CLASSES[family](config).eval()
    with torch.no_grad():  # non-trivial norms, biases and routers, so a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "experts" in name or name.endswith("mlp.gate.weight") or "shared_expert" in name:
                p.copy_(0.3 * torch.randn_like(p))
    return model


def per_expert(state: dict[str, torch.Tensor], mixtral: bool) -> list[tuple[str, torch.Tensor]]:
    """`state` with each stacked expert tensor as the per-expert tensors HF checkpoints hold
    (Qwen's names, or Mixtral's block_sparse_moe / w1 w3 w2)."""
    out = []
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            layer = name[: -len(".mlp.experts.gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                if mixtral:
                    out.append((f"{layer}.block_sparse_moe.experts.{e}.w1.weight", t[e, :inter]))
                    out.append((f"{layer}.block_sparse_moe.experts.{e}.w3.weight", t[e, inter:]))
                else:
                    out.append((f"{layer}.mlp.experts.{e}.gate_proj.weight", t[e, :inter]))
                    out.append((f"{layer}.mlp.experts.{e}.up_proj.weight", t[e, inter:]))
        elif name.endswith("mlp.experts.down_proj"):
            layer = name[: -len(".mlp.experts.down_proj")]
            for e in range(t.shape[0]):
                key = (
                    f"{layer}.block_sparse_moe.experts.{e}.w2.weight"
                    if mixtral
                    else f"{layer}.mlp.experts.{e}.down_proj.weight"
                )
                out.append((key, t[e]))
        elif mixtral and name.endswith("mlp.gate.weight"):
            out.append((name.replace(".mlp.", ".block_sparse_moe."), t))
        else:
            out.append((name, t))
    return out


@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_family_matches_transformers(family: str, batch_size: int) -> None:
    hf = hf_model(family)
    config = hf.config
    model = get_model_class(type(hf).__name__)(config, dtype=torch.float32, device="cpu")
    model.load_weights(per_expert(hf.state_dict(), mixtral=family == "mixtral"))
    model.prepack_linear_weights()  # the CPU float32 path ModelRunner takes
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pool_size = batch_size * 80
    pool = MHATokenToKVPool(
        pool_size, config.num_hidden_layers, config.num_key_value_heads, head_dim, torch.float32, "cpu"
    )
    backend = TorchNativeAttnBackend(pool)
    gen = torch.Generator().manual_seed(batch_size)
    reqs = Requests((torch.randperm(pool_size, generator=gen) + 1).tolist())
    rids = list(range(batch_size))
    prompts = {r: torch.randint(3, config.vocab_size, (3 + (5 * r) % 11,), generator=gen).tolist() for r in rids}
    ours: dict[int, list[torch.Tensor]] = {r: [] for r in rids}
    positions: dict[int, list[int]] = {r: [] for r in rids}

    def step(batch) -> list[int]:
        backend.init_forward_metadata(batch)
        logits = model(batch, backend)
        for row, rid in enumerate(rids):
            ours[rid].append(logits[row])
            positions[rid].append(len(reqs.tokens[rid]) - 1)
        return logits.argmax(-1).tolist()

    step(reqs.extend({r: p[: max(1, len(p) // 2)] for r, p in prompts.items()}))
    next_ids = step(reqs.extend({r: p[max(1, len(p) // 2) :] for r, p in prompts.items()}))
    for _ in range(32):
        next_ids = step(reqs.decode(dict(zip(rids, next_ids))))
    with torch.no_grad():
        for rid in rids:
            seq = reqs.tokens[rid]
            ref = hf(torch.tensor([seq]), use_cache=False).logits[0]
            torch.testing.assert_close(torch.stack(ours[rid]), ref[positions[rid]], atol=1e-4, rtol=0)
            fed = seq[len(prompts[rid]) :]
            assert fed == ref[len(prompts[rid]) - 1 : len(seq) - 1].argmax(-1).tolist()


def test_fused_experts_equals_a_loop_over_tokens() -> None:
    gen = torch.Generator().manual_seed(3)
    experts, hidden, inter, tokens, top_k = 5, 16, 8, 9, 2
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen)
    w2 = torch.randn(experts, hidden, inter, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 4] = -1e9  # expert 4 receives no token: it must not run or add anything
    weights, ids = route(logits, top_k, renormalize=True)
    assert torch.allclose(weights.sum(-1), torch.ones(tokens))
    assert 4 not in ids.tolist()
    got = fused_experts(x, w13, w2, weights, ids, SiluAndMul())
    for t in range(tokens):
        want = torch.zeros(hidden)
        for j in range(top_k):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).split(inter)
            want += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(got[t], want, atol=1e-4, rtol=1e-5)


def test_a_missing_or_misshaped_expert_or_too_large_top_k_is_refused() -> None:
    hf = hf_model("olmoe")
    cls = get_model_class("OlmoeForCausalLM")
    weights = [
        (n, t)
        for n, t in per_expert(hf.state_dict(), mixtral=False)
        if n != "model.layers.1.mlp.experts.5.up_proj.weight"
    ]
    with pytest.raises(
        ValueError, match=r"^checkpoint lacks model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight \(15 of the 16 "
    ):
        cls(hf.config, dtype=torch.float32, device="cpu").load_weights(weights)
    bad = [
        (n, t[:-1] if n == "model.layers.0.mlp.experts.2.down_proj.weight" else t)
        for n, t in per_expert(hf.state_dict(), mixtral=False)
    ]
    with pytest.raises(
        ValueError,
        match=r"^model\.layers\.0\.mlp\.experts\.2\.down_proj\.weight: checkpoint shape \(63, 32\) != \(64, 32\)$",
    ):
        cls(hf.config, dtype=torch.float32, device="cpu").load_weights(bad)
    config = moe_config("olmoe")
    config.num_experts_per_tok = 9
    with pytest.raises(ValueError, match=r"^num_experts_per_tok 9 must be in 1\.\.8"):
        cls(config, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_saved_moe_folder_serves_through_model_runner(tmp_path, family: str) -> None:
    hf = hf_model(family)
    hf.save_pretrained(tmp_path)
    runner = ModelRunner(str(tmp_path), max_total_tokens=64, load_progress=False)
    assert type(runner.model).__name__ == type(hf).__name__
    reqs = Requests(list(range(1, 65)))
    prompt = [5, 9, 11, 40, 3, 17]
    logits = runner.forward(reqs.extend({0: prompt}))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_stacked_and_per_expert_checkpoints_load_alike(family: str) -> None:
    """transformers 5's in-memory names (experts stacked) and a checkpoint's per-expert tensors
    fill the same parameters with the same values."""
    hf = hf_model(family)
    cls = get_model_class(type(hf).__name__)
    stacked = cls(hf.config, dtype=torch.float32, device="cpu")
    stacked.load_weights(hf.state_dict().items())
    split = cls(hf.config, dtype=torch.float32, device="cpu")
    split.load_weights(per_expert(hf.state_dict(), mixtral=family == "mixtral"))
    a, b = dict(stacked.named_parameters()), dict(split.named_parameters())
    assert sorted(a) == sorted(b)
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _moe_folder(tmp_path, stories_path, family: str) -> transformers.PreTrainedModel:
    """A tiny `family` model saved in `tmp_path` with stories260k's 512-token tokenizer."""
    import shutil

    config = moe_config(family)
    config.vocab_size = 512
    torch.manual_seed(0)
    hf = HF_CLASSES[family](config).eval()
    hf.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories_path / name, tmp_path / name)
    return hf


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_engine_greedy_equals_hf_with_chunked_prefill_and_radix_hits(tmp_path, stories_path, family: str) -> None:
    from pyserve import Engine
    from tests.conftest import wait_engine_idle

    hf = _moe_folder(tmp_path, stories_path, family)
    engine = Engine(model_path=str(tmp_path), max_total_tokens=1024, chunked_prefill_size=8, log_level="warning")
    try:
        head = list(range(1, 30))  # 29 tokens: four chunks; the second request finds them cached
        prompts = [head + [40, 41], head + [50, 51, 52]]
        outs = [engine.generate(input_ids=p, sampling_params={"max_new_tokens": 8, "temperature": 0}) for p in prompts]
        assert outs[1]["meta_info"]["cached_tokens"] >= 24
        for prompt, out in zip(prompts, outs):
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            assert out["output_ids"] == ref[0, len(prompt) :].tolist()
        wait_engine_idle(engine)
    finally:
        engine.shutdown()


def test_engine_serves_an_moe_and_records_its_experts(tmp_path, stories_path) -> None:
    """A tiny OLMoE with stories260k's tokenizer through the Engine: greedy tokens equal HF's;
    the expert record counts exactly top_k per token per sparse layer (prompt and outputs,
    the last sampled token never run), from start to stop; a dense model refuses it."""
    from pyserve import Engine
    from pyserve.errors import InvalidRequestError
    from tests.conftest import make_stories_engine, wait_engine_idle

    hf = _moe_folder(tmp_path, stories_path, "olmoe")
    config = hf.config
    engine = Engine(
        model_path=str(tmp_path),
        max_total_tokens=1024,
        log_level="warning",
        disable_radix_cache=True,
        enable_metrics=True,
    )
    try:
        prompt = [1, 5, 9, 11, 40, 3]
        engine.start_expert_distribution_record()
        out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 6, "temperature": 0})
        wait_engine_idle(engine)
        engine.stop_expert_distribution_record()
        engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 2, "temperature": 0})  # not recorded
        wait_engine_idle(engine)
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out["output_ids"] == ref[0, len(prompt) :].tolist()
        record = engine.dump_expert_distribution_record()
        assert record["layers"] == [0, 1] and record["recording"] is False
        tokens_run = len(prompt) + 6 - 1  # every input token once; the last output is never fed back
        assert [sum(row) for row in record["logical_count"]] == [tokens_run * config.num_experts_per_tok] * 2
        assert all(len(row) == config.num_experts for row in record["logical_count"])
        # /metrics' always-on counter has both requests: one sample per layer and expert
        from pyserve.server.metrics import EngineCollector

        (family,) = [f for f in EngineCollector(engine.core).collect() if f.name == "pyserve:moe_expert_tokens"]
        per_layer = {layer: 0 for layer in ("0", "1")}
        for sample in family.samples:
            per_layer[sample.labels["layer"]] += int(sample.value)
        assert len(family.samples) == 2 * config.num_experts
        both = tokens_run + len(prompt) + 2 - 1
        assert per_layer == {"0": both * config.num_experts_per_tok, "1": both * config.num_experts_per_tok}
    finally:
        engine.shutdown()
    dense = make_stories_engine(stories_path, 512, log_level="warning")
    try:
        with pytest.raises(InvalidRequestError, match="has no experts to record"):
            dense.dump_expert_distribution_record()
    finally:
        dense.shutdown()


class ThreadGroup:
    """One rank of a tensor-parallel group whose ranks are threads of this process: the
    collectives the model's forward calls (all_reduce, all_gather_last_dim), summed or
    concatenated in rank order behind a barrier."""

    def __init__(self, rank: int, size: int, slots: list, barrier) -> None:  # type: ignore[no-untyped-def]
        self.rank, self.size, self.local_size = rank, size, size
        self._slots, self._barrier = slots, barrier

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._slots[self.rank] = tensor.clone()
        self._barrier.wait()
        parts = list(self._slots)
        self._barrier.wait()  # every rank has read them before any writes again
        return parts

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(tensor)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(tensor), dim=-1)


def _two_ranks_and_one(family: str, expert_parallel: bool) -> tuple[list[dict], dict, transformers.PretrainedConfig]:
    """The logits [13 steps, 2, vocab] of a prefill and 12 greedy decode steps of two prompts:
    one rank's (`whole`), and each of two thread ranks' (`ranks`), which load their shard of
    the per-expert checkpoint through `shard` (experts split in width, or whole with
    `expert_parallel`; a rank also reports (first_expert, experts held) then)."""
    import threading

    from pyserve.distributed.shard import ShardLayout, shard

    hf = hf_model(family)
    config = hf.config
    cls = get_model_class(type(hf).__name__)
    checkpoint = per_expert(hf.state_dict(), mixtral=family == "mixtral")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    prompts = {0: [5, 9, 11, 40, 3, 17, 60], 1: [7, 8, 90, 4]}

    def run(tp: ThreadGroup | None, out: dict) -> None:  # type: ignore[type-arg]
        if tp is None:
            model = cls(config, dtype=torch.float32, device="cpu")
            model.load_weights(checkpoint)
            kv_heads = config.num_key_value_heads
        else:
            extra = {"expert_parallel": True} if expert_parallel else {}
            model = cls(config, dtype=torch.float32, device="cpu", tp=tp, **extra)
            layout = ShardLayout.of(config, tp.rank, tp.size, expert_parallel=expert_parallel)
            model.load_weights((n, shard(layout, n, tuple(t.shape), lambda i, t=t: t[i])) for n, t in checkpoint)
            kv_heads = layout.num_kv_heads
            if expert_parallel:
                experts = next(p for n, p in model.named_parameters() if n.endswith("mlp.experts.down_proj"))
                out["held"] = (model.first_expert, experts.shape[0])
        pool = MHATokenToKVPool(64, config.num_hidden_layers, kv_heads, head_dim, torch.float32, "cpu")
        backend = TorchNativeAttnBackend(pool)
        reqs = Requests(list(range(1, 65)))
        steps, batch = [], reqs.extend(prompts)
        for _ in range(13):
            backend.init_forward_metadata(batch)
            logits = model(batch, backend)
            steps.append(logits)
            batch = reqs.decode(dict(zip(prompts, logits.argmax(-1).tolist())))
        out["logits"] = torch.stack(steps)

    whole: dict = {}
    run(None, whole)
    slots: list = [None, None]
    barrier = threading.Barrier(2, timeout=60)
    ranks: list[dict] = [{}, {}]
    threads = [threading.Thread(target=run, args=(ThreadGroup(r, 2, slots, barrier), ranks[r])) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ranks, whole, config


@pytest.mark.parametrize("family", FAMILIES)
def test_two_tensor_parallel_ranks_equal_one(family: str) -> None:
    """Each rank holds half of every expert's (and the shared expert's) intermediate size,
    loaded from the per-expert checkpoint through `shard` (OLMoE's whole-q/k norm weights split
    by heads, the ranks' sums of squares added); the two ranks' logits of a prefill and 12
    decode steps agree with one rank's within 1e-4 and their greedy tokens are equal."""
    ranks, whole, _ = _two_ranks_and_one(family, expert_parallel=False)
    for part in ranks:
        torch.testing.assert_close(part["logits"], whole["logits"], atol=1e-4, rtol=0)
        assert torch.equal(part["logits"].argmax(-1), whole["logits"].argmax(-1))


@pytest.mark.parametrize("family", FAMILIES)
def test_two_expert_parallel_ranks_equal_one(family: str) -> None:
    """--ep-size 2: each rank holds half of the experts whole (the other half's checkpoint
    tensors skipped), routes every token alike and runs only its experts' assignments; the
    ranks' summed outputs give one rank's logits within 1e-4 and the same greedy tokens."""
    ranks, whole, config = _two_ranks_and_one(family, expert_parallel=True)
    total = config.num_local_experts if family == "mixtral" else config.num_experts
    assert [part["held"] for part in ranks] == [(0, total // 2), (total // 2, total // 2)]
    for part in ranks:
        torch.testing.assert_close(part["logits"], whole["logits"], atol=1e-4, rtol=0)
        assert torch.equal(part["logits"].argmax(-1), whole["logits"].argmax(-1))


def test_expert_parallel_takes_whole_experts_of_any_width() -> None:
    """Experts of width 30 over 4 ranks: width-split is refused (30 does not divide by 4),
    whole experts are not (8 experts do); each rank then holds two experts of width 30, and a
    stacked checkpoint tensor is refused across ranks with what to use instead."""
    import types

    from pyserve.distributed.shard import ShardLayout

    config = moe_config("qwen3_moe")
    config.moe_intermediate_size = 30
    with pytest.raises(ValueError, match="^--tp-size 4 does not divide the model's expert intermediate size 30$"):
        ShardLayout.of(config, 1, 4, expert_parallel=False)
    layout = ShardLayout.of(config, 1, 4, expert_parallel=True)
    assert (layout.expert_inter, layout.expert_start) == (30, 0)
    tp = types.SimpleNamespace(rank=1, size=4)  # construction reads only rank and size
    model = get_model_class("Qwen3MoeForCausalLM")(
        config, dtype=torch.float32, device="cpu", tp=tp, expert_parallel=True
    )
    params = dict(model.named_parameters())
    assert model.first_expert == 2
    assert tuple(params["model.layers.1.mlp.experts.gate_up_proj"].shape) == (2, 60, 64)
    with pytest.raises(ValueError, match="experts stacked in one tensor do not load across ranks"):
        layout.slice_of("model.layers.1.mlp.experts.gate_up_proj")
