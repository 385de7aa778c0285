"""Greedy decoding through every attention backend and CUDA-graph setting gives the tokens of
the reference path (torch_native, graphs off), on real weights.

Models: stories260k in float32; SmolLM2-135M cut to its first blocks by pack.sh, in float32
and bfloat16. Per model and dtype, each variant is a fresh `pyserve.Engine`; it first runs
prompt 0 alone (so its prefix is in the radix cache), then all 8 prompts in one call: prompts
1-3 share prompt 0's opening, so their prefill extends a cached prefix; the others have other
lengths (one token to a few hundred). 32 new tokens each, ignore_eos. Compared with the
reference run: every token in float32 (a mismatch fails the script); in bfloat16 the count
of equal sequences and the first differing position, since rounding may legitimately flip
an argmax there.

    python benches/gpu/check_greedy.py                   # CUDA: triton and torch_native
    python benches/gpu/check_greedy.py --device cpu --tiny   # CPU: cpu vs torch_native, stories only

Options the engine does not have yet in this checkout (`attention_backend="triton"`,
`disable_cuda_graph`, `cuda_graph_max_bs`) are checked in ServerArgs at start and the variants
that need them are skipped with a note. Writes check_greedy.json under $OUT.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

NEW_TOKENS = 32
SHARED_OPENING = (
    "Once upon a time, there was a little girl named Lily. She loved to play "
    "outside in the park with her friends. One day,"
)
PROMPTS = [
    SHARED_OPENING + " she saw a big red ball",
    SHARED_OPENING + " her mom said",
    SHARED_OPENING + " a dog",
    SHARED_OPENING,
    "Tom",
    "The sun was hot and the sky was blue. Ben and his dad went to the lake to",
    "Sue had a cat. ",
    " ".join(["Lily and Ben were friends who liked to share their toys and sing songs."] * 12),
]


@dataclass
class Variant:
    """One way of running the engine; `needs` names what it requires of this checkout."""

    name: str
    backend: str
    graphs: bool
    needs: list[str] = field(default_factory=list)


def graph_capable(backend: str) -> bool:
    """Whether `backend` can be captured in CUDA graphs (its class says; True if unknown)."""
    try:
        from pyserve.layers.attention.registry import backend_class

        return bool(getattr(backend_class(backend), "supports_cuda_graph", True))
    except (ImportError, ValueError):
        return True


def variants(device: str, notes: list[str]) -> tuple[Variant, list[Variant]]:
    """(the reference, the variants compared with it) on `device`."""
    if device == "cpu":
        return Variant("torch_native", "torch_native", False), [Variant("cpu", "cpu", False)]
    if "disable_cuda_graph" not in common.server_arg_names():
        notes.append("ServerArgs has no disable_cuda_graph yet: graphs on/off not compared")
        return Variant("torch_native", "torch_native", False), [Variant("triton", "triton", False, ["triton"])]
    others = [
        Variant("triton, graphs off", "triton", False, ["triton"]),
        Variant("triton, graphs on", "triton", True, ["triton"]),
    ]
    if graph_capable("torch_native"):
        others.insert(0, Variant("torch_native, graphs on", "torch_native", True))
    else:
        notes.append("torch_native cannot be captured: its graphs-on run is the reference itself")
    return Variant("torch_native, graphs off", "torch_native", False), others


def missing(variant: Variant) -> list[str]:
    """What `variant` needs that this checkout lacks."""
    have = set(common.attention_backend_names()) | common.server_arg_names()
    return [need for need in variant.needs if need not in have]


def engine_kwargs(
    model: str, tokenizer: str | None, dtype: str, device: str, variant: Variant, notes: list[str]
) -> dict:
    kwargs = {
        "model_path": model,
        "dtype": dtype,
        "device": device,
        "attention_backend": variant.backend,
        "max_total_tokens": 8192,
        "max_running_requests": len(PROMPTS),
        "random_seed": 0,
        "log_level": "warning",
    }
    if tokenizer:
        kwargs["tokenizer_path"] = tokenizer
    if device == "cuda":
        # capture only the batch sizes this check runs: graph capture time stays small
        kwargs.update(
            common.engine_options({"disable_cuda_graph": not variant.graphs, "cuda_graph_max_bs": len(PROMPTS)}, notes)
        )
    return kwargs


def run_engine(kwargs: dict) -> list[list[int]]:
    """[prompt 0 alone] + [the 8 prompts in one call]: 9 greedy output id lists."""
    import pyserve

    params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with pyserve.Engine(**kwargs) as engine:
        solo = engine.generate(PROMPTS[0], params)
        batch = engine.generate(PROMPTS, [dict(params) for _ in PROMPTS])
    return [solo["output_ids"]] + [o["output_ids"] for o in batch]


def compare(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Equal tokens (of all), equal sequences, and the first differing position (None if all
    equal) over the 9 sequences."""
    equal_tokens = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    total = sum(len(r) for r in ref)
    firsts = [
        next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), None if len(r) == len(g) else min(len(r), len(g)))
        for r, g in zip(ref, got)
    ]
    diffs = [f for f in firsts if f is not None]
    return {
        "equal_tokens": equal_tokens,
        "total_tokens": total,
        "equal_seqs": sum(f is None for f in firsts),
        "num_seqs": len(ref),
        "first_diff": min(diffs) if diffs else None,
        "first_diff_per_seq": firsts,
    }


def gguf_tokenizer_folder(gguf_path: str, into: str) -> str:
    """The GGUF's tokenizer saved as an HF folder once: transformers rebuilds it from the GGUF
    metadata in ~10 s, which every engine start would pay again."""
    from pyserve.model_loader.tokenizer import get_tokenizer

    get_tokenizer(gguf_path).save_pretrained(into)
    return into


class Report:
    """The table rows (each also logged at once, in case a later engine hangs), the JSON
    results, and whether anything failed."""

    def __init__(self) -> None:
        self.rows: list[list] = []
        self.results: list[dict] = []
        self.failed = False

    def add(self, cells: list, result: dict | None = None) -> None:
        self.rows.append(cells)
        common.log("  " + " | ".join(map(str, cells)))
        if result is not None:
            self.results.append(result)


def check(
    report: Report,
    label: str,
    path: str,
    tokenizer: str | None,
    dtype: str,
    device: str,
    reference: Variant,
    others: list[Variant],
    notes: list[str],
) -> None:
    """Run the reference, then every variant, on one model and dtype; add their rows."""
    key = {"model": label, "dtype": dtype}
    start = time.perf_counter()
    try:
        ref_ids = run_engine(engine_kwargs(path, tokenizer, dtype, device, reference, notes))
    except Exception as exc:
        report.failed = True
        report.add(
            [label, dtype, reference.name, "-", "-", "-", f"ERROR (reference) {exc!r:.80}"],
            {**key, "variant": reference.name, "error": repr(exc)},
        )
        return
    common.log(f"{label} {dtype} reference ({reference.name}) in {time.perf_counter() - start:.1f} s")
    for variant in others:
        gone = missing(variant)
        if gone:
            report.add([label, dtype, variant.name, "-", "-", "-", f"skipped: pyserve has no {', '.join(gone)} yet"])
            continue
        start = time.perf_counter()
        try:
            got = run_engine(engine_kwargs(path, tokenizer, dtype, device, variant, notes))
        except Exception as exc:  # a backend that fails to start or run fails the check
            report.failed = True
            report.add(
                [label, dtype, variant.name, "-", "-", "-", f"ERROR {exc!r:.90}"],
                {**key, "variant": variant.name, "error": repr(exc)},
            )
            continue
        cmp = compare(ref_ids, got)
        exact = cmp["equal_tokens"] == cmp["total_tokens"]
        if dtype == "float32":
            status = "ok" if exact else "MISMATCH"
            report.failed |= not exact
        else:
            status = "ok" if exact else "diverged (bf16: allowed)"
        first = "-" if cmp["first_diff"] is None else cmp["first_diff"]
        report.add(
            [
                label,
                dtype,
                variant.name,
                f"{cmp['equal_tokens']}/{cmp['total_tokens']}",
                f"{cmp['equal_seqs']}/{cmp['num_seqs']}",
                first,
                status,
            ],
            {**key, "variant": variant.name, "seconds": time.perf_counter() - start, **cmp, "status": status},
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="stories260k only (the CPU dry run)")
    args = parser.parse_args()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("check_greedy: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    notes: list[str] = []
    reference, others = variants(args.device, notes)
    models = [("stories260k", common.stories_path(), False, ["float32"])]
    smollm2 = common.smollm2_path()
    if not args.tiny:
        if smollm2 is None:
            notes.append("no .gpu/models/smollm2-*.gguf (run benches/gpu/pack.sh): SmolLM2 skipped")
        else:
            models.append((os.path.basename(smollm2), smollm2, True, ["float32", "bfloat16"]))
    report = Report()
    with tempfile.TemporaryDirectory() as tmp:
        for label, path, is_gguf, dtypes in models:
            tokenizer = gguf_tokenizer_folder(path, os.path.join(tmp, label + "-tokenizer")) if is_gguf else None
            for dtype in dtypes:
                check(report, label, path, tokenizer, dtype, args.device, reference, others, notes)
    title = f"check_greedy on {args.device}: {NEW_TOKENS} greedy tokens x 9 sequences vs {reference.name}"
    print(
        common.format_table(
            title, ["model", "dtype", "variant", "equal tokens", "equal seqs", "first diff", "status"], report.rows
        )
    )
    for note in notes:
        print(f"  note: {note}")
    common.write_json(
        "check_greedy.json",
        {"device": args.device, "reference": reference.name, "results": report.results, "notes": notes},
    )
    print("check_greedy: FAILED (a float32 mismatch or an error)" if report.failed else "check_greedy: passed")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
