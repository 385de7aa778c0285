"""The CUDA graph runner's batch-size choice and padding (pure host logic, run on CPU), and a
real capture/replay on CUDA (GPU-marked)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from pyserve.model_executor.cuda_graph_runner import capture_batch_sizes, pad_rows, padded_batch_size


def test_default_sizes_follow_sglangs_rule_up_to_what_the_server_runs() -> None:
    assert capture_batch_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 8))
    # sizes above max_running_requests are dropped, keeping the smallest that covers it
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert capture_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_batch_sizes(3) == [1, 2, 4]
    # more requests than the largest graph: batches beyond it run eagerly
    assert capture_batch_sizes(1024, cuda_graph_max_bs=32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_batch_sizes(64, cuda_graph_max_bs=6) == [1, 2, 4, 6]
    assert capture_batch_sizes(64, cuda_graph_max_bs=12) == [1, 2, 4, 8, 12]


def test_explicit_sizes_are_sorted_and_deduplicated() -> None:
    assert capture_batch_sizes(256, cuda_graph_bs=[64, 1, 8, 8, 3]) == [1, 3, 8, 64]
    assert capture_batch_sizes(5, cuda_graph_bs=[64, 1, 8, 3]) == [1, 3, 8]
    with pytest.raises(ValueError, match="must be >= 1"):
        capture_batch_sizes(8, cuda_graph_bs=[0, 4])


def test_a_batch_pads_to_the_smallest_size_holding_it() -> None:
    sizes = [1, 2, 4, 8, 16, 24]
    assert [padded_batch_size(sizes, b) for b in (1, 2, 3, 4, 5, 8, 9, 17, 24)] == [1, 2, 4, 4, 8, 8, 16, 24, 24]
    assert padded_batch_size(sizes, 25) is None  # eager


def test_padding_rows_decode_token_0_into_the_padding_slot() -> None:
    n = 8
    bufs = types.SimpleNamespace(
        input_ids=torch.arange(10, 10 + n),
        positions=torch.arange(20, 20 + n),
        out_cache_loc=torch.arange(30, 30 + n),
        seq_lens=torch.arange(40, 40 + n),
        req_pool_indices=torch.arange(50, 50 + n),
    )
    pad_rows(bufs, 3, 6)
    assert bufs.input_ids.tolist() == [10, 11, 12, 0, 0, 0, 16, 17]
    assert bufs.positions.tolist() == [20, 21, 22, 0, 0, 0, 26, 27]
    assert bufs.out_cache_loc.tolist() == [30, 31, 32, 0, 0, 0, 36, 37]
    assert bufs.seq_lens.tolist() == [40, 41, 42, 1, 1, 1, 46, 47]
    assert bufs.req_pool_indices.tolist() == [50, 51, 52, 0, 0, 0, 56, 57]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replayed_decode_equals_eager(stories_path) -> None:
    """stories260k on CUDA, triton backend: greedy tokens with graphs equal those without."""
    from pyserve import Engine

    prompts = [[1, 2, 3, 4], [1, 9, 8], [5] * 11]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    outs = []
    for disable in (False, True):
        with Engine(
            model_path=str(stories_path),
            dtype="float32",
            max_total_tokens=4096,
            attention_backend="triton",
            disable_cuda_graph=disable,
            log_level="warning",
        ) as eng:
            outs.append([o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)])
    assert outs[0] == outs[1]


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on CPU: 'replay' re-runs what was captured, over
    the same static buffers, so any input that bypasses them (or a wrong pad / slice) shows."""

    replays = 0

    def __init__(self) -> None:
        self.body = None

    def pool(self) -> str:
        return "pool"

    def replay(self) -> None:
        _FakeGraph.replays += 1
        self.body()


def test_replay_through_static_buffers_equals_eager_on_cpu(stories_path, monkeypatch) -> None:
    """The runner's capture / pad / replay logic on stories260k: a batch of 3 requests replays
    the graph of size 4 (padded), 5 requests run eagerly; greedy tokens equal those of the
    same engine without graphs. (The reference backend stands in for a capturable one: on
    CPU nothing is captured, the fake graph re-runs the forward over the static buffers.)"""
    from tests.conftest import make_stories_engine

    eng = make_stories_engine(stories_path, 1024, attention_backend="torch_native")
    (eager, graphed), _ = _eager_then_graphed(eng, monkeypatch)
    assert graphed == eager
    # 5 requests: eager; 3 (padded to 4): both decode steps replayed
    assert _FakeGraph.replays == 2


def test_a_mixture_replays_and_counts_no_padding_row_on_cpu(tmp_path, stories_path, monkeypatch) -> None:
    """A tiny Mixtral through the same fake graphs: greedy tokens equal eager ones, and the
    expert load counts the same tokens (the padded graph row, KV slot 0, is left out)."""
    from pyserve import Engine
    from tests.unit.test_moe_models import _moe_folder

    _moe_folder(tmp_path, stories_path, "mixtral")
    eng = Engine(
        model_path=str(tmp_path),
        max_total_tokens=1024,
        attention_backend="torch_native",
        disable_radix_cache=True,
        log_level="warning",
    )
    (eager, graphed), (eager_counts, graphed_counts) = _eager_then_graphed(eng, monkeypatch)
    assert graphed == eager and _FakeGraph.replays == 2
    assert eager_counts.sum() > 0 and np.array_equal(graphed_counts, eager_counts)


def _eager_then_graphed(eng, monkeypatch):
    """Greedy outputs of five prompts, then of three, without graphs and then with fake graphs
    of sizes 1, 2 and 4 captured; and what each phase added to the expert load (zeros for a
    dense model). Shuts the engine down."""
    import contextlib

    import pyserve.model_executor.cuda_graph_runner as cgr
    from pyserve.layers.attention.base import CapturableAttentionBackend
    from pyserve.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class Capturable(TorchNativeAttnBackend, CapturableAttentionBackend):
        def init_cuda_graph_state(self, max_bs: int) -> None:
            pass

        def init_forward_metadata_capture(self, forward_batch) -> None:
            self.init_forward_metadata(forward_batch)

        def init_forward_metadata_replay(self, forward_batch) -> None:
            self.init_forward_metadata(forward_batch)

    captured: list = []

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        captured.append(g)
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    original = cgr.CudaGraphRunner._capture_all

    def capture_all(self, stream):
        original(self, stream)
        for bs, g in self.graphs.items():  # what the capture body ran, replayed on demand
            g.body = lambda bs=bs: self.logits[:bs].copy_(self.forward(self._batch(bs)))

    monkeypatch.setattr(cgr.CudaGraphRunner, "_capture_all", capture_all)
    prompts = [[1, 2, 3, 4], [1, 9, 8], [5] * 11, [1, 300, 301, 302, 7], [1, 44]]
    params = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
    runner = eng.core.model_runner
    load = runner.expert_load()
    totals = (lambda: load.total.copy()) if load is not None else (lambda: np.zeros(1, np.int64))

    def run():
        before = totals()
        out = [
            [o["output_ids"] for o in eng.generate(input_ids=p, sampling_params=params)] for p in (prompts, prompts[:3])
        ]
        return out, totals() - before

    try:
        runner.attn_backend = Capturable(runner.kv_pool)
        eager, eager_counts = run()
        runner.graph_sizes = [1, 2, 4]
        runner.init_cuda_graphs(eng.core.worker.state.req_to_token, types.SimpleNamespace(synchronize=lambda: None))
        assert len(captured) == 3 and runner.graph_runner.sizes == [1, 2, 4]
        _FakeGraph.replays = 0
        graphed, graphed_counts = run()
    finally:
        eng.shutdown()
    return (eager, graphed), (eager_counts, graphed_counts)
