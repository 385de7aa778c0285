"""Chunked prefill keeps running streams going: the longest gap between a stream's tokens while
a long prompt is prefilled, against one chunk's prefill step plus one decode step, measured in
the same run on the real model (SmolLM2-135M-Instruct on CPU by default).

Workload: NUM_STREAMS greedy streams decode (ignore_eos); once each has its first tokens, one
prompt of `--chunks` x `--chunk` random token ids arrives (max_new_tokens 1). Three engines in
turn, same everything else: chunked prefill with prefill and decode steps taking turns, the
same with `--enable-mixed-chunk`, and chunking off (`--chunked-prefill-size -1`: the whole
prompt in one step). For each it prints the streams' longest inter-token gap while the long
prompt was being prefilled, the longest chunk step, the median decode step, and the ratio
gap / (longest chunk step + median decode step), which the design asks to be at most 1
(step times come from the worker thread's own clock around each step).

Checked: in every case each stream gets its tokens and the long prompt its one token, and the
streams' greedy tokens and the long prompt's token are the same in all three cases (how the
prompt is chunked must not change any output); otherwise the script exits with status 1 after
its table.

Usage: PYTHONPATH=. python benches/bench_chunked_prefill.py [--model-path P] [--chunk 256]
       [--chunks 8] [--streams 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_case(
    path: str, chunk: int | None, mixed: bool, prompt: list[int], num_streams: int, stream_tokens: int
) -> dict:
    from pyserve import Engine
    from pyserve.engine import worker as worker_mod

    steps: list[tuple[str, float, float, int]] = []  # (mode, start, end, extend tokens)
    original = worker_mod.ModelWorker._step

    def timed_step(self, plan):  # the worker thread
        start = time.perf_counter()
        out = original(self, plan)
        tokens = int(plan.extend_lens.sum()) if plan.extend_lens is not None else 0
        steps.append((plan.forward_mode.name, start, time.perf_counter(), tokens))
        return out

    worker_mod.ModelWorker._step = timed_step
    try:
        engine = Engine(
            model_path=path,
            dtype="float32",
            quantization="none",
            max_total_tokens=len(prompt) + 4096,
            chunked_prefill_size=chunk if chunk is not None else -1,
            enable_mixed_chunk=mixed,
        )
    except BaseException:
        worker_mod.ModelWorker._step = original
        raise
    try:
        arrivals: list[list[float]] = [[] for _ in range(num_streams)]
        outputs: list[list[int]] = [[] for _ in range(num_streams + 1)]  # the streams', then the long one's
        marks: dict[str, float] = {}

        async def stream(k: int, started: asyncio.Event) -> None:
            it = await engine.async_generate(
                input_ids=[100 + k, 200 + k, 300 + k],
                stream=True,
                sampling_params={"temperature": 0, "max_new_tokens": stream_tokens, "ignore_eos": True},
            )
            async for out in it:
                arrivals[k].append(time.perf_counter())
                outputs[k] = out["output_ids"]
                if len(arrivals[k]) == 3:
                    started.set()

        async def body() -> None:
            events = [asyncio.Event() for _ in range(num_streams)]
            tasks = [asyncio.ensure_future(stream(k, e)) for k, e in enumerate(events)]
            for e in events:
                await e.wait()
            marks["long_sent"] = time.perf_counter()
            long = await engine.async_generate(
                input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 1}
            )
            outputs[num_streams] = long["output_ids"]
            marks["long_done"] = time.perf_counter()
            await asyncio.gather(*tasks)

        asyncio.run(body())
    finally:
        engine.shutdown()
        worker_mod.ModelWorker._step = original
    lo, hi = marks["long_sent"], marks["long_done"]
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:]) if b > lo and a < hi]
    long_steps = [e - s for mode, s, e, n in steps if mode == "EXTEND" and s >= lo - 0.5 and n >= min(chunk or 0, 64)]
    decode = [e - s for mode, s, e, _ in steps if mode == "DECODE"]
    return {
        "max_gap_s": max(gaps),
        "chunk_step_s": max(long_steps),
        "decode_step_s": statistics.median(decode),
        "long_prefill_s": hi - lo,
        "num_long_steps": len(long_steps),
        "outputs": outputs,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="default: the default model (SmolLM2 GGUF)")
    p.add_argument("--chunk", type=int, default=256, help="--chunked-prefill-size (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=8, help="the long prompt in chunks (default: %(default)s)")
    p.add_argument("--streams", type=int, default=4, help="running streams (default: %(default)s)")
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    from pyserve.model_loader.default_model import default_model_path

    path = args.model_path or default_model_path()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 20000, (args.chunk * args.chunks,), generator=gen).tolist()
    # the streams outlast the unchunked prefill: a few decode steps per chunk step, times chunks
    stream_tokens = 48 + 8 * args.chunks
    print(
        f"{len(prompt)}-token prompt ({args.chunks} chunks of {args.chunk}) arriving while "
        f"{args.streams} streams decode; model {path}"
    )
    header = (
        f"{'case':>16} {'max gap ms':>10} {'chunk step ms':>13} {'decode ms':>9} {'prefill s':>9} "
        f"{'gap/(chunk+decode)':>18}"
    )
    print(header)
    print("-" * len(header))
    outputs = {}
    for name, chunk, mixed in (
        ("chunked", args.chunk, False),
        ("chunked+mixed", args.chunk, True),
        ("no chunking", None, False),
    ):
        r = run_case(path, chunk, mixed, prompt, args.streams, stream_tokens)
        bound = r["chunk_step_s"] + r["decode_step_s"]
        ratio = r["max_gap_s"] / bound if chunk is not None else float("nan")
        print(
            f"{name:>16} {1e3 * r['max_gap_s']:>10.0f} {1e3 * r['chunk_step_s']:>13.0f} "
            f"{1e3 * r['decode_step_s']:>9.1f} {r['long_prefill_s']:>9.2f} {ratio:>18.2f}",
            flush=True,
        )
        outputs[name] = r["outputs"]
    want = [stream_tokens] * args.streams + [1]
    problems = [f"{name}: tokens per request {[len(o) for o in outs]}, not {want}" for name, outs in outputs.items()]
    problems = [p for p, outs in zip(problems, outputs.values()) if [len(o) for o in outs] != want]
    first, *rest = outputs
    problems += [f"{name}: outputs differ from {first}'s" for name in rest if outputs[name] != outputs[first]]
    if problems:
        print("OUTPUTS DIFFER:", *problems, sep="\n  ")
        return 1
    print(
        f"outputs checked: the same {args.streams} streams of {stream_tokens} tokens and long-prompt token "
        "in every case"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
