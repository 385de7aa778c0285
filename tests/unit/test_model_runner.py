"""ModelRunner plumbing: KV pool layout and sizing, dtype resolution, the model registry and
error cases."""

from __future__ import annotations

import pytest
import torch

from pyserve.forward_batch_info import ForwardBatch, ForwardMode, SamplingBatchInfo
from pyserve.layers.attention.cpu_backend import CpuAttnBackend
from pyserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from pyserve.mem_cache.memory_pool import MHATokenToKVPool
from pyserve.model_executor.model_runner import ModelRunner
from pyserve.model_loader import ModelConfig, ModelNotFoundError, resolve_dtype
from pyserve.models.llama import LlamaForCausalLM
from pyserve.models.registry import get_model_class, supported_architectures


def test_kv_pool_layout_and_writes() -> None:
    pool = MHATokenToKVPool(10, num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    assert pool.get_key_buffer(2).shape == (11, 2, 4)
    assert pool.get_value_buffer(0).shape == (11, 2, 4)
    assert pool.bytes_per_token == 2 * 3 * 2 * 4 * 4
    assert pool.total_bytes == 11 * 192
    k = torch.arange(16, dtype=torch.float32).reshape(2, 2, 4)
    pool.set_kv_buffer(1, torch.tensor([7, 3]), k, -k)
    assert torch.equal(pool.get_key_buffer(1)[7], k[0]) and torch.equal(pool.get_key_buffer(1)[3], k[1])
    assert torch.equal(pool.get_value_buffer(1)[3], -k[1])
    assert torch.count_nonzero(pool.get_key_buffer(1)[0]) == 0  # the padding slot
    assert torch.count_nonzero(pool.get_value_buffer(2)[0]) == 0
    bf = MHATokenToKVPool(10, 3, 2, 4, torch.bfloat16, "cpu")
    assert bf.bytes_per_token == 96
    with pytest.raises(ValueError, match="size"):
        MHATokenToKVPool(0, 3, 2, 4, torch.float32, "cpu")


def test_resolve_dtype() -> None:
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    assert resolve_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int4", "cpu")


def test_registry() -> None:
    assert get_model_class("LlamaForCausalLM") is LlamaForCausalLM
    assert supported_architectures() == [
        "BertModel",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "OlmoeForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
    ]
    with pytest.raises(
        ValueError,
        match=r"'GPT2LMHeadModel' is not supported; supported: BertModel, LlamaForCausalLM, MistralForCausalLM, "
        r"MixtralForCausalLM, OlmoeForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM, "
        r"Qwen3MoeForCausalLM$",
    ):
        get_model_class("GPT2LMHeadModel")


def test_missing_model_path(tmp_path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        ModelConfig.from_path(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError):
        ModelRunner(str(tmp_path / "nope.gguf"))


def test_pool_size_derived_and_capped_on_cpu(stories_path) -> None:
    runner = ModelRunner(str(stories_path), load_progress=False, random_seed=0, max_running_requests=64)
    # Plenty of RAM: the CPU cap of max_running_requests full-length (512-token) sequences applies.
    assert runner.max_total_num_tokens == 64 * 512
    assert runner.kv_pool.get_key_buffer(4).shape == (32769, 4, 8)
    assert runner.kv_cache_bytes == 32769 * 2 * 5 * 4 * 8 * 4
    assert (runner.device, runner.dtype) == ("cpu", torch.float32)
    short = ModelRunner(str(stories_path), context_length=64, load_progress=False, max_running_requests=64)
    assert short.max_total_num_tokens == 64 * 64
    with pytest.raises(ValueError, match="not enough memory"):
        ModelRunner(str(stories_path), mem_fraction_static=1e-9, load_progress=False)
    with pytest.raises(ValueError, match="mem_fraction_static"):
        ModelRunner(str(stories_path), mem_fraction_static=0.0)


def test_tensor_parallel_ranks_on_one_cpu_machine_share_its_kv_budget(stories_path, monkeypatch) -> None:
    """Each of N ranks on one machine sizes its pool from 1/N of the budget (free memory x the
    fraction), its own weights taken off its part: together they take what one process would."""
    import pyserve.model_executor.model_runner as mr

    runner = ModelRunner(str(stories_path), max_total_tokens=64, load_progress=False)
    monkeypatch.setattr(mr, "available_memory_bytes", lambda device: 64 * 2**20)
    per_token, weights = 2 * 5 * 4 * 8 * 4, runner.weight_bytes
    cpu = torch.device("cpu")
    assert runner._kv_pool_size(cpu, None, 0.25) == (16 * 2**20 - weights) // per_token
    assert runner._kv_pool_size(cpu, None, 0.25, shares=2) == (8 * 2**20 - weights) // per_token
    assert runner._kv_pool_size(cpu, None, 0.25, shares=4) == (4 * 2**20 - weights) // per_token


def test_runner_forward_and_sample(stories_path) -> None:
    runner = ModelRunner(str(stories_path), max_total_tokens=64, load_progress=False)
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    batch = ForwardBatch(
        ForwardMode.EXTEND,
        2,
        t([1, 403, 407, 1]),
        t([0, 1, 2, 0]),
        t([1, 2, 3, 4]),
        t([3, 1]),
        t([0, 3, 4]),
        t([1, 2, 3, 4]),
        extend_prefix_lens=t([0, 0]),
        extend_seq_lens=t([3, 1]),
    )
    logits = runner.forward(batch)
    assert logits.shape == (2, 512) and logits.dtype == torch.float32
    info = SamplingBatchInfo(torch.zeros(2), torch.ones(2), torch.full((2,), 512))
    # greedy_reference.json case 0: from <s> the greedy ids run 403, 407, 261, ...
    assert runner.sample(logits, info).tolist() == [261, 403]


def test_inconsistent_batch_raises() -> None:
    backend = TorchNativeAttnBackend(MHATokenToKVPool(8, 1, 1, 2, torch.float32, "cpu"))
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    batch = ForwardBatch(
        ForwardMode.EXTEND,
        1,
        t([5, 6]),
        t([0, 1]),
        t([1, 2]),
        t([3]),
        t([0, 3]),
        t([1, 2, 3]),
        extend_prefix_lens=t([0]),
        extend_seq_lens=t([2]),
    )
    with pytest.raises(ValueError, match="prefix 0 \\+ extend 2 != seq_len 3"):
        backend.init_forward_metadata(batch)


def test_attention_backend_choice(stories_path, monkeypatch) -> None:
    """One registry turns --attention-backend into a backend; "auto" picks by device."""

    def backend(name: str, dtype: str = "float32") -> type:
        return type(
            ModelRunner(
                str(stories_path), max_total_tokens=64, load_progress=False, dtype=dtype, attention_backend=name
            ).attn_backend
        )

    # float32 on CPU: the native decode kernel by default
    assert backend("auto") is CpuAttnBackend
    assert backend("cpu") is CpuAttnBackend
    assert backend("torch_native") is TorchNativeAttnBackend
    assert backend("auto", "bfloat16") is TorchNativeAttnBackend
    with pytest.raises(
        ValueError, match="attention backend 'cpu' cannot serve this KV pool: float32 KV buffers on CPU"
    ):
        backend("cpu", "bfloat16")
    with pytest.raises(
        ValueError, match="attention backend 'flashinfer' is not supported; supported: auto, torch_native, cpu, triton"
    ):
        backend("flashinfer")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(
        ValueError, match="attention backend 'triton' cannot serve this KV pool: triton, and a CUDA KV pool"
    ):
        backend("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton kernels interpreted on CPU
    from pyserve.layers.attention.triton_backend import TritonAttnBackend

    assert backend("triton") is TritonAttnBackend
    assert backend("auto") is CpuAttnBackend  # auto never interprets on CPU


def prefilled_runner(stories_path, backend: str) -> ModelRunner:
    """A stories260k runner on `backend` whose pool holds two prompts: [1, 403, 407] in slots
    1-3 and [1, 22] in slots 4-5."""
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    runner = ModelRunner(str(stories_path), max_total_tokens=64, load_progress=False, attention_backend=backend)
    runner.forward(
        ForwardBatch(
            ForwardMode.EXTEND,
            2,
            t([1, 403, 407, 1, 22]),
            t([0, 1, 2, 0, 1]),
            t([1, 2, 3, 4, 5]),
            t([3, 2]),
            t([0, 3, 5]),
            t([1, 2, 3, 4, 5]),
            extend_prefix_lens=t([0, 0]),
            extend_seq_lens=t([3, 2]),
        )
    )
    return runner


def test_cpu_backend_decode_matches_torch_native(stories_path) -> None:
    """The same decode batch through both backends: equal logits within float32 rounding."""
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    logits = []
    for name in ("torch_native", "cpu"):
        runner = prefilled_runner(stories_path, name)
        decode = ForwardBatch(
            ForwardMode.DECODE, 2, t([261, 9]), t([3, 2]), t([6, 7]), t([4, 3]), t([0, 4, 7]), t([1, 2, 3, 6, 4, 5, 7])
        )
        logits.append(runner.forward(decode))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)


def test_cpu_backend_mixed_extend_matches_torch_native(stories_path) -> None:
    """A mixed EXTEND batch (a 4-token chunk on a cached prefix, a new 3-token prompt, and two
    one-token rows: a decode, a 1-token prompt) through both backends: the cpu backend runs the
    one-token rows through its decode kernel; equal logits within float32 rounding."""
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    logits = []
    for name in ("torch_native", "cpu"):
        runner = prefilled_runner(stories_path, name)
        mixed = ForwardBatch(
            ForwardMode.EXTEND,
            4,
            t([261, 378, 274, 287, 1, 500, 20, 9, 1]),
            t([3, 4, 5, 6, 0, 1, 2, 2, 0]),
            t([6, 7, 8, 9, 10, 11, 12, 13, 14]),
            t([7, 3, 3, 1]),
            t([0, 7, 10, 13, 14]),
            t([1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 4, 5, 13, 14]),
            extend_prefix_lens=t([3, 0, 2, 0]),
            extend_seq_lens=t([4, 3, 1, 1]),
        )
        logits.append(runner.forward(mixed))
        assert name == "torch_native" or runner.attn_backend.split is not None
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)


def test_cpu_backend_rejects_inconsistent_decode_batch() -> None:
    backend = CpuAttnBackend(MHATokenToKVPool(8, 1, 1, 2, torch.float32, "cpu"))
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    batch = ForwardBatch(ForwardMode.DECODE, 1, t([5]), t([2]), t([3]), t([3]), t([0, 2]), t([1, 2]))
    with pytest.raises(ValueError, match="kv_indptr does not match seq_lens"):
        backend.init_forward_metadata(batch)
