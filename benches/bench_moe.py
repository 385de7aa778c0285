"""MoE benchmarks. (a) Sparsity: a mixture of experts' decode step against a dense model's whose
MLP is as wide as the experts a token runs, measured in the same run.

Two configs at the same hidden size, layers, heads and vocabulary (written to a temporary
folder; `--load-format dummy` fills seeded random weights at their shapes, no weight file):
an OLMoE-style mixture of `--experts` experts of intermediate size `--inter`, `--top-k` per
token, and a Llama whose MLP has intermediate size top_k * inter (the same active
parameters). `pyserve bench one-batch` runs each (`--batch-size`, `--input-len`,
`--output-len`) in turn, `--rounds` times alternated; the script prints each case's median
decode step and the ratio MoE / dense of their medians over the rounds. The issue's goal: at
most 1.3x at batch 1 (cost follows the active experts). At larger batches the tokens of a step
spread over more experts, so a step reads more expert weights than the dense model's one MLP.

(b) With `--vs-llamacpp GGUF`: a random-weight Q4_0 GGUF at OLMoE-1B-7B's shapes is written
to GGUF (benches/moe_gguf.py; the tokenizer SmolLM2's, copied from pyserve's default model) and
served by pyserve and by llama.cpp's llama-server through benches/bench_vs_llamacpp.py (the
same client and prompts, 128 in / 64 out, 1 and 8 streams, alternated `--rounds` times; pyserve
with `--max-total-tokens 4096`, the context llama-server gets, since the default KV share of
free memory does not fit beside 3.7 GB of weights on a 24 GB machine). Its goals: at least 1.0x
llama-server's output tok/s at one stream and 1.5x at eight.

Usage: PYTHONPATH=. python benches/bench_moe.py [--hidden 1024] [--layers 8] [--experts 64]
       [--top-k 8] [--inter 256] [--batch-size 1 8] [--rounds 3] [--threads N]
       PYTHONPATH=. python benches/bench_moe.py --vs-llamacpp /tmp/olmoe-shape-q4_0.gguf [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

COMMON = {
    "vocab_size": 32000,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_config(folder: str, config: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def one_batch(path: str, args: argparse.Namespace, out_file: str) -> None:
    cmd = [sys.executable, "-m", "pyserve", "bench", "one-batch", "--model-path", path, "--load-format", "dummy"]
    cmd += ["--dtype", "float32", "--device", "cpu", "--input-len", str(args.input_len)]
    cmd += ["--output-len", str(args.output_len), "--output-file", out_file, "--batch-size"]
    cmd += [str(b) for b in args.batch_size]
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)


def vs_llamacpp(gguf: str, rounds: int) -> int:
    """(b): the OLMoE-shaped Q4_0 GGUF (written once) served by pyserve and llama-server."""
    here = os.path.dirname(os.path.abspath(__file__))
    if not os.path.exists(gguf):
        subprocess.run([sys.executable, os.path.join(here, "moe_gguf.py"), gguf, "--qtype", "Q4_0"], check=True)
    cmd = [sys.executable, os.path.join(here, "bench_vs_llamacpp.py"), "--model-path", gguf, "--rounds", str(rounds)]
    cmd += ["--pyserve-args", "--max-total-tokens 4096", "--goals", "1=1.0", "8=1.5"]
    return subprocess.run(cmd).returncode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of the runs (0: the default)")
    p.add_argument(
        "--vs-llamacpp", metavar="GGUF", help="(b): write this OLMoE-shaped Q4_0 file (if absent) and serve it"
    )
    args = p.parse_args()
    if args.vs_llamacpp:
        return vs_llamacpp(args.vs_llamacpp, args.rounds)
    shape = dict(COMMON, hidden_size=args.hidden, num_hidden_layers=args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        moe = write_config(
            os.path.join(tmp, "moe"),
            dict(
                shape,
                architectures=["OlmoeForCausalLM"],
                model_type="olmoe",
                num_experts=args.experts,
                num_experts_per_tok=args.top_k,
                intermediate_size=args.inter,
                norm_topk_prob=False,
            ),
        )
        dense = write_config(
            os.path.join(tmp, "dense"),
            dict(
                shape,
                architectures=["LlamaForCausalLM"],
                model_type="llama",
                intermediate_size=args.top_k * args.inter,
            ),
        )
        results: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            for name, path in (("moe", moe), ("dense", dense)):
                out = os.path.join(tmp, f"{name}.jsonl")
                if os.path.exists(out):
                    os.remove(out)
                one_batch(path, args, out)
                with open(out) as f:
                    for line in f:
                        row = json.loads(line)
                        results.setdefault((name, row["batch_size"]), []).append(row["median_decode_latency_ms"])
    print(
        f"E={args.experts} top-{args.top_k} I={args.inter} against dense I={args.top_k * args.inter}; "
        f"hidden {args.hidden}, {args.layers} layers, float32 CPU, {args.rounds} rounds alternated"
    )
    print(f"{'batch':>5} {'moe ms/step':>12} {'dense ms/step':>14} {'moe/dense':>10}")
    for batch in args.batch_size:
        m = statistics.median(results[("moe", batch)])
        d = statistics.median(results[("dense", batch)])
        print(f"{batch:>5} {m:>12.2f} {d:>14.2f} {m / d:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
