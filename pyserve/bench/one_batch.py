"""`pyserve bench one-batch`: latency of one static batch, no server, no scheduler.

It drives `ModelRunner`, `KVCache` (the Rust core) and the worker's `DeviceState` directly,
on the calling thread: for
each (batch_size, input_len, output_len) case, batch_size requests of input_len random token
ids are prefilled in one EXTEND forward + greedy sample, then output_len - 1 DECODE steps
each add one token per request. Reported: prefill latency (ms) and throughput
(batch_size * input_len / prefill time), median decode step latency (ms) and decode
throughput (batch_size / step time), and the total. A short warm-up pass of every case
(output_len capped at 4) runs first and is not reported. On CUDA each timing is bracketed by torch.cuda.synchronize().
With `--tp-size N` the model is split over N ranks (`pyserve.distributed`), this process
being rank 0: each step's plan goes to the other ranks and its sampled ids after it, as the
server's worker sends them.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import time
from typing import Any

from pyserve.bench.report import write_result
from pyserve.config import QUANTIZATIONS


def add_one_batch_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--model-path", default=None, help="HF folder or .gguf; default: SmolLM2-135M-Instruct")
    a("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    a("--device", default="auto", choices=("auto", "cpu", "cuda"))
    a("--context-length", type=int, default=None)
    a(
        "--quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="auto: a GGUF's quantized weights run on the native kernels (CPU); none: dequantized",
    )
    a(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),
        help="auto: the checkpoint's weights; dummy: seeded random weights at the config's shapes (no weight file)",
    )
    a("--batch-size", type=int, nargs="+", default=[1])
    a("--input-len", type=int, nargs="+", default=[1024])
    a("--output-len", type=int, nargs="+", default=[16])
    a("--seed", type=int, default=1)
    a("--tp-size", type=int, default=1, help="split the model over this many ranks (tensor parallelism)")
    a("--output-file", default=None, help="append one JSON line per case")


def _check(args: Any) -> None:
    from pyserve.bench.serve import BenchError

    for name in ("batch_size", "input_len", "output_len"):
        for v in getattr(args, name):
            if v < 1:
                raise BenchError(f"--{name.replace('_', '-')}: got {v}; must be >= 1")
    if args.tp_size < 1:
        raise BenchError(f"--tp-size: got {args.tp_size}; must be >= 1")


def run_case(runner: Any, batch_size: int, input_len: int, output_len: int, seed: int) -> dict[str, Any]:
    """Time one static batch on `runner` (a fresh KVCache over its pool; with a `runner.tp`
    group, the other ranks mirror each step). Returns the figures."""
    import numpy as np
    import torch

    from pyserve.distributed.messages import RankStart, rank_plan
    from pyserve.forward_batch_info import ForwardMode, SamplingRow, StepPlan
    from pyserve.mem_cache.kv_cache import KVCache
    from pyserve.model_executor.device_state import DeviceState
    from pyserve.sampling_params import SamplingParams

    device = runner.device
    vocab = runner.model_config.vocab_size
    kv = KVCache(runner.max_total_num_tokens, batch_size, input_len + output_len, disable_radix_cache=True)
    # the worker's device tables, driven here on the calling thread as the worker does
    state = DeviceState(kv.num_rows, kv.max_context_len, vocab, device)
    tp = runner.tp
    if tp is not None:
        tp.send_object(RankStart(kv.num_rows, kv.max_context_len, vocab))
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch_size, input_len), generator=gen)
    req_ids = []
    for prompt in input_ids.tolist():
        admitted = kv.admit(prompt[:-1])
        assert admitted is not None  # the KVCache was sized for batch_size rows
        req_ids.append(admitted.req_id)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def step(plan: StepPlan) -> None:
        if tp is not None:
            tp.send_object(rank_plan(plan))
        batch = state.forward_batch(plan)
        next_ids, _ = runner.sample_next(runner.forward(batch), batch)
        ids = state.record_sampled(plan, batch, next_ids)
        if tp is not None:
            tp.broadcast(ids)

    arrays = kv.prepare_extend(req_ids, [input_len] * batch_size)
    if arrays is None:
        raise ValueError("the KV pool is too small for this batch")
    rows = arrays.req_pool_indices
    greedy = SamplingParams(temperature=0.0)
    plan = StepPlan(
        ForwardMode.EXTEND,
        rows,
        arrays.seq_lens,
        arrays.positions,
        arrays.out_cache_loc,
        input_ids=input_ids.flatten().numpy().astype(np.int32),
        prefix_lens=arrays.prefix_lens,
        extend_lens=arrays.extend_lens,
        row_slots=arrays.kv_indices,
        new_sampling_rows=[SamplingRow(int(r), greedy, frozenset()) for r in rows],
    )
    sync()
    start = time.perf_counter()
    step(plan)
    sync()
    prefill_s = time.perf_counter() - start
    decode_s = []
    for _ in range(output_len - 1):
        arrays = kv.prepare_decode(req_ids)
        if arrays is None:
            raise ValueError("the KV pool is too small for this batch")
        plan = StepPlan(ForwardMode.DECODE, rows, arrays.seq_lens, arrays.positions, arrays.out_cache_loc)
        sync()
        start = time.perf_counter()
        step(plan)
        sync()
        decode_s.append(time.perf_counter() - start)
    median_decode_s = statistics.median(decode_s) if decode_s else None
    total_s = prefill_s + sum(decode_s)
    return {
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_latency_ms": prefill_s * 1000.0,
        "prefill_throughput": batch_size * input_len / prefill_s,
        "median_decode_latency_ms": None if median_decode_s is None else median_decode_s * 1000.0,
        "median_decode_throughput": None if median_decode_s is None else batch_size / median_decode_s,
        "total_latency_ms": total_s * 1000.0,
        "overall_throughput": batch_size * (input_len + output_len) / total_s,
    }


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.2f}"


def run_one_batch(args: Any) -> list[dict[str, Any]]:
    """Run every (batch size, input len, output len) case; print one line each; return them.
    Raises BenchError when the model cannot load or a case does not fit."""
    from pyserve.bench.serve import BenchError
    from pyserve.model_executor.model_runner import ModelRunner
    from pyserve.model_loader.default_model import default_model_path

    _check(args)
    cases = list(itertools.product(args.batch_size, args.input_len, args.output_len))
    pool_tokens = max(b * (i + o) for b, i, o in cases)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    model_path = args.model_path or default_model_path()
    ranks = None
    try:
        tp = None
        if args.tp_size > 1:
            from pyserve.config import ServerArgs
            from pyserve.engine.rank_launch import start_first_rank

            server_args = ServerArgs(
                model_path=model_path,
                dtype=args.dtype,
                device=device,
                context_length=args.context_length,
                max_total_tokens=pool_tokens,
                random_seed=args.seed,
                quantization=args.quantization,
                load_format=args.load_format,
                tp_size=args.tp_size,
            )
            tp, ranks = start_first_rank(server_args, device, on_death=lambda rank, message: print(message))
        runner = ModelRunner(
            model_path,
            dtype=args.dtype,
            device=device,
            context_length=args.context_length,
            max_total_tokens=pool_tokens,
            random_seed=args.seed,
            load_progress=False,
            quantization=args.quantization,
            load_format=args.load_format,
            tp=tp,
        )
    except (ValueError, OSError, RuntimeError) as exc:
        if ranks is not None:
            ranks.stop()
        raise BenchError(f"cannot load the model: {exc}") from None
    try:
        return _run_cases(args, runner, cases, model_path)
    finally:
        if runner.tp is not None and ranks is not None:
            from pyserve.distributed.group import RankLostError
            from pyserve.distributed.messages import STOP_RANKS

            ranks.expect_end()
            with contextlib.suppress(RankLostError):  # a rank that died: its error is the one to see
                runner.tp.send_object(STOP_RANKS)
            ranks.stop()


def _run_cases(args: Any, runner: Any, cases: list[tuple[int, int, int]], model_path: str) -> list[dict[str, Any]]:
    from pyserve.bench.serve import BenchError

    context_len = runner.model_config.context_len
    for _, i, o in cases:
        if i + o > context_len:
            raise BenchError(f"--input-len {i} + --output-len {o} exceeds the context length {context_len}")
    for b, i, o in cases:  # warm-up: first-use costs (allocations, thread pools) stay out
        run_case(runner, b, i, min(o, 4), args.seed)
    header = (
        f"{'batch':>6}{'input':>7}{'output':>7}{'prefill ms':>12}{'prefill tok/s':>15}"
        f"{'decode ms':>11}{'decode tok/s':>14}{'total ms':>11}"
    )
    tp = f", {args.tp_size} tensor-parallel ranks" if args.tp_size > 1 else ""
    print(f"pyserve bench one-batch: {model_path} on {runner.device} ({str(runner.dtype).removeprefix('torch.')}{tp})")
    print(header)
    results = []
    for b, i, o in cases:
        r = run_case(runner, b, i, o, args.seed)
        r.update(kind="one-batch", model_path=model_path, device=runner.device)
        results.append(r)
        print(
            f"{b:>6}{i:>7}{o:>7}{_fmt(r['prefill_latency_ms']):>12}{_fmt(r['prefill_throughput']):>15}"
            f"{_fmt(r['median_decode_latency_ms']):>11}{_fmt(r['median_decode_throughput']):>14}"
            f"{_fmt(r['total_latency_ms']):>11}"
        )
        if args.output_file:
            write_result(args.output_file, dict(r, config=vars(args)))
    return results
