"""Tensor parallelism on the device: stories260k in float32 at `--tp-size 2` gives the greedy
tokens of `--tp-size 1`, with CUDA graphs on (so the all-reduces run inside captured decode
graphs) and off; then `pyserve bench one-batch` times one decode batch at each size.

Each variant is a fresh `pyserve.Engine` (rank 1 a child process on cuda:1, NCCL between the
two) that runs the 8 prompts of check_greedy.py for 32 new tokens each, ignore_eos, in one call.
Float32, so a differing token is a finding, not rounding: any mismatch fails the script.

    python benches/gpu/check_tp.py                     # CUDA, two GPUs or more
    python benches/gpu/check_tp.py --device cpu        # CPU: gloo between two processes

Prints its tables only (run.sh keeps its log; the device returns 8 files at most). Needs as
many GPUs as --tp-size on CUDA (run.sh skips the step with a note on a one-GPU machine).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from check_greedy import NEW_TOKENS, PROMPTS  # noqa: E402


def generate(device: str, tp_size: int, graphs: bool) -> tuple[list[list[int]], float]:
    """The greedy ids of PROMPTS on a fresh Engine, and the seconds the run took (load included)."""
    from pyserve import Engine

    start = time.perf_counter()
    options = {"disable_cuda_graph": not graphs} if device == "cuda" else {}
    engine = Engine(
        model_path=common.stories_path(),
        device=device,
        dtype="float32",
        tp_size=tp_size,
        max_total_tokens=8192,
        log_level="warning",
        **options,
    )
    try:
        params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        outs = engine.generate(prompt=PROMPTS, sampling_params=params)
    finally:
        engine.shutdown()
    return [o["output_ids"] for o in outs], time.perf_counter() - start


def one_batch(device: str, tp_size: int) -> str:
    """`pyserve bench one-batch` at batch sizes 1 and 8 on stories260k: its table's rows."""
    cmd = [sys.executable, "-m", "pyserve", "bench", "one-batch", "--model-path", common.stories_path()]
    cmd += ["--device", device, "--batch-size", "1", "8", "--input-len", "64", "--output-len", "16"]
    cmd += ["--tp-size", str(tp_size)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if done.returncode != 0:
        return f"bench one-batch --tp-size {tp_size} failed ({done.returncode}): {done.stderr.strip()[-400:]}"
    return done.stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tp-size", type=int, default=2)
    args = parser.parse_args()
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < args.tp_size:
            common.log(f"check_tp: {torch.cuda.device_count()} GPU(s), --tp-size {args.tp_size} needs more")
            return 2
    variants = [(1, False), (args.tp_size, False)]
    if args.device == "cuda":
        variants += [(1, True), (args.tp_size, True)]
    results: dict[tuple[int, bool], list[list[int]]] = {}
    rows = []
    failed = False
    for tp_size, graphs in variants:
        common.log(f"  tp {tp_size}, cuda graphs {'on' if graphs else 'off'} ...")
        ids, seconds = generate(args.device, tp_size, graphs)
        results[(tp_size, graphs)] = ids
        reference = results[(1, graphs)]
        equal = sum(a == b for a, b in zip(ids, reference))
        failed |= equal != len(PROMPTS)
        rows.append([tp_size, "on" if graphs else "off", f"{equal}/{len(PROMPTS)}", f"{seconds:.1f}"])
    print(
        common.format_table(
            f"check_tp on {args.device}: greedy ids at tp {args.tp_size} against tp 1 (float32, stories260k)",
            ["tp", "cuda graphs", "sequences equal to tp 1", "seconds (load included)"],
            rows,
        )
    )
    for tp_size in (1, args.tp_size):
        print(one_batch(args.device, tp_size))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
