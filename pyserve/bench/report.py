"""Output of the bench tool: the summary table, the JSONL result line and the latency plot."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

from pyserve.bench.metrics import RequestRecord

LATENCIES = (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E"))
STAT_KEYS = ("mean", "median", "p90", "p99")


def _num(x: Any, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def format_table(result: dict[str, Any]) -> str:
    """The summary table of a `bench serve` result (as returned by run_serve)."""
    m = result["metrics"]
    cfg = result["config"]
    source = result["token_count_source"]
    tokens_by = "server usage" if source == "usage" else f"tokenizer {result['tokenizer']}"
    errors = ", ".join(f"{k}: {v}" for k, v in m["errors"].items()) or "none"
    rows = [
        ("backend", f"{cfg['backend']} @ {result['base_url']}"),
        ("model", str(result["model"])),
        ("dataset", f"{cfg['dataset_name']} ({m['num_requests']} requests)"),
        (
            "request rate / max concurrency",
            f"{cfg['request_rate']} req/s, burstiness {cfg['burstiness']} / {cfg['max_concurrency'] or 'none'}",
        ),
        ("tokens counted by", tokens_by),
        ("successful / failed requests", f"{m['completed']} / {m['failed']}"),
        ("errors", errors),
        ("duration (s)", _num(m["duration_s"])),
        ("total input / output tokens", f"{m['total_input_tokens']} / {m['total_output_tokens']}"),
        ("cached input tokens", _cached(m)),
        ("request throughput (req/s)", _num(m["request_throughput"])),
        ("input token throughput (tok/s)", _num(m["input_throughput"])),
        ("output token throughput (tok/s)", _num(m["output_throughput"])),
        ("mean concurrency", _num(m["mean_concurrency"])),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["=" * 72, " pyserve bench serve ".center(72, "="), "=" * 72]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append("-" * 72)
    lines.append(f"{'latency (ms)':<14}" + "".join(f"{s:>12}" for s in STAT_KEYS) + f"{'samples':>10}")
    for key, label in LATENCIES:
        stats = m[key]
        n = m["num_itl_samples"] if key == "itl_ms" else m["completed"]
        lines.append(f"{label:<14}" + "".join(f"{_num(stats[s]):>12}" for s in STAT_KEYS) + f"{n:>10}")
    lines.append("=" * 72)
    return "\n".join(lines)


def _strict_json(obj: Any) -> Any:
    """`obj` with non-finite floats as strings ("inf"): strict JSON readers reject Infinity."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict_json(v) for v in obj]
    return obj


def write_result(path: str, result: dict[str, Any]) -> None:
    """Append `result` as one JSON line to `path` (created if missing); non-finite floats
    (`--request-rate inf`) are written as strings."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(_strict_json(result), sort_keys=True, allow_nan=False) + "\n")


def plot_distributions(path: str, records: list[RequestRecord], title: str) -> None:
    """Save histograms of TTFT and ITL (ms, successful requests) to `path` (a PNG).
    Needs matplotlib (the `bench` extra); rendered off-screen (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.success]
    ttfts = [t for r in ok if (t := r.ttft_ms) is not None]
    itls = [x for r in ok for x in r.itl_ms()]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, values, name in ((axes[0], ttfts, "TTFT"), (axes[1], itls, "ITL")):
        if values:
            ax.hist(values, bins=min(40, max(5, len(values) // 4)), color="#4878a8", edgecolor="white")
            for q, style in ((50, "-"), (99, "--")):
                v = float(np.percentile(values, q))
                ax.axvline(v, color="#c44e52", linestyle=style, label=f"p{q} {v:.1f} ms")
            ax.legend()
        ax.set_title(f"{name} ({len(values)} samples)")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("count")
    fig.suptitle(title)
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cached(m: dict) -> str:
    """Prompt tokens the server reported as prefix-cache hits, and their share of the input."""
    cached = m.get("total_cached_tokens")
    if cached is None:
        return "not reported"
    share = cached / m["total_input_tokens"] if m["total_input_tokens"] else 0.0
    return f"{cached} ({share:.1%} of input)"
