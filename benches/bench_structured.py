"""Structured-output benchmarks, one part per piece (`--part`), each printing figures against
a baseline measured in the same run.

Part `mask`: the grammar token mask on CPU. `pyserve_kernels.apply_token_bitmask_` (the
native kernel on float32 CPU tensors) masks ROWS x VOCAB float32 logits from an xgrammar
bitmask, against:
  * torch masked_fill_: `logits.masked_fill_(disallowed, -inf)` with the bool mask already
    unpacked and inverted outside the timing (the cheapest torch form; the baseline of the
    ratio);
  * the torch reference `pyserve_kernels.reference.apply_token_bitmask_` (unpacks the bitmask
    each call, then masked_fill);
  * xgrammar's own `apply_token_bitmask_inplace` on CPU (skipped if xgrammar is missing).
Three masks: `mostly-allowed` (95% of words all ones, the rest mixed: free text), `json-like`
(97% of words all zeros, the rest mixed: between JSON values, where few tokens fit) and
`scattered` (each token disallowed with probability 0.03, so most words are mixed: the
kernel's worst case). Every method runs on the same logits (the mask is idempotent), in
alternation (blocks of one untimed call, to bring its data into cache, and 4 timed ones), and
the median time per call is reported. torch and pyserve run on `--threads`
torch threads (default 1: on the shared 2-core test machines a second thread mostly measures
who else holds the cores, 4-8 ms per call for every method alike); xgrammar's CPU apply is
single-threaded.

Parts `serve` (constrained against unconstrained requests on the simulated device of `pyserve
bench host` and on a real model, and the loop's longest gap while a 200-property schema
compiles) and `compile` (cold grammar compile times): see benches/structured_serving.py.

Checked: every mask method gives the logits of `masked_fill` exactly (mask), every request's
output is as benches/structured_serving.py says (serve); the script exits with status 1 after
its figures when any check fails.

Usage: python benches/bench_structured.py --part mask [--rows 64] [--vocab 49152] [--repeats 200]
                                         [--threads 1]
       python benches/bench_structured.py --part serve [--requests 64] [--real-model PATH]
       python benches/bench_structured.py --part compile
       python benches/bench_structured.py --part all
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # structured_serving
REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("PYSERVE_SHARED", REPO.parent / "shared"))

# ---------------------------------------------------------------- part: mask


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] bool (True = allowed) -> [rows, ceil(vocab / 32)] int32 in xgrammar's
    layout (bit j of word w is token 32 w + j); bits past vocab are set."""
    rows, vocab = allowed.shape
    words = (vocab + 31) // 32
    padded = torch.ones(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.to(torch.int64)
    packed = (padded.view(rows, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def make_allowed(kind: str, rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """[rows, vocab] bool mask of one of the benchmark's kinds (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    random_bits = torch.rand(rows, words * 32, generator=gen) < 0.5
    if kind == "scattered":
        return torch.rand(rows, vocab, generator=gen) >= 0.03
    mixed_word = torch.rand(rows, words, generator=gen) < (0.05 if kind == "mostly-allowed" else 0.03)
    base = kind == "mostly-allowed"
    allowed = torch.full((rows, words, 32), base, dtype=torch.bool)
    allowed[mixed_word] = random_bits.view(rows, words, 32)[mixed_word]
    return allowed.flatten(1)[:, :vocab]


def timer_us(fn: Callable[[], object]) -> Callable[[], float]:
    """A function that calls fn once and returns the microseconds it took."""

    def once() -> float:
        start = time.perf_counter_ns()
        fn()
        return (time.perf_counter_ns() - start) / 1e3

    return once


# Timed calls per method in a row (see `_mask_kernel_report`).
_BLOCK = 4


def mask_kernel_report(rows: int = 64, vocab: int = 49152, repeats: int = 200, threads: int = 1) -> dict:
    """Times the CPU token mask (see the module docstring) for each mask kind, on `threads`
    torch threads (torch.set_num_threads for the call; restored after).

    Returns {"rows", "vocab", "threads", "masks": {kind: {"<method>_us": median us per call,
    ..., "speedup_vs_masked_fill": masked_fill_us / pyserve_us, "speedup_vs_reference",
    "speedup_vs_xgrammar" (None without xgrammar)}}}. Raises AssertionError if a method's
    result differs from the others.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _mask_kernel_report(rows, vocab, repeats)
    finally:
        torch.set_num_threads(before)


def _mask_kernel_report(rows: int, vocab: int, repeats: int) -> dict:
    import pyserve_kernels as K
    from pyserve_kernels import reference

    xgrammar_apply: Callable[..., None] | None
    try:
        import xgrammar
    except ImportError:
        xgrammar_apply = None
    else:
        xgrammar_apply = xgrammar.apply_token_bitmask_inplace
    gen = torch.Generator().manual_seed(1)
    logits0 = torch.randn(rows, vocab, generator=gen)
    row_ids = torch.arange(rows, dtype=torch.int32)
    report: dict = {"rows": rows, "vocab": vocab, "threads": torch.get_num_threads(), "masks": {}, "problems": []}
    for kind in ("mostly-allowed", "json-like", "scattered"):
        allowed = make_allowed(kind, rows, vocab)
        disallowed = ~allowed
        bitmask = pack_bitmask(allowed)
        logits = logits0.clone()
        methods: dict[str, Callable[[], object]] = {
            "pyserve": functools.partial(K.apply_token_bitmask_, logits, bitmask, row_ids),
            "masked_fill": functools.partial(logits.masked_fill_, disallowed, float("-inf")),
            "reference": functools.partial(reference.apply_token_bitmask_, logits, bitmask, row_ids),
        }
        if xgrammar_apply is not None:
            methods["xgrammar"] = functools.partial(xgrammar_apply, logits, bitmask)
        want = logits0.masked_fill(disallowed, float("-inf"))
        for name, fn in methods.items():
            logits.copy_(logits0)
            fn()
            if not torch.equal(logits, want):
                report["problems"].append(f"{kind}: {name} masks differently from masked_fill")
        timers = {name: timer_us(fn) for name, fn in methods.items()}
        samples: dict[str, list[float]] = {name: [] for name in timers}
        # Methods alternate in blocks: one untimed call brings that method's own data back
        # into cache (the others' temporaries evicted it; in the server the logits arrive hot
        # from the LM head), then BLOCK timed calls.
        for _ in range(max(1, repeats // _BLOCK)):
            for name, timer in timers.items():
                timer()
                samples[name].extend(timer() for _ in range(_BLOCK))
        figures: dict[str, float | None] = {f"{name}_us": statistics.median(s) for name, s in samples.items()}
        ours = statistics.median(samples["pyserve"])
        figures["speedup_vs_masked_fill"] = statistics.median(samples["masked_fill"]) / ours
        figures["speedup_vs_reference"] = statistics.median(samples["reference"]) / ours
        figures["speedup_vs_xgrammar"] = statistics.median(samples["xgrammar"]) / ours if xgrammar_apply else None
        figures["mixed_word_fraction"] = float(((bitmask != 0) & (bitmask != -1)).float().mean())
        report["masks"][kind] = figures
    return report


def print_mask_report(report: dict) -> None:
    print(
        f"grammar token mask on CPU: {report['rows']} rows x {report['vocab']} tokens float32, "
        f"{report['threads']} torch threads (xgrammar: 1); median us per call"
    )
    header = (
        f"{'mask':<15} {'mixed':>6} {'pyserve':>9} {'masked_fill':>12} {'reference':>10} {'xgrammar':>9}"
        f" {'x masked_fill':>14} {'x reference':>12} {'x xgrammar':>11}"
    )
    print(header)
    print("-" * len(header))
    for kind, f in report["masks"].items():
        xgr_us = f"{f['xgrammar_us']:9.1f}" if "xgrammar_us" in f else f"{'-':>9}"
        xgr_x = f"{f['speedup_vs_xgrammar']:10.1f}x" if f["speedup_vs_xgrammar"] is not None else f"{'-':>11}"
        print(
            f"{kind:<15} {f['mixed_word_fraction']:6.1%} {f['pyserve_us']:9.1f} {f['masked_fill_us']:12.1f}"
            f" {f['reference_us']:10.1f} {xgr_us} {f['speedup_vs_masked_fill']:13.1f}x"
            f" {f['speedup_vs_reference']:11.1f}x {xgr_x}"
        )
    print("mixed: fraction of mask words neither all ones nor all zeros; x: that method's time / pyserve's")


def run_mask(args: argparse.Namespace) -> list[str]:
    report = mask_kernel_report(rows=args.rows, vocab=args.vocab, repeats=args.repeats, threads=args.threads)
    print_mask_report(report)
    return report["problems"]


# ---------------------------------------------------------------- CLI


def run_serve(args: argparse.Namespace) -> list[str]:
    import structured_serving

    return structured_serving.serve_report(args.requests, args.real_model or None)["problems"]


def run_compile(args: argparse.Namespace) -> list[str]:
    import structured_serving

    structured_serving.compile_report()
    return []


# --part choices: add a part here (and its options to main's parser); `all` runs every part.
# Each returns the problems its checks found ([]: outputs as they must be).
PARTS: dict[str, Callable[[argparse.Namespace], list[str]]] = {
    "mask": run_mask,
    "compile": run_compile,
    "serve": run_serve,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=[*PARTS, "all"], default="all")
    parser.add_argument("--rows", type=int, default=64, help="mask: logits rows, all masked")
    parser.add_argument("--vocab", type=int, default=49152, help="mask: vocabulary size")
    parser.add_argument("--repeats", type=int, default=200, help="mask: timed calls per method and mask")
    parser.add_argument("--threads", type=int, default=1, help="mask: torch threads of pyserve and torch")
    parser.add_argument("--requests", type=int, default=64, help="serve: concurrent requests per case")
    parser.add_argument(
        "--real-model",
        default=str(SHARED / "models" / "stories260k"),
        help="serve: also run the cases on this model ('' to skip; default: stories260k)",
    )
    args = parser.parse_args()
    problems = []
    for name, run in PARTS.items():
        if args.part in (name, "all"):
            problems += run(args)
    if problems:
        print(f"\nOUTPUTS DIFFER ({len(problems)} problem(s)):", *problems[:20], sep="\n  ")
        return 1
    print("\noutputs checked: as they must be")
    return 0


if __name__ == "__main__":
    sys.exit(main())
