"""Part (iii) of bench_decode.py: offline throughput of `pyserve.Engine` against HF
transformers `generate` on nano-vllm's workload (github.com/GeeeekExplorer/nano-vllm,
bench.py: 256 sequences of random ids in [0, 10000], input and output lengths uniform in
[100, 1024], random.seed(0), temperature 0.6, ignore_eos; 133,966 output tokens in all).

Both run dummy (random) weights of one config on the same device. pyserve gets all requests
in one `generate` call (input_ids; the tokenizer is a stand-in, see bench_decode.py); HF gets
them as one left-padded batch, so every row runs to the longest output, and only the tokens
the workload asks for are counted for it. Each side has a time budget: past it pyserve's
requests are aborted and HF stops (max_time), and the row says the run was cut.
"""

from __future__ import annotations

import gc
import random
import threading
import time
from typing import Any

import common
import torch


def nano_vllm_workload(tiny: bool) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py workload, drawn in its order: each prompt's length, then its ids;
    then every output length. 256 sequences (8 with --tiny, shorter)."""
    rng = random.Random(0)
    num, lo, hi, max_id = (8, 10, 40, 999) if tiny else (256, 100, 1024, 10000)
    prompts = [[rng.randint(0, max_id) for _ in range(rng.randint(lo, hi))] for _ in range(num)]
    out_lens = [rng.randint(lo // 2 if tiny else lo, hi // 2 if tiny else hi) for _ in range(num)]
    return prompts, out_lens


def run_with_budget(fn, budget_s: float, on_timeout) -> tuple[Any, float, bool]:
    """fn() in a thread; if it outlasts budget_s, on_timeout() and wait for it to return.
    Returns (fn's result, seconds, whether the budget cut it short)."""
    box: dict = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:
            box["error"] = exc

    t0 = time.perf_counter()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(budget_s)
    cut = thread.is_alive()
    if cut:
        on_timeout()
        thread.join()
    seconds = time.perf_counter() - t0
    if "error" in box:
        raise box["error"]
    return box.get("result"), seconds, cut


def pyserve_throughput(
    path: str, prompts, out_lens, budget_s: float, device: str, backend: str, notes: list[str]
) -> dict:
    """One warm-up request, then the whole workload in one Engine.generate call (as nano-vllm
    gives its engine the whole list); aborted when it outlasts budget_s."""
    import pyserve

    dtype = "float32" if device == "cpu" else "bfloat16"
    kwargs = common.engine_options(
        {
            "model_path": path,
            "tokenizer_path": common.stories_path(),
            "load_format": "dummy",
            "dtype": dtype,
            "device": device,
            "attention_backend": backend,
            "max_running_requests": len(prompts),
            "max_total_tokens": sum(map(len, prompts)) + sum(out_lens) + 1024,
            "max_prefill_tokens": 16384,
            "context_length": max(map(len, prompts)) + max(out_lens) + 16,
            "random_seed": 0,
            "log_level": "warning",
        },
        notes,
    )
    params = [{"temperature": 0.6, "max_new_tokens": n, "ignore_eos": True} for n in out_lens]
    t0 = time.perf_counter()
    with pyserve.Engine(**kwargs) as engine:
        start_s = time.perf_counter() - t0
        engine.generate(input_ids=prompts[0][:16], sampling_params={"max_new_tokens": 4})  # warm-up
        outs, seconds, cut = run_with_budget(
            lambda: engine.generate(input_ids=prompts, sampling_params=params),
            budget_s,
            lambda: engine.abort_request(abort_all=True),
        )
        backend = getattr(engine.core.model_runner, "attention_backend_name", "?")
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "partial": cut,
        "note": f"{backend}; start {start_s:.1f} s" + ("; CUT at budget" if cut else ""),
    }


def hf_throughput(path: str, prompts, out_lens, budget_s: float, device: str) -> dict:
    """The workload as one left-padded batch through HF generate (sampling as pyserve's:
    temperature 0.6, no top-k / top-p); stopped by max_time past budget_s."""
    import transformers

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    longest = max(map(len, prompts))
    ids = torch.zeros(len(prompts), longest, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding: every row's last prompt token at the end
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    gen = dict(
        max_new_tokens=max(out_lens),
        do_sample=True,
        temperature=0.6,
        top_k=0,
        top_p=1.0,
        pad_token_id=0,
        eos_token_id=None,
        max_time=budget_s,
    )
    with torch.inference_mode():
        model.generate(
            input_ids=ids[:1, -8:].to(device),
            attention_mask=mask[:1, -8:].to(device),
            max_new_tokens=2,
            do_sample=True,
            pad_token_id=0,
            eos_token_id=None,
        )  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **gen)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    generated = out.shape[1] - longest
    useful = sum(min(generated, n) for n in out_lens)
    cut = generated < max(out_lens)
    del model, out
    return {
        "seconds": seconds,
        "output_tokens": useful,
        "partial": cut,
        "note": f"one batch of {len(prompts)}, {generated} steps" + ("; CUT at max_time" if cut else ""),
    }


def throughput_rows(path: str, device: str, tiny: bool, backend: str, budget_s: float, notes: list[str]) -> list[list]:
    """Rows of part (iii): pyserve, then HF generate, on the Qwen3-0.6B-shaped folder `path`."""
    prompts, out_lens = nano_vllm_workload(tiny)
    shape = f"qwen3-0.6b {len(prompts)} seqs, {sum(out_lens)} out tok"
    results = {}
    runs = (
        ("pyserve", lambda: pyserve_throughput(path, prompts, out_lens, budget_s, device, backend, notes)),
        ("hf generate", lambda: hf_throughput(path, prompts, out_lens, budget_s, device)),
    )
    for name, run in runs:
        try:
            results[name] = run()
        except Exception as exc:
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:100]}"}
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    rows = []
    hf = results.get("hf generate", {})
    for name, r in results.items():
        if "error" in r:
            rows.append(["throughput", f"{name} {shape}", "-", "-", "-", "-", f"ERROR {r['error']}"])
            continue
        rate = r["output_tokens"] / r["seconds"]
        vs = "-"
        if "error" not in hf:
            vs = f"{rate / (hf['output_tokens'] / hf['seconds']):.2f}x HF"
        rows.append(
            [
                "throughput",
                f"{name} {shape}",
                f"{r['seconds']:.1f} s",
                f"{rate:,.0f} out tok/s",
                vs,
                f"{r['output_tokens']} tok",
                r["note"],
            ]
        )
        common.log("  " + " | ".join(rows[-1]))
    return rows
