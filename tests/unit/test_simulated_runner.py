"""The simulated device (SimulatedRunner) and `pyserve bench host` over it: step times follow
the time model, ids are seeded and never EOS, busy time is accounted, and a small `bench host`
run serves every request through the real server with figures that add up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from pyserve.forward_batch_info import ForwardMode, SamplingBatchInfo
from pyserve.model_executor.simulated_runner import SimulatedRunner
from tests.conftest import REPO


class _Batch:
    def __init__(self, mode: ForwardMode, batch_size: int, num_tokens: int) -> None:
        self.forward_mode = mode
        self.batch_size = batch_size
        self.input_ids = torch.zeros(num_tokens, dtype=torch.int64)
        self.sampling_info: SamplingBatchInfo | None = None


def test_step_times_ids_and_busy_accounting():
    runner = SimulatedRunner(
        vocab_size=6,
        eos_token_ids={2},
        max_total_tokens=64,
        context_len=32,
        extend_us_per_token=100.0,
        decode_base_ms=300.0,
        decode_us_per_req=500.0,
        seed=7,
    )
    extend, decode = _Batch(ForwardMode.EXTEND, 2, 40), _Batch(ForwardMode.DECODE, 4, 4)
    assert runner.step_time_s(extend) == 40 * 100e-6
    assert runner.step_time_s(decode) == 300e-3 + 4 * 500e-6
    start = time.perf_counter()
    runner.forward(extend)  # launches return at once; the device runs them one after another
    runner.forward(decode)
    # both returned while the device still had the second step to run (an asynchronous launch)
    assert time.perf_counter() - start < runner.busy_s()
    assert runner.busy_s() == runner.step_time_s(extend) + runner.step_time_s(decode)
    assert runner.num_steps == 2
    runner.step_done_waiter()()
    assert time.perf_counter() - start >= runner.busy_s()  # the second step ends after both
    ids = [t for _ in range(200) for t in runner.step_output(torch.empty(0), decode).next_token_ids]
    assert set(ids) == {0, 1, 3, 4, 5}  # every id but EOS
    again = SimulatedRunner(6, {2}, 64, 32, seed=7)
    assert [t for _ in range(200) for t in again.step_output(None, decode).next_token_ids] == ids
    runner.reset_busy()
    assert runner.busy_s() == 0.0 and runner.num_steps == 0


def test_ids_come_from_one_seeded_stream_that_wraps_around():
    runner = SimulatedRunner(vocab_size=50, eos_token_ids={7}, max_total_tokens=64, context_len=32, seed=11)
    step = _Batch(ForwardMode.DECODE, 1000, 1000)
    ids = torch.cat([runner.sample_next(None, step)[0] for _ in range(1050)])  # past 2^20 ids
    stream_len = 1 << 20
    assert torch.equal(ids[stream_len:], ids[: ids.shape[0] - stream_len])  # the stream again
    assert 7 not in set(ids[:stream_len].tolist()) and len(set(ids[:stream_len].tolist())) == 49
    ids_, failed = runner.sample_next(None, _Batch(ForwardMode.DECODE, 3, 3))
    assert failed.tolist() == [False] * 3 and ids_.dtype == torch.int64


def test_bench_host_small_run(tmp_path, stories_path):
    out = tmp_path / "host.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pyserve",
            "bench",
            "host",
            "--model-path",
            str(stories_path),
            "--clients",
            "3",
            "--decode-step-ms",
            "2",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--backend",
            "pyserve",
            "openai",
            "--output-file",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["clients"], r["stream"], r["overlap"], r["backend"]) for r in rows] == [
        (3, s, o, b) for s in (True, False) for o in (True, False) for b in ("pyserve", "openai")
    ]
    for r in rows:
        assert r["completed"] == r["requests"] == r["clients"] and r["failed"] == 0
        # one prefill step and 7 decode steps at least (the first token comes from the prefill)
        assert r["device_steps"] >= 8
        assert 0.0 < r["device_busy_fraction"] <= 1.0
        assert r["loop_cpu_us_per_token"] > 0 and r["output_tok_s"] > 0
        # streamed chunks of every route are sent by the socket writer thread; whole responses
        # never use it
        assert (r["writer_cpu_us_per_token"] > 0) if r["stream"] else (r["writer_cpu_us_per_token"] == 0.0)
    assert "loop us/tok" in proc.stdout and "writer us/tok" in proc.stdout


def test_bench_host_bad_flags_exit_2(capsys):
    from pyserve.bench.cli import main

    assert main(["host", "--clients", "0"]) == 2
    assert "--clients: got 0; must be > 0" in capsys.readouterr().err
    assert main(["host", "--decode-step-ms", "-1"]) == 2
    assert main(["host", "--input-len", "0"]) == 2
    assert main(["host", "--client-cpus", "2-x"]) == 2
    assert "--client-cpus '2-x': expected a list like 12-15 or 2,3" in capsys.readouterr().err
    every = ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0)))
    assert main(["host", "--client-cpus", every]) == 2  # the server would have no CPU left
    assert "must be a proper subset of the CPUs this process may use" in capsys.readouterr().err


def test_client_cpu_list(monkeypatch):
    from pyserve.bench.host import parse_cpu_list
    from pyserve.bench.serve import BenchError

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert parse_cpu_list("12-15") == {12, 13, 14, 15}
    assert parse_cpu_list("0-1,8,10-11") == {0, 1, 8, 10, 11}
    with pytest.raises(BenchError, match="must be a proper subset"):
        parse_cpu_list("14-16")  # 16 is not ours
    with pytest.raises(BenchError, match="expected a list like"):
        parse_cpu_list("")


def test_submit_returns_once_the_worker_launched_the_step():
    """With an asynchronous runner the loop's submit waits for the worker's launch (so the
    worker's GIL releases are not each followed by a wait for a busy loop), not for the
    step's end; steps still complete in order and each future gets its own ids."""
    import asyncio

    import numpy as np

    from pyserve.engine.worker import ModelWorker
    from pyserve.forward_batch_info import StepPlan

    runner = SimulatedRunner(
        vocab_size=50, eos_token_ids=set(), max_total_tokens=64, context_len=16, decode_base_ms=50.0, seed=3
    )
    worker = ModelWorker(runner, num_rows=4, row_width=16, vocab_size=50)
    rows = np.array([1, 2], dtype=np.int32)

    def plan(position: int) -> StepPlan:
        return StepPlan(
            ForwardMode.DECODE,
            req_pool_indices=rows,
            seq_lens=np.full(2, position + 1, np.int32),
            positions=np.full(2, position, np.int32),
            out_cache_loc=np.array([2 * position + 1, 2 * position + 2], np.int32),
        )

    async def body() -> None:
        done = []
        start = time.perf_counter()
        first = worker.submit(plan(0), done.append)
        # launched when submit returned, and not ended: the device still runs it
        assert runner.num_steps == 1 and runner._device_free_at > time.perf_counter()
        second = worker.submit(plan(1), done.append)
        assert runner.num_steps == 2
        out1, out2 = await first, await second
        assert done == [first, second]  # the hook ran with each resolved future, in order
        assert time.perf_counter() - start >= 0.1
        assert out1.next_token_ids.shape == (2,) and out2.next_token_ids.shape == (2,)
        assert worker.state.req_to_token[1, :2].tolist() == [1, 3]

    try:
        asyncio.run(body())
    finally:
        worker.shutdown()


def test_grammar_rows_take_an_allowed_id():
    """A row under a grammar keeps its stream id when the mask allows it, else takes the
    lowest allowed id; other rows keep theirs."""
    runner = SimulatedRunner(vocab_size=100, eos_token_ids={0}, max_total_tokens=64, context_len=32, seed=3)
    free = runner.sample_next(torch.empty(0), _Batch(ForwardMode.DECODE, 3, 3))[0].tolist()
    runner._cursor = 0  # the same three stream ids again
    allowed = torch.zeros(3, 100, dtype=torch.bool)
    allowed[0, free[0]] = True  # row 0: its own id is allowed
    allowed[1, [71, 40]] = True  # row 2 (mask row 1): only 40 and 71
    bits = torch.zeros(3, 4 * 32, dtype=torch.int64)
    bits[:, :100] = allowed.to(torch.int64)
    packed = (bits.view(3, 4, 32) << torch.arange(32)).sum(-1)
    batch = _Batch(ForwardMode.DECODE, 3, 3)
    zeros = torch.zeros(3)
    batch.sampling_info = SamplingBatchInfo(
        temperatures=zeros,
        top_ps=zeros,
        top_ks=zeros.long(),
        grammar_bitmask=torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)[:2],
        grammar_rows=torch.tensor([0, 2], dtype=torch.int32),
    )
    ids = runner.sample_next(torch.empty(0), batch)[0].tolist()
    assert ids == [free[0], free[1], 40 if free[2] not in (40, 71) else free[2]]
