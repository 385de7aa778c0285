"""How close pyserve's decode comes to the memory-bandwidth roofline on one GPU, in one table.

(i)   kernels: the device's copy bandwidth (the ceiling), then each Triton kernel of
      pyserve_kernels.triton_ops at decode shapes as a fraction of it (kernel_bench.py).
(ii)  decode steps: `ModelRunner` on dummy weights shaped like Qwen2.5-0.5B, Llama-3.1-8B and
      the mixture OLMoE-1B-7B (its experts on the Triton grouped GEMMs, captured like the rest),
      bfloat16, batch 1 / 64 / 256 over 1k tokens of context each, CUDA graphs on and off,
      driven as the worker drives it (StepPlan -> DeviceState.forward_batch -> forward ->
      sample -> ids to the host). A decode step must read every weight once plus every
      request's K/V, so its floor is (weight bytes + KV bytes) / copy bandwidth; the column
      "vs ceiling" is that floor over the measured step.
(iii) offline throughput on nano-vllm's recipe (offline_bench.py) with Qwen3-0.6B-shaped
      dummy weights: `pyserve.Engine` (input_ids given; the tokenizer is stories260k's, whose
      512 ids are fewer than the model's: ids past it decode to nothing) against HF
      transformers `generate` on the same GPU with the same shapes.

    python benches/gpu/bench_decode.py                       # the GPU run, ~3-4 minutes
    python benches/gpu/bench_decode.py --device cpu --tiny   # same code paths, tiny shapes, CPU

On CUDA, pyserve's dummy init (`init_dummy_weights`: random numbers drawn on the host, ~1 min
for 8B parameters on a few cores) is replaced in this process by the same distribution drawn
on the device; --host-dummy-init keeps pyserve's. Writes bench_decode.json under $OUT.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from decode_models import MODELS, TINY  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU dry run)")
    p.add_argument("--parts", default="kernels,decode,throughput")
    p.add_argument("--host-dummy-init", action="store_true")
    p.add_argument(
        "--attention-backend",
        default="auto",
        help="of the decode runners and the throughput engine (auto: triton on CUDA)",
    )
    p.add_argument(
        "--throughput-budget-s",
        type=float,
        default=None,
        help="per engine in (iii); past it the run is cut short and reported partial",
    )
    return p.parse_args()


ARGS = parse_args()
if ARGS.device == "cpu":  # the Triton kernels run on CPU tensors only in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernel_bench  # noqa: E402
import numpy as np  # noqa: E402
import offline_bench  # noqa: E402
import torch  # noqa: E402


def write_model(folder: str, name: str, tiny: bool) -> str:
    """A model folder holding only config.json (all load_format="dummy" needs)."""
    cfg = dict(MODELS[name], **(TINY if tiny else {}))
    path = os.path.join(folder, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def use_device_dummy_init() -> None:
    """Make every pyserve model draw its dummy weights on its own device (the distribution of
    pyserve's init_dummy_weights: N(0, 0.02), biases 0, norm weights 1), in this process only."""
    from pyserve.models.llama import LlamaForCausalLM

    def init_on_device(self, seed: int = 0) -> None:
        with torch.no_grad():
            for name, param in self.named_parameters():
                gen = torch.Generator(device=param.device).manual_seed(seed)
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    param.normal_(0.0, 0.02, generator=gen)
                seed += 1

    LlamaForCausalLM.init_dummy_weights = init_on_device


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def supported_kwargs(fn, wanted: dict, notes: list[str]) -> dict:
    """`wanted` less the keywords `fn` does not take in this checkout (noted)."""
    params = inspect.signature(fn).parameters
    for key in wanted:
        if key not in params and f"{fn.__qualname__} takes no {key}" not in notes:
            notes.append(f"{fn.__qualname__} takes no {key}")
    return {k: v for k, v in wanted.items() if k in params}


# ------------------------------------------------------------------- (ii) decode steps


class DecodeDriver:
    """Decode steps of up to `max_bs` requests through one ModelRunner, as the worker runs them.

    Each request row r holds `context_len` tokens of K/V at slots 1 + r * width + position:
    the rows are written by an EXTEND plan through DeviceState.forward_batch (as at
    admission), but no prefill runs: the pool is filled with random values instead, since a
    decode step's cost does not depend on how its K/V got there."""

    def __init__(self, runner, max_bs: int, context_len: int, max_steps: int) -> None:
        from pyserve.forward_batch_info import ForwardMode, SamplingRow, StepPlan
        from pyserve.model_executor.device_state import DeviceState
        from pyserve.sampling_params import SamplingParams

        self.runner, self.context_len = runner, context_len
        self.width = context_len + max_steps
        self.cuda = runner.device.startswith("cuda")
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.state = DeviceState(max_bs, self.width, runner.model_config.vocab_size, runner.device)
        rows = np.arange(max_bs, dtype=np.int32)
        pos = np.tile(np.arange(context_len, dtype=np.int32), max_bs)
        slots = self.slot(np.repeat(rows, context_len), pos)
        greedy = SamplingParams(temperature=0.0)
        plan = StepPlan(
            ForwardMode.EXTEND,
            req_pool_indices=rows,
            seq_lens=np.full(max_bs, context_len, np.int32),
            positions=pos,
            out_cache_loc=slots,
            input_ids=np.zeros(pos.shape[0], np.int32),
            prefix_lens=np.zeros(max_bs, np.int32),
            extend_lens=np.full(max_bs, context_len, np.int32),
            row_slots=slots,
            new_sampling_rows=[SamplingRow(int(r), greedy, frozenset()) for r in rows],
        )
        with torch.inference_mode():
            self.state.forward_batch(plan)
            for layer in range(runner.model_config.num_hidden_layers):
                for buf in runner.kv_pool.get_kv_buffer(layer):
                    buf.normal_()
        if self.cuda:
            torch.cuda.synchronize()  # the rows and the pool are written before capture reads them
            runner.init_cuda_graphs(self.state.req_to_token, self.stream)  # as the worker does at start
        self._plan, self._mode = StepPlan, ForwardMode

    def slot(self, row: np.ndarray, position: np.ndarray) -> np.ndarray:
        return (1 + row * np.int32(self.width) + position).astype(np.int32)  # int32, as plans are

    def step(self, batch_size: int, position: int) -> None:
        """One decode step of rows 0..batch_size-1 writing `position`; returns once the
        sampled ids are on the host (the step's end, as the worker sees it)."""
        rows = np.arange(batch_size, dtype=np.int32)
        plan = self._plan(
            self._mode.DECODE,
            req_pool_indices=rows,
            seq_lens=np.full(batch_size, position + 1, np.int32),
            positions=np.full(batch_size, position, np.int32),
            out_cache_loc=self.slot(rows, np.full(batch_size, position)),
        )
        on_stream = torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()
        with torch.inference_mode(), on_stream:
            batch = self.state.forward_batch(plan)
            logits = self.runner.forward(batch)
            next_ids = self.runner.sample_next(logits, batch)[0]
            self.state.record_sampled(plan, batch, next_ids).cpu()

    def median_step_ms(self, batch_size: int, warmup: int, steps: int) -> float:
        times = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            self.step(batch_size, self.context_len + i)
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def step_bytes(runner, batch_size: int, mean_seq_len: float) -> tuple[int, int]:
    """(weight bytes, KV bytes) a decode step must read: every parameter once, except that an
    untied embedding table gives only the batch's rows (its LM head is read whole) and a
    mixture's experts count as many as the batch can reach (batch_size * top_k of E); K and V of
    every cached token of every request, all layers."""
    model, cfg = runner.model, runner.model_config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if getattr(model, "lm_head", None) is not None:
        embed = model.model.embed_tokens.weight
        weights -= embed.numel() * embed.element_size()
        weights += batch_size * embed.shape[1] * embed.element_size()
    for module in model.modules():  # a mixture reads at most batch_size * k of its E experts
        experts = getattr(module, "experts", None)
        if hasattr(module, "top_k") and experts is not None and hasattr(experts, "num_experts"):
            held = sum(p.numel() * p.element_size() for p in experts.parameters())
            touched = min(experts.num_experts, batch_size * module.top_k)
            weights -= held - held * touched // experts.num_experts
    elt = torch.empty((), dtype=runner.dtype).element_size()
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elt
    return weights, int(batch_size * mean_seq_len * per_token)


DECODE_SIZES, DECODE_CONTEXT, DECODE_WARMUP, DECODE_STEPS = (1, 64, 256), 1024, 3, 10
TINY_DECODE_SIZES, TINY_DECODE_CONTEXT, TINY_DECODE_WARMUP, TINY_DECODE_STEPS = (1, 4, 8), 32, 1, 3


def decode_rows(folder: str, copy_bps: float, notes: list[str]) -> list[list]:
    """Rows of part (ii): each model, graphs off then on, each batch size."""
    graph_modes = [False] if ARGS.device == "cpu" else [False, True]
    if ARGS.device == "cpu":
        notes.append("decode: CUDA graphs are off on CPU; only the eager rows run")
    rows: list[list] = []
    for name in ("qwen2.5-0.5b", "llama-3.1-8b", "olmoe-1b-7b"):
        path = write_model(folder, name, ARGS.tiny)
        for graphs in graph_modes:
            label = f"{name} graphs {'on' if graphs else 'off'}"
            try:
                decode_model_rows(path, label, graphs, copy_bps, rows, notes)
            except Exception as exc:  # one model failing (OOM, capture) leaves the others
                rows.append(["decode", label, "-", "-", "-", "-", f"ERROR {type(exc).__name__}: {str(exc)[:100]}"])
            gc.collect()
            if ARGS.device == "cuda":
                torch.cuda.empty_cache()
    return rows


def decode_model_rows(path: str, label: str, graphs: bool, copy_bps: float, rows: list[list], notes: list[str]) -> None:
    from pyserve.model_executor.model_runner import ModelRunner

    if ARGS.tiny:
        sizes, context_len = TINY_DECODE_SIZES, TINY_DECODE_CONTEXT
        warmup, steps = TINY_DECODE_WARMUP, TINY_DECODE_STEPS
    else:
        sizes, context_len, warmup, steps = DECODE_SIZES, DECODE_CONTEXT, DECODE_WARMUP, DECODE_STEPS
    wanted = {
        "dtype": "float32" if ARGS.device == "cpu" else "bfloat16",
        "device": ARGS.device,
        "load_format": "dummy",
        "load_progress": False,
        "attention_backend": ARGS.attention_backend,
        "max_total_tokens": max(sizes) * (context_len + warmup + steps) + 64,
        "context_length": context_len + warmup + steps + 16,
        "max_running_requests": max(sizes),
        "disable_cuda_graph": not graphs,
        "cuda_graph_bs": list(sizes),
    }  # capture only the sizes measured
    kwargs = supported_kwargs(ModelRunner.__init__, wanted, notes)
    if graphs and "disable_cuda_graph" not in kwargs:
        rows.append(["decode", label, "-", "-", "-", "-", "skipped: ModelRunner has no CUDA graphs yet"])
        return
    t0 = time.perf_counter()
    runner = ModelRunner(path, **kwargs)
    driver = DecodeDriver(runner, max(sizes), context_len, warmup + steps)
    start_s = time.perf_counter() - t0
    captured = getattr(runner, "graph_runner", None) is not None
    backend = getattr(runner, "attention_backend_name", type(runner.attn_backend).__name__)
    if graphs and not captured:
        notes.append(f"{label}: the runner captured no graph (backend {backend}); ran eagerly")
    for bs in sizes:
        ms = driver.median_step_ms(bs, warmup, steps)
        w_bytes, kv_bytes = step_bytes(runner, bs, context_len + warmup + steps / 2)
        floor_ms = (w_bytes + kv_bytes) / copy_bps * 1e3
        rows.append(
            [
                "decode",
                f"{label} bs={bs} ctx={context_len}",
                f"{ms:.3f} ms",
                f"{bs / ms * 1e3:,.0f} tok/s",
                f"{floor_ms / ms:.1%}",
                f"floor {floor_ms:.3f} ms",
                f"{backend}; {fmt_bytes(w_bytes)} weights + {fmt_bytes(kv_bytes)} KV; start {start_s:.1f} s",
            ]
        )
        common.log("  " + " | ".join(rows[-1]))


# ------------------------------------------------------------------- main


def main() -> int:
    if ARGS.device == "cuda" and not torch.cuda.is_available():
        print("bench_decode: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    if ARGS.device == "cuda" and not ARGS.host_dummy_init:
        use_device_dummy_init()
    parts = set(ARGS.parts.split(","))
    notes: list[str] = []
    clock = kernel_bench.Clock(ARGS.device)
    copy_bps = kernel_bench.copy_bandwidth(clock, ARGS.device, ARGS.tiny)
    rows = [
        [
            "ceiling",
            "device copy_",
            "-",
            f"{copy_bps / 1e9:,.0f} GB/s",
            "100%",
            "-",
            "read + write bytes, median of timed copies",
        ]
    ]
    if "kernels" in parts:
        common.log("bench_decode: (i) kernels")
        for k in kernel_bench.kernel_rows(ARGS.device, ARGS.tiny, copy_bps):
            if "skipped" in k:
                rows.append(["kernel", k["name"], "-", "-", "-", "-", k["skipped"]])
            else:
                rows.append(
                    [
                        "kernel",
                        f"{k['name']} {k['shape']}",
                        f"{k['us']:.1f} us",
                        f"{k['gbps']:,.0f} GB/s",
                        f"{k['fraction']:.1%}",
                        fmt_bytes(k["bytes"]),
                        k["note"],
                    ]
                )
                common.log("  " + " | ".join(rows[-1]))
    with tempfile.TemporaryDirectory() as folder:
        if "decode" in parts:
            common.log("bench_decode: (ii) decode steps")
            rows += decode_rows(folder, copy_bps, notes)
        if "throughput" in parts:
            common.log("bench_decode: (iii) offline throughput")
            rows += offline_bench.throughput_rows(
                write_model(folder, "qwen3-0.6b", ARGS.tiny),
                ARGS.device,
                ARGS.tiny,
                ARGS.attention_backend,
                ARGS.throughput_budget_s or 60.0,
                notes,
            )
    if ARGS.device == "cpu":
        notes.append(
            "CPU: Triton kernels ran under TRITON_INTERPRET=1 and the times are "
            "host times: only the code paths are checked"
        )
    name = torch.cuda.get_device_name() if ARGS.device == "cuda" else "cpu"
    print(
        common.format_table(
            f"bench_decode on {name}{' (tiny shapes)' if ARGS.tiny else ''}",
            ["part", "what", "time", "rate", "vs ceiling", "bytes / floor", "note"],
            rows,
        )
    )
    for note in notes:
        print(f"  note: {note}")
    common.write_json(
        "bench_decode.json",
        {"device": name, "tiny": ARGS.tiny, "rows": rows, "notes": notes, "copy_bytes_per_s": copy_bps},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
