"""CPU throughput: pyserve's Engine against HF transformers `generate` on SmolLM2-135M-Instruct
(the default GGUF, dequantized to float32), same prompts, same greedy outputs.

Workload: NUM_PROMPTS prompts of exactly INPUT_LEN token ids (seeded random ids from the
ordinary vocabulary), OUTPUT_LEN new tokens each, greedy, EOS ignored. Runs:
  1. pyserve Engine: all prompts submitted at once (continuous batching).
  2. HF generate, padded batch: all prompts in one `generate` call.
  3. HF generate, sequential: one prompt at a time.
Each run has a process of its own (as a server has: HF's and pyserve's OpenMP teams in one
process would oversubscribe the cores); runs 1 and 2 alternate for --rounds pairs (default 2:
pyserve, HF, HF, pyserve), so a drift in the machine's speed weighs on both alike; run 3 goes
with the first HF run. Prints output tokens/s of each and the ratios pyserve
/ HF (of the summed times, and each pair's), plus how many pyserve outputs equal HF's token for
token. Checked: every output of every run has --output-len tokens and every pyserve output
equals HF's padded-batch output of the same prompt token for token (float32 on both sides, the
same greedy choice at each step); otherwise the script exits with status 1 after its figures.

Usage: PYTHONPATH=. python benches/bench_cpu_throughput.py [--num-prompts 64]
       [--input-len 128] [--output-len 128] [--seq-prompts N] [--skip-hf-seq] [--rounds 2]
--seq-prompts N times the sequential baseline on the first N prompts only (its tokens/s is a
per-prompt rate, so a subset measures the same thing faster); default: all prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# SmolLM2's vocabulary (the HF side checks it against the model's config)
VOCAB = 49152


def make_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # ids >= 100 skip SmolLM2's special and byte tokens
    return torch.randint(100, vocab, (num, length), generator=gen).tolist()


def run_pyserve(path: str, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    from pyserve import Engine

    max_total = len(prompts) * (len(prompts[0]) + output_len) + 64
    with Engine(
        model_path=path,
        dtype="float32",
        quantization="none",  # the float32 path HF runs too (outputs compared token for token)
        max_total_tokens=max_total,
        max_running_requests=len(prompts),
        max_prefill_tokens=len(prompts) * len(prompts[0]),
        log_level="warning",
    ) as engine:
        params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
        engine.generate(input_ids=prompts[0][:16], sampling_params=dict(params, max_new_tokens=4))
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=[dict(params) for _ in prompts])
        elapsed = time.perf_counter() - start
    return elapsed, [o["output_ids"] for o in outs]


def hf_generate(model, batch: list[list[int]], output_len: int) -> list[list[int]]:
    import transformers

    config = transformers.GenerationConfig(
        max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    ids = torch.tensor(batch)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[:, ids.shape[1] :].tolist()


def run_side(args: argparse.Namespace) -> None:
    """One side in this process (a child of `main`): writes {"seconds", "outputs"} and, for HF
    with --seq-prompts, the sequential figures to args.out as JSON."""
    from pyserve.model_loader import default_model_path

    path = default_model_path()
    prompts = make_prompts(args.num_prompts, args.input_len, VOCAB)
    result: dict = {}
    if args.side == "pyserve":
        result["seconds"], result["outputs"] = run_pyserve(path, prompts, args.output_len)
    else:
        from tests.hf_reference import load_hf_gguf

        hf = load_hf_gguf(path)
        hf.generation_config.eos_token_id = None
        assert hf.config.vocab_size == VOCAB
        hf_generate(hf, [prompts[0][:16]], 4)  # warm-up
        start = time.perf_counter()
        result["outputs"] = hf_generate(hf, prompts, args.output_len)
        result["seconds"] = time.perf_counter() - start
        if args.seq_prompts:
            start = time.perf_counter()
            for p in prompts[: args.seq_prompts]:
                hf_generate(hf, [p], args.output_len)
            result["seq_seconds"] = time.perf_counter() - start
    with open(args.out, "w") as f:
        json.dump(result, f)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seq-prompts", type=int, default=None)
    parser.add_argument("--skip-hf-seq", action="store_true")
    parser.add_argument(
        "--rounds", type=int, default=2, help="pyserve / HF padded-batch pairs, alternating which goes first"
    )
    parser.add_argument("--side", choices=["pyserve", "hf"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        run_side(args)
        return 0
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.seq_prompts is not None and not 1 <= args.seq_prompts <= args.num_prompts:
        parser.error(f"--seq-prompts must be in 1..--num-prompts ({args.num_prompts})")

    print(
        f"model SmolLM2-135M-Instruct float32, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {args.num_prompts} prompts x {args.input_len} in, "
        f"{args.output_len} out, greedy, ignore_eos; each run in a process of its own",
        flush=True,
    )
    total_out = args.num_prompts * args.output_len
    workload = ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len)]
    workload += ["--output-len", str(args.output_len)]
    seq = None if args.skip_hf_seq else (args.seq_prompts or args.num_prompts)

    def run(side: str, seq_prompts: int | None = None) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--out", out, *workload]
            if seq_prompts:
                cmd += ["--seq-prompts", str(seq_prompts)]
            # the child's stderr (load progress bars, libraries' exit warnings) only if it fails
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if done.returncode:
                sys.exit(f"the {side} run failed (exit status {done.returncode}):\n{done.stderr}")
            with open(out) as f:
                return json.load(f)

    # The pair alternates (pyserve first, then HF first, ...) so a drift in the machine's speed
    # weighs on both sides alike; the ratio is of the summed times. Each run has a process of
    # its own, as a server has: two libraries' OpenMP teams in one process oversubscribe the
    # cores, and libgomp then sleeps between parallel regions instead of spinning.
    ps_times, hf_times, ps_outs, hf_outs = [], [], [], []
    s_tps = None
    for r in range(args.rounds):
        for side in ("pyserve", "hf") if r % 2 == 0 else ("hf", "pyserve"):
            if side == "pyserve":
                res = run("pyserve")
                ps_times.append(res["seconds"])
                ps_outs.append(res["outputs"])
                t = res["seconds"]
                print(f"pyserve Engine          : {t:8.1f} s  {total_out / t:8.1f} out tok/s", flush=True)
            else:
                res = run("hf", seq if r == 0 else None)
                hf_times.append(res["seconds"])
                hf_outs.append(res["outputs"])
                t = res["seconds"]
                label = f"HF generate, batch of {args.num_prompts}"
                print(f"{label}: {t:8.1f} s  {total_out / t:8.1f} out tok/s", flush=True)
                if "seq_seconds" in res:
                    t_s = res["seq_seconds"]
                    s_tps = seq * args.output_len / t_s
                    print(f"HF generate, sequential : {t_s:8.1f} s  {s_tps:8.1f} out tok/s ({seq} prompts)", flush=True)
    ps_tps = total_out * len(ps_times) / sum(ps_times)
    b_tps = total_out * len(hf_times) / sum(hf_times)

    same = min(sum(a == b for a, b in zip(out, ref)) for out in ps_outs for ref in hf_outs)
    print(f"pyserve outputs equal to HF batch outputs: {same}/{args.num_prompts} (fewest over the rounds' pairs)")
    rounds = ", ".join(f"{h / p:.2f}x" for p, h in zip(ps_times, hf_times))
    print(f"ratio pyserve / HF padded batch: {ps_tps / b_tps:.2f}x (target >= 1.5x; by round: {rounds})")
    if s_tps is not None:
        print(f"ratio pyserve / HF sequential  : {ps_tps / s_tps:.2f}x (target >= 5x)")
    lengths = {len(o) for outs in ps_outs + hf_outs for o in outs}
    counts = {len(outs) for outs in ps_outs + hf_outs}
    if same != args.num_prompts or lengths != {args.output_len} or counts != {args.num_prompts}:
        print(
            f"OUTPUTS DIFFER: {same}/{args.num_prompts} equal; outputs per run {sorted(counts)}, "
            f"tokens per output {sorted(lengths)} (want {args.output_len})"
        )
        return 1
    print(f"outputs checked: all {args.num_prompts} equal, {args.output_len} tokens each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
