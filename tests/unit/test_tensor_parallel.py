"""Tensor parallelism's pieces: which rows and columns each rank holds (`ShardLayout`, `shard`),
the flags' checks, and the in-process `Engine` at `tp_size=2` (rank 0 here, rank 1 a child
process over gloo) giving HF transformers' greedy tokens on stories260k with no KV leak."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time
import types

import pytest
import torch

from pyserve.config import ServerArgs, ServerArgsError
from pyserve.distributed.shard import ShardLayout, shard
from pyserve.engine.rank_launch import describe_exit, node_ranks, rank_device, split_addr
from tests.conftest import make_stories_engine, wait_engine_idle


def _config(heads: int, kv_heads: int, inter: int = 96, vocab: int = 10, hidden: int = 32) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=inter,
        hidden_size=hidden,
        vocab_size=vocab,
    )


def test_heads_split_and_kv_heads_replicated():
    # 8 heads of 4 dims, 4 KV heads over 2 ranks: each rank its half of both
    layouts = [ShardLayout.of(_config(8, 4, hidden=32), r, 2) for r in range(2)]
    assert [(lay.num_heads, lay.q_start, lay.num_kv_heads, lay.kv_start) for lay in layouts] == [
        (4, 0, 2, 0),
        (4, 4, 2, 2),
    ]
    assert layouts[1].slice_of("model.layers.0.self_attn.q_proj.weight") == (0, 16, 32)
    assert layouts[1].slice_of("model.layers.0.self_attn.k_proj.bias") == (0, 8, 16)
    assert layouts[1].slice_of("model.layers.3.self_attn.o_proj.weight") == (1, 16, 32)
    assert layouts[1].slice_of("model.layers.0.mlp.up_proj.weight") == (0, 48, 96)
    assert layouts[1].slice_of("model.layers.0.mlp.down_proj.weight") == (1, 48, 96)
    assert layouts[1].slice_of("model.layers.0.input_layernorm.weight") is None
    assert layouts[1].slice_of("model.layers.0.self_attn.o_proj.bias") is None  # added once, after the sum
    # 4 heads, 1 KV head over 4 ranks: every rank holds the one KV head
    layouts = [ShardLayout.of(_config(4, 1, hidden=32), r, 4) for r in range(4)]
    assert [(lay.num_kv_heads, lay.kv_start) for lay in layouts] == [(1, 0)] * 4
    # 8 heads, 2 KV heads over 4 ranks: ranks 0-1 KV head 0, ranks 2-3 KV head 1 (their groups)
    layouts = [ShardLayout.of(_config(8, 2, hidden=32), r, 4) for r in range(4)]
    assert [lay.kv_start for lay in layouts] == [0, 0, 1, 1]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "inter", "size", "message"),
    [
        (9, 3, 96, 2, "does not divide the model's 9 attention heads"),
        (8, 3, 96, 2, "neither divides nor is a multiple of the model's 3 KV heads"),
        (8, 4, 90, 4, "does not divide the model's intermediate size 90"),
    ],
)
def test_model_that_does_not_split(heads, kv_heads, inter, size, message):
    with pytest.raises(ValueError, match=message):
        ShardLayout.of(_config(heads, kv_heads, inter), 0, size)


def test_vocab_rows_padded_with_zeros():
    # 10 rows over 4 ranks: 3 each, the last rank's last two rows padding
    weight = torch.arange(20, dtype=torch.float32).reshape(10, 2)
    parts = []
    for r in range(4):
        layout = ShardLayout.of(_config(4, 4, inter=8, vocab=10, hidden=8), r, 4)
        parts.append(shard(layout, "lm_head.weight", (10, 2), lambda index: weight[index]))
    assert [tuple(p.shape) for p in parts] == [(3, 2)] * 4
    assert torch.equal(torch.cat(parts)[:10], weight)
    assert torch.equal(parts[3][1:], torch.zeros(2, 2))
    # a replicated tensor is read whole
    layout = ShardLayout.of(_config(4, 4, inter=8, vocab=10, hidden=8), 1, 4)
    norm = torch.ones(8)
    assert shard(layout, "model.norm.weight", (8,), lambda index: norm[index]) is not None
    assert torch.equal(shard(layout, "model.norm.weight", (8,), lambda index: norm[index]), norm)


def test_parallel_flags_checked():
    with pytest.raises(ServerArgsError, match="--tp-size: got 0"):
        ServerArgs(tp_size=0)
    with pytest.raises(ServerArgsError, match="--nnodes: got 3; must be >= 1 and divide --tp-size 4"):
        ServerArgs(tp_size=4, nnodes=3)
    with pytest.raises(ServerArgsError, match="--dist-init-addr: is needed with --nnodes > 1"):
        ServerArgs(tp_size=4, nnodes=2)
    with pytest.raises(ServerArgsError, match="--node-rank: got 2; must be in 0..1"):
        ServerArgs(tp_size=4, nnodes=2, node_rank=2, dist_init_addr="10.0.0.1:5000")
    with pytest.raises(ServerArgsError, match="--dist-init-addr: got '10.0.0.1'; must be host:port"):
        ServerArgs(dist_init_addr="10.0.0.1")
    with pytest.raises(ServerArgsError, match="--tp-size: embedding models run with --tp-size 1"):
        ServerArgs(tp_size=2, is_embedding=True)
    args = ServerArgs(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000")
    assert list(node_ranks(args)) == [2, 3]
    assert split_addr(args.dist_init_addr) == ("10.0.0.1", 5000)
    assert split_addr(None) == ("127.0.0.1", 0)
    assert describe_exit(-9) == "signal SIGKILL" and describe_exit(3) == "exit status 3"
    # one GPU per rank, numbered from 0 on each node; CPU ranks share the CPU
    gpus = ServerArgs(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000", device="cuda")
    assert [rank_device(gpus, r) for r in node_ranks(gpus)] == ["cuda:0", "cuda:1"]
    assert rank_device(ServerArgs(tp_size=2, device="cpu"), 1) == "cpu"


def _threads_of_a_new_thread() -> int:
    """torch's thread count as a thread started now (the engine's worker, say) sees it."""
    with cf.ThreadPoolExecutor(1) as pool:
        return pool.submit(torch.get_num_threads).result()


def test_engine_tp2_gives_hf_greedy_tokens(stories_path, stories_reference):
    threads = _threads_of_a_new_thread()
    engine = make_stories_engine(stories_path, 2048, tp_size=2)
    try:
        assert _threads_of_a_new_thread() == max(1, threads // 2)  # the cores shared by the ranks
        for case in stories_reference:
            out = engine.generate(
                input_ids=case["input_ids"],
                sampling_params={
                    "temperature": 0,
                    "max_new_tokens": case["max_new_tokens"],
                    "ignore_eos": case["ignore_eos"],
                },
            )
            assert out["output_ids"] == case["output_ids"], case["prompt"]
        info = wait_engine_idle(engine)
        assert info["kv_free_slots"] + info["kv_evictable_slots"] == info["kv_total_slots"] == 2048
        (rank1,) = engine.core.ranks.procs.values()
        assert rank1.poll() is None
    finally:
        engine.shutdown()
    assert rank1.returncode == 0  # told to stop, not killed
    assert _threads_of_a_new_thread() == threads


@pytest.mark.slow
def test_gguf_loads_shard_by_shard():
    """SmolLM2's GGUF (9 heads, 3 KV heads) over 3 ranks: every parameter of each rank's model
    is that rank's slice of the whole model's (dequantized) parameter."""
    from pyserve.model_loader import ModelConfig, default_model_path
    from pyserve.models.loader import load_model

    config = ModelConfig.from_path(default_model_path(), dtype="float32")
    whole = dict(load_model(config, "cpu", progress=False, quantization="none").named_parameters())
    for rank in range(3):
        layout = ShardLayout.of(config.hf_config, rank, 3)
        # loading reads only the rank and size; the collectives run at forward time
        part = load_model(config, "cpu", progress=False, tp=types.SimpleNamespace(rank=rank, size=3))  # type: ignore[arg-type]
        params = dict(part.named_parameters())
        assert params.keys() == whole.keys()
        for name, tensor in params.items():
            full = whole[name].detach()
            expected = shard(layout, name, tuple(full.shape), lambda index, t=full: t[index])
            assert torch.equal(tensor.detach(), expected), (rank, name)
        assert params["model.layers.0.self_attn.q_proj.weight"].shape == (3 * 64, 576)
        assert params["model.layers.0.self_attn.k_proj.weight"].shape == (64, 576)


def test_rank0_forward_failure_fails_the_engine(stories_path):
    """Rank 0's forward raising after rank 1 began the step leaves the ranks out of step: the
    request fails, the engine fails for good (new requests refused) and shutdown still ends
    rank 1 (killed: it waits in the step's collective)."""
    from pyserve.errors import ModelStepError, ServerDrainingError

    engine = make_stories_engine(stories_path, 2048, tp_size=2)
    try:
        params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
        assert len(engine.generate(input_ids=[1, 2, 3], sampling_params=params)["output_ids"]) == 4
        runner = engine.core.model_runner

        def broken_forward(batch):
            raise MemoryError("out of memory (test)")

        runner.forward = broken_forward
        with pytest.raises(ModelStepError, match=r"rank 0's forward failed: MemoryError: out of memory \(test\)"):
            engine.generate(input_ids=[1, 2, 3], sampling_params=params)
        deadline = time.monotonic() + 10
        while engine.core.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.core.failure == "rank 0's forward failed: MemoryError: out of memory (test)"
        with pytest.raises(ServerDrainingError):
            engine.generate(input_ids=[1, 2, 3], sampling_params=params)
        (rank1,) = engine.core.ranks.procs.values()
    finally:
        engine.shutdown()
    assert rank1.returncode == -signal.SIGKILL


def test_rank_ends_when_the_process_that_started_it_is_gone(stories_path):
    """A rank blocked before the group forms (rank 0 never joins) ends within seconds, with one
    line, once its stdin closes: what the kernel does when the starting process dies, even by
    SIGKILL while loading."""
    import dataclasses
    import json
    import subprocess
    import sys

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    fields = dataclasses.asdict(ServerArgs(model_path=str(stories_path), tp_size=2))
    cmd = [sys.executable, "-m", "pyserve.engine.rank_main", "--rank", "1", "--store", f"127.0.0.1:{store.port}"]
    proc = subprocess.Popen(
        [*cmd, "--server-args", json.dumps(fields)], stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while not store.check(["connected/1"]):  # imported, connected, now waiting for rank 0
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        assert proc.poll() is None
        assert proc.stdin is not None
        proc.stdin.close()
        closed = time.monotonic()
        assert proc.wait(timeout=10) == 1
        assert time.monotonic() - closed < 5
        assert proc.stderr is not None
        lines = proc.stderr.read().strip().splitlines()
        assert lines == [f"pyserve rank 1: stopping: the process that started it (pid {os.getpid()}) is gone"]
    finally:
        proc.kill()
        proc.wait()
