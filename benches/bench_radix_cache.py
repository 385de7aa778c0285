"""Rust core vs a plain pure-Python radix cache on a recorded-style serving workload.

    PYTHONPATH=. python benches/bench_radix_cache.py [--sizes 10000,100000,1000000]

Workload (seeded): requests that share one of 16 system prompts (300-1500 tokens), multi-turn
chats that resend their whole history each turn (user 50-300 + assistant 100-400 tokens per
turn, up to ~8k tokens), and unique random prompts (200-2000 tokens), replayed through admit
-> extend -> finish until the radix tree caches the target number of tokens. Both caches see
the same operations. Then, per tree size, the median over repeats of:

* match_prefix: an 8k-token chat history against the tree,
* insert: finishing a request (system prompt + 1k new tokens): insert, free duplicates, unlock,
  free the row (mean over 64 requests finished back to back),
* evict: freeing 8192 tokens of LRU leaves,
* decode step: one step of 256 running requests (histories of 100-2000 tokens): allocate a
  slot each and build the step's int32 numpy arrays: the Python cache out_cache_loc,
  positions, kv_indptr and kv_indices; the Rust core its decode step's arrays, which hold no
  kv_indices (its decode step is O(batch): the worker keeps the rows), as the server runs it.

Rust is `pyserve._rs.KVCache` through its Python binding (page size 1, token ids passed as
int32 numpy arrays); Python is benches/py_radix_cache.py. Times in microseconds.

Checked (the script exits with status 1 on the first difference): until the evictions, both
caches match the same prefix length for every admitted request and cache the same number of
tokens after the fill and after the inserts; each eviction frees at least the 8192 tokens asked
on both, or what is left to evict; the decode step has the same positions and sequence lengths on both (the slot ids
are each allocator's own). After the evictions the trees may hold different leaves: the Python
baseline evicts by its own LRU rule, not SGLang's (which the Rust core follows).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from py_radix_cache import PyKVCache  # noqa: E402

from pyserve import _rs  # noqa: E402

POOL_TOKENS = 1_700_000
ROWS = 300
MAX_CONTEXT = 16384


class OutputsDiffer(Exception):
    """The two caches disagreed on a result (the message says which)."""


def check(same: bool, what: str) -> None:
    """Raise OutputsDiffer(what) unless `same`."""
    if not same:
        raise OutputsDiffer(what)


def frees_what_it_can(freed: list[int], asked: int) -> bool:
    """Whether evictions of `asked` tokens each, one after another, freed what they were asked
    (`freed`, in order), or all there was: after one frees less, none frees any."""
    short = [k for k, n in enumerate(freed) if n < asked]
    return not short or not any(freed[short[0] + 1 :])


class Both:
    """Applies each request-level operation to the Rust and the Python cache alike."""

    def __init__(self) -> None:
        self.rs = _rs.KVCache(POOL_TOKENS, ROWS, MAX_CONTEXT)
        self.py = PyKVCache(POOL_TOKENS, ROWS)
        self.same_trees = True  # until an eviction: then each evicts by its own LRU rule

    def admit(self, prompt: list[int]) -> tuple[int, int, int]:
        key = prompt[:-1]
        rid, _, rs_prefix = self.rs.add_req(np.asarray(key, dtype=np.int32))
        pid, py_prefix = self.py.add_req(key)
        check(not self.same_trees or rs_prefix == py_prefix, f"matched prefix: Rust {rs_prefix}, Python {py_prefix}")
        n = len(prompt) - rs_prefix
        self.rs.prepare_extend(np.array([rid]), np.array([n]))
        self.py.extend(pid, n)
        return rid, pid, n

    def serve(self, tokens: list[int]) -> None:
        """Admit `tokens` as one prefill (prompt + output) and finish it."""
        rid, pid, _ = self.admit(tokens)
        self.rs.cache_finished_req(rid, np.asarray(tokens, dtype=np.int32))
        self.py.cache_finished_req(pid, tokens)


def workload(rng: random.Random):
    """Endless stream of token sequences: shared-system-prompt chats and random prompts."""
    tok = lambda n: [rng.randrange(32000) for _ in range(n)]  # noqa: E731
    systems = [tok(rng.randint(300, 1500)) for _ in range(16)]
    while True:
        if rng.random() < 0.7:
            history = list(rng.choice(systems))
            for _ in range(rng.randint(1, 12)):
                history += tok(rng.randint(50, 300)) + tok(rng.randint(100, 400))
                if len(history) > 8000:
                    break
                yield list(history)
        else:
            yield tok(rng.randint(200, 2000))


def timed(fn, repeats: int) -> float:
    """Median wall time of `fn()` in microseconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1000)
    return statistics.median(times)


def bench(size: int, seed: int = 0) -> list[tuple[str, float, float]]:
    rng = random.Random(seed)
    both = Both()
    stream = workload(rng)
    long_chat = [rng.randrange(32000) for _ in range(8192)]
    both.serve(long_chat)
    while both.rs.evictable_size() < size:
        both.serve(next(stream))
    check(both.rs.evictable_size() == both.py.evictable_size, "cached tokens after the fill")
    rows = []

    prompt8k = long_chat + [1]
    key_rs = np.asarray(prompt8k, dtype=np.int32)
    matched = (len(both.rs.match_prefix(key_rs)[0]), len(both.py.match_prefix(prompt8k)[0]))
    check(matched == (8192, 8192), f"8k-token match: Rust, Python = {matched}")
    rows.append(
        (
            "match_prefix (8k-token prompt)",
            timed(lambda: both.rs.match_prefix(key_rs), 200),
            timed(lambda: both.py.match_prefix(prompt8k), 50),
        )
    )

    system = next(stream)[:1000]
    reqs = []
    for _ in range(64):
        tokens = system + [rng.randrange(32000) for _ in range(1000)]
        rid, pid, _ = both.admit(tokens)
        reqs.append((rid, pid, tokens, np.asarray(tokens, dtype=np.int32)))
    t0 = time.perf_counter_ns()
    for rid, _, _, arr in reqs:
        both.rs.cache_finished_req(rid, arr)
    rs_us = (time.perf_counter_ns() - t0) / 1000 / len(reqs)
    t0 = time.perf_counter_ns()
    for _, pid, tokens, _ in reqs:
        both.py.cache_finished_req(pid, tokens)
    py_us = (time.perf_counter_ns() - t0) / 1000 / len(reqs)
    rows.append(("insert (finish a 2k-token request)", rs_us, py_us))
    check(both.rs.evictable_size() == both.py.evictable_size, "cached tokens after the inserts")

    freed_rs: list[int] = []
    freed_py: list[int] = []
    rows.append(
        (
            "evict (8192 tokens)",
            timed(lambda: freed_rs.append(both.rs.evict(8192)), 10),
            timed(lambda: freed_py.append(both.py.evict(8192)), 10),
        )
    )
    both.same_trees = False
    for name, freed in (("Rust", freed_rs), ("Python", freed_py)):
        check(frees_what_it_can(freed, 8192), f"{name} tokens freed per eviction of 8192: {freed}")

    ids_rs, ids_py = [], []
    for _ in range(256):
        rid, pid, _ = both.admit(next(stream)[: rng.randint(100, 2000)])
        ids_rs.append(rid)
        ids_py.append(pid)
    ids_rs_arr = np.asarray(ids_rs, dtype=np.int64)
    rows.append(
        (
            "decode step (256 requests)",
            timed(lambda: both.rs.prepare_decode(ids_rs_arr), 50),
            timed(lambda: both.py.prepare_decode(ids_py), 50),
        )
    )
    step = both.rs.prepare_decode(ids_rs_arr)
    _, py_positions, py_indptr, py_indices = both.py.prepare_decode(ids_py)
    check(step is not None and np.array_equal(step.positions, py_positions), "decode step positions")
    check(np.array_equal(step.seq_lens, np.diff(py_indptr)), "decode step sequence lengths")
    rows.append(
        (
            f"  (kv_indices per step: Python {len(py_indices)}, Rust {len(step.kv_indices)})",
            float("nan"),
            float("nan"),
        )
    )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default="10000,100000,1000000", help="comma-separated target radix tree sizes in cached tokens"
    )
    args = parser.parse_args()
    print(
        f"{'tree tokens':>11} | {'operation':<36} | {'Rust us':>9} | {'Python us':>10} | "
        f"{'Rust ops/s':>10} | {'Python ops/s':>12} | {'ratio':>7}"
    )
    print("-" * 113)
    for size in (int(float(s)) for s in args.sizes.split(",")):
        try:
            results = bench(size)
        except OutputsDiffer as exc:
            print(f"OUTPUTS DIFFER at {size} tree tokens: {exc}")
            return 1
        for name, rs_us, py_us in results:
            if rs_us != rs_us:  # nan: an informational line
                print(f"{size:>11} | {name:<36} |")
                continue
            print(
                f"{size:>11} | {name:<36} | {rs_us:>9.1f} | {py_us:>10.1f} | "
                f"{1e6 / rs_us:>10.0f} | {1e6 / py_us:>12.0f} | {py_us / rs_us:>6.1f}x"
            )
    print(
        "outputs checked: equal prefix matches and cached tokens, evictions that free what was asked, "
        "equal decode steps"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
