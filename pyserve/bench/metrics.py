"""Latency and throughput figures of one benchmark run, computed from per-request timestamps.

Definitions (all latencies in milliseconds, times from `time.perf_counter()` in seconds):

* A request is sent at `start_s` and its response ends (stream closed) at `end_s`.
* Its stream is a list of chunks; chunk i arrives at `chunk_times_s[i]` carrying
  `chunk_num_tokens[i]` >= 1 new output tokens. Chunks that carry no token (an OpenAI chat
  role-only chunk, a finish_reason-only chunk, a usage chunk) are not recorded.
* TTFT = first chunk time - start_s.
* ITL samples: every chunk i >= 1 (after the first) contributes `chunk_num_tokens[i]` samples,
  each equal to (chunk_times_s[i] - chunk_times_s[i - 1]) / chunk_num_tokens[i]: the gap is
  spread evenly over the tokens that arrived together. Extra tokens of the first chunk belong
  to TTFT and give no ITL sample. A one-token-per-chunk stream gives the usual chunk gaps.
* TPOT = (E2E - TTFT) / (output_len - 1), for requests with output_len >= 2.
* E2E = end_s - start_s.
* Duration = last end_s - the benchmark's start (the moment the first request could be sent).
* Throughputs divide successful requests / their input tokens / their output tokens by the
  duration; mean concurrency = sum of E2E over all requests (failed ones too, they held a
  connection) / duration (Little's law).

Latency statistics are over successful requests; percentiles use numpy's default (linear
interpolation between closest ranks).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (90, 99)


@dataclass
class RequestRecord:
    """What the client saw of one request.

    prompt_len: input tokens (see the run's token count source).
    output_len: output tokens counted for the request; 0 when it failed.
    error: None on success, else an error kind ("http_400", "connection", "timeout",
      "stream_error", "bad_response").
    """

    prompt_len: int
    start_s: float
    end_s: float
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_num_tokens: list[int] = field(default_factory=list)
    output_len: int = 0
    error: str | None = None
    error_detail: str = ""
    cached_len: int | None = None  # prompt tokens served from the prefix cache, if reported

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def e2e_ms(self) -> float:
        return (self.end_s - self.start_s) * 1000.0

    @property
    def ttft_ms(self) -> float | None:
        if not self.chunk_times_s:
            return None
        return (self.chunk_times_s[0] - self.start_s) * 1000.0

    def itl_ms(self) -> list[float]:
        """The request's ITL samples (see the module docstring)."""
        out: list[float] = []
        for i in range(1, len(self.chunk_times_s)):
            n = self.chunk_num_tokens[i]
            if n <= 0:
                continue
            gap_ms = (self.chunk_times_s[i] - self.chunk_times_s[i - 1]) * 1000.0
            out.extend([gap_ms / n] * n)
        return out

    @property
    def tpot_ms(self) -> float | None:
        ttft = self.ttft_ms
        if ttft is None or self.output_len < 2:
            return None
        return (self.e2e_ms - ttft) / (self.output_len - 1)


def latency_stats(values_ms: list[float]) -> dict[str, float | None]:
    """{"mean", "median", "p90", "p99", "max"} of `values_ms`; all None when empty."""
    keys = ["mean", "median"] + [f"p{p}" for p in PERCENTILES] + ["max"]
    if not values_ms:
        return {k: None for k in keys}
    arr = np.asarray(values_ms, dtype=np.float64)
    out: dict[str, float | None] = {"mean": float(arr.mean()), "median": float(np.median(arr))}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(arr, p))
    out["max"] = float(arr.max())
    return out


def compute_metrics(records: list[RequestRecord], bench_start_s: float) -> dict[str, Any]:
    """All figures of a run as a JSON-able dict (see the module docstring for definitions).

    records: every timed request (warm-up requests excluded), in any order.
    bench_start_s: perf_counter time the run started.
    """
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    end_s = max((r.end_s for r in records), default=bench_start_s)
    duration_s = end_s - bench_start_s
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)

    def per_s(x: float) -> float | None:
        return x / duration_s if duration_s > 0 else None

    ttfts = [t for r in ok if (t := r.ttft_ms) is not None]
    tpots = [t for r in ok if (t := r.tpot_ms) is not None]
    itls = [x for r in ok for x in r.itl_ms()]
    # the server's prefix-cache hits, when every successful request reported them
    cached = sum(r.cached_len or 0 for r in ok) if ok and all(r.cached_len is not None for r in ok) else None
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "errors": dict(sorted(Counter(r.error for r in failed).items())),
        "duration_s": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "total_cached_tokens": cached,
        "request_throughput": per_s(len(ok)),
        "input_throughput": per_s(total_input),
        "output_throughput": per_s(total_output),
        "total_token_throughput": per_s(total_input + total_output),
        "mean_concurrency": per_s(sum(r.end_s - r.start_s for r in records)),
        "ttft_ms": latency_stats(ttfts),
        "itl_ms": latency_stats(itls),
        "tpot_ms": latency_stats(tpots),
        "e2e_ms": latency_stats([r.e2e_ms for r in ok]),
        "num_itl_samples": len(itls),
    }
