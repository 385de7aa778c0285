"""Part (i) of bench_decode.py: the device's copy bandwidth, and each Triton kernel of
pyserve_kernels.triton_ops timed at decode shapes, as achieved bandwidth against that copy
bandwidth.

The shapes are one layer of Llama-3.1-8B in bfloat16 (32 query heads, 8 KV heads, head dim 128,
hidden 4096, intermediate 14336): decode attention at batch 64 over 4096 keys each (the
decode-attention target: ~1 GiB of K/V, far past the 60 MB L2), the element-wise kernels at a
batch-256 decode step (256 tokens). Bytes are the fewest each call must move (every input read
once, every output written once); the bandwidth ceiling is a large device-to-device
`Tensor.copy_` (bytes read + bytes written), measured in the same run.

Small kernels are timed as a CUDA graph that calls them once on each of several input sets
(enough sets to span 4x the L2, so the figure is memory, not cache, and launch gaps are gone);
the eager time per call (launch overhead included) is given beside it. On CPU (--tiny) the
same code runs under TRITON_INTERPRET=1 on tiny float32 shapes: its times mean nothing, only
that every case runs.
"""

from __future__ import annotations

import importlib
import inspect
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class Clock:
    """Median wall time of a callable: CUDA events around each repetition on CUDA (device
    time of the queued work), perf_counter on CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def median_ms(self, fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def copy_bandwidth(clock: Clock, device: str, tiny: bool) -> float:
    """Bytes per second of dst.copy_(src) on a buffer far larger than any cache (2 GiB on CUDA,
    64 MiB on CPU), counting bytes read plus bytes written. Random data, not zeros."""
    numel = (16 << 20) if tiny else (1 << 30)  # bfloat16 elements: 32 MiB / 2 GiB
    src = torch.randn(numel, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = clock.median_ms(lambda: dst.copy_(src), reps=5 if tiny else 20)
    return 2 * src.numel() * src.element_size() / (ms / 1e3)


@dataclass
class Shapes:
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    dtype: torch.dtype
    decode_batch: int  # decode attention
    decode_context: int
    tokens: int  # the element-wise kernels' batch
    kv_slots: int  # store_kv's pool


FULL = Shapes(32, 8, 128, 4096, 14336, torch.bfloat16, 64, 4096, 256, 65536)
TINY = Shapes(4, 2, 16, 64, 128, torch.float32, 2, 64, 8, 64)


@dataclass
class Case:
    """One kernel at one shape: `calls` are the same launch on different input sets."""

    name: str
    shape: str
    bytes_per_call: int
    calls: list[Callable[..., object]]


def _module(name: str):
    return importlib.import_module(f"pyserve_kernels.triton_ops.{name}")


def _accepted(fn: Callable, **optional) -> dict:
    """The optional keywords that `fn`'s signature has (looked up once, outside timed calls)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in optional.items() if k in params}


def _num_sets(bytes_per_call: int, device: str, tiny: bool) -> int:
    if tiny:
        return 2
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 60 << 20)
    return max(1, min(64, math.ceil(4 * l2 / bytes_per_call)))


def _decode_attention(s: Shapes, dev: str, tiny: bool) -> Case:
    mod = _module("decode_attention")
    b, ctx, elt = s.decode_batch, s.decode_context, torch.finfo(s.dtype).bits // 8
    k_buf = torch.randn(b * ctx + 1, s.kv_heads, s.head_dim, device=dev, dtype=s.dtype)
    v_buf = torch.randn_like(k_buf)
    # each request's keys in a random order of slots, as a pool looks after some churn
    req_to_token = (torch.randperm(b * ctx, device=dev) + 1).to(torch.int32).view(b, ctx)
    rows = torch.arange(b, device=dev)
    seq_lens = torch.full((b,), ctx, device=dev)
    q = torch.randn(b, s.heads, s.head_dim, device=dev, dtype=s.dtype)
    out = torch.empty_like(q)
    extra = {"out": out}
    if hasattr(mod, "decode_workspace"):  # a fixed workspace, as a captured decode step has
        extra["workspace"] = mod.decode_workspace(b, s.heads, s.head_dim, **_accepted(mod.decode_workspace, device=dev))
    extra = _accepted(mod.decode_attention_fwd, **extra)
    fwd, scaling = mod.decode_attention_fwd, s.head_dim**-0.5

    def call() -> None:
        fwd(q, k_buf, v_buf, req_to_token, rows, seq_lens, scaling, **extra)

    nbytes = 2 * b * ctx * s.kv_heads * s.head_dim * elt + 2 * q.numel() * elt + req_to_token.numel() * 4
    return Case("decode_attention", f"bs={b} ctx={ctx} {s.heads}/{s.kv_heads}x{s.head_dim}", nbytes, [call])


def _fused_qkv(s: Shapes, dev: str) -> torch.Tensor:
    return torch.randn(s.tokens, (s.heads + 2 * s.kv_heads) * s.head_dim, device=dev, dtype=s.dtype)


def _store_kv(s: Shapes, dev: str, tiny: bool) -> Case:
    mod = _module("kv_store")
    elt = torch.finfo(s.dtype).bits // 8
    k_buf = torch.randn(s.kv_slots, s.kv_heads, s.head_dim, device=dev, dtype=s.dtype)
    v_buf = torch.randn_like(k_buf)
    loc = torch.randperm(s.kv_slots - 1, device=dev)[: s.tokens] + 1
    nbytes = 4 * s.tokens * s.kv_heads * s.head_dim * elt + loc.numel() * 8
    q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
    calls = []
    for _ in range(_num_sets(nbytes, dev, tiny)):
        # k and v as strided views of a fused q|k|v projection, as the model passes them
        _, k, v = _fused_qkv(s, dev).split([q_size, kv_size, kv_size], dim=-1)
        k, v = k.view(s.tokens, s.kv_heads, s.head_dim), v.view(s.tokens, s.kv_heads, s.head_dim)
        calls.append(lambda k=k, v=v: mod.store_kv(k_buf, v_buf, loc, k, v))
    return Case("store_kv", f"tokens={s.tokens} {s.kv_heads}x{s.head_dim}", nbytes, calls)


def _rms_norm(s: Shapes, dev: str, tiny: bool) -> Case:
    mod = _module("norm")
    elt = torch.finfo(s.dtype).bits // 8
    weight = torch.randn(s.hidden, device=dev, dtype=s.dtype)
    nbytes = 2 * s.tokens * s.hidden * elt + s.hidden * elt
    calls = []
    for _ in range(_num_sets(nbytes, dev, tiny)):
        x = torch.randn(s.tokens, s.hidden, device=dev, dtype=s.dtype)
        out = torch.empty_like(x)
        calls.append(lambda x=x, out=out: mod.rms_norm(x, weight, 1e-6, out=out))
    return Case("rms_norm", f"tokens={s.tokens} hidden={s.hidden}", nbytes, calls)


def _fused_add_rms_norm(s: Shapes, dev: str, tiny: bool) -> Case:
    mod = _module("norm")
    elt = torch.finfo(s.dtype).bits // 8
    weight = torch.randn(s.hidden, device=dev, dtype=s.dtype)
    nbytes = 4 * s.tokens * s.hidden * elt + s.hidden * elt  # x, residual: read and written
    calls = []
    for _ in range(_num_sets(nbytes, dev, tiny)):
        x = torch.randn(s.tokens, s.hidden, device=dev, dtype=s.dtype)
        residual = torch.randn_like(x)
        calls.append(lambda x=x, r=residual: mod.fused_add_rms_norm(x, r, weight, 1e-6))
    return Case("fused_add_rms_norm", f"tokens={s.tokens} hidden={s.hidden}", nbytes, calls)


def _rotary(s: Shapes, dev: str, tiny: bool) -> Case:
    mod = _module("rotary")
    elt = torch.finfo(s.dtype).bits // 8
    heads = s.heads + s.kv_heads  # q and k of each fused row are rotated, v is not
    angles = torch.rand(s.tokens, s.head_dim // 2, device=dev) * 100
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)
    nbytes = 2 * s.tokens * heads * s.head_dim * elt + 2 * cos.numel() * 4
    calls = []
    for _ in range(_num_sets(nbytes, dev, tiny)):
        qkv = _fused_qkv(s, dev)
        calls.append(lambda x=qkv: mod.rotary_embedding_(x, cos, sin, heads, s.head_dim))
    return Case("rotary_embedding_", f"tokens={s.tokens} {heads}x{s.head_dim} of q|k|v", nbytes, calls)


def _silu_and_mul(s: Shapes, dev: str, tiny: bool) -> Case:
    mod = _module("activation")
    elt = torch.finfo(s.dtype).bits // 8
    nbytes = 3 * s.tokens * s.intermediate * elt
    calls = []
    for _ in range(_num_sets(nbytes, dev, tiny)):
        x = torch.randn(s.tokens, 2 * s.intermediate, device=dev, dtype=s.dtype)
        out = torch.empty(s.tokens, s.intermediate, device=dev, dtype=s.dtype)
        calls.append(lambda x=x, out=out: mod.silu_and_mul(x, out=out))
    return Case("silu_and_mul", f"tokens={s.tokens} inter={s.intermediate}", nbytes, calls)


BUILDERS = [_decode_attention, _store_kv, _rms_norm, _fused_add_rms_norm, _rotary, _silu_and_mul]


def _graph_ms_per_call(case: Case, clock: Clock) -> float:
    """Capture one graph that runs every call once; median replay time / number of calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture stream, as graph capture wants
        for call in case.calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in case.calls:
            call()
    return clock.median_ms(graph.replay) / len(case.calls)


def kernel_rows(device: str, tiny: bool, copy_bps: float) -> list[dict[str, Any]]:
    """One dict per kernel: name, shape, us (graph, else eager), GB/s, fraction of copy
    bandwidth, and a note; a kernel whose module is missing or fails is a row saying so."""
    clock = Clock(device)
    shapes = TINY if tiny else FULL
    rows: list[dict[str, Any]] = []
    for build in BUILDERS:
        name = build.__name__.lstrip("_")
        try:
            bench_case = build(shapes, device, tiny)
            calls = bench_case.calls
            eager_ms = clock.median_ms(
                lambda calls=calls: [c() for c in calls], reps=3 if tiny else 20, warmup=1 if tiny else 3
            ) / len(calls)
        except ImportError as exc:
            rows.append({"name": name, "skipped": f"not importable yet ({exc})"})
            continue
        except Exception as exc:  # a kernel being written may not run yet: say so, go on
            rows.append({"name": name, "skipped": f"ERROR {type(exc).__name__}: {str(exc)[:90]}"})
            continue
        ms, how = eager_ms, "eager"
        if device == "cuda":
            try:
                ms, how = _graph_ms_per_call(bench_case, clock), "graph"
            except Exception as exc:
                how = f"eager (capture failed: {type(exc).__name__})"
        bps = bench_case.bytes_per_call / (ms / 1e3)
        note = f"{how}, {len(bench_case.calls)} input sets"
        if how == "graph":
            note += f"; eager {eager_ms * 1e3:.1f} us/call"
        rows.append(
            {
                "name": bench_case.name,
                "shape": bench_case.shape,
                "bytes": bench_case.bytes_per_call,
                "us": ms * 1e3,
                "gbps": bps / 1e9,
                "fraction": bps / copy_bps,
                "note": note,
            }
        )
        del bench_case
    return rows
