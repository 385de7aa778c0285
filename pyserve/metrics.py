"""`RequestMetrics`: what `/metrics` reports about requests, kept as plain numbers on the loop.

The scheduler records into it where each figure is known (DESIGN.md section 1): queue time
when a request's first prefill launches, time to first token and inter-token latency when a
step's tokens are processed, end-to-end latency and the token and request counts when the
request leaves the scheduler (`ScheduleState.forget`, once per request). Recording is a few
attribute updates and a bisect per token; the Prometheus text is made only when scraped
(pyserve/server/metrics.py), so the step path never touches prometheus-client's locks.
Times are `time.perf_counter()` seconds. Loop thread, except `Histogram` objects that a
caller guards itself (the grammar backend's compile times, on its executor threads).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Sequence, Sized
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # (importing the step types imports torch: the CLI's checks run without it)
    from pyserve.forward_batch_info import FinishReason

# Bucket upper bounds in seconds: SGLang's, so its dashboards read ours.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                15.0, 20.0, 25.0, 30.0)  # fmt: skip
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.0)  # fmt: skip
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 40.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
GRAMMAR_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class TimedRequest(Protocol):
    """What the figures read of a request (the scheduler's `Req` has these): perf_counter
    seconds at arrival, at entering the waiting queue and at its end (None while running)."""

    @property
    def arrival_time(self) -> float: ...
    @property
    def queue_start(self) -> float: ...
    @property
    def finish_time(self) -> float | None: ...
    @property
    def origin_input_ids(self) -> Sized: ...
    @property
    def cached_tokens(self) -> int: ...
    @property
    def finish_reason(self) -> FinishReason | None: ...


class Histogram:
    """Counts of observed values by bucket: counts[i] of the values v with
    bounds[i-1] < v <= bounds[i] (Prometheus' `le` rule), the last for v > bounds[-1]; `sum`
    of all of them. One writer at a time."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """Count `value` `times` times."""
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, how many values are <= le) for each bound and "+Inf": Prometheus' buckets."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        return out


class RequestMetrics:
    """Request figures since the engine started.

    ttft / itl / e2e_latency / queue_time: Histograms (seconds) of time to first token (from
    the request's arrival at the tokenizer manager to its first output token's processing),
    of the gaps between a request's consecutive output tokens, of arrival to the end, and of
    the wait from entering the waiting queue (after its grammar compiled) to the launch of
    its first prefill. prompt_tokens / cached_tokens: summed over ended requests (as their
    meta_info reports them). finished: ended requests by finish kind ("stop", "length",
    "abort")."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e_latency = Histogram(E2E_BUCKETS)
        self.queue_time = Histogram(QUEUE_BUCKETS)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}

    def first_prefill(self, req: TimedRequest, now: float) -> None:
        """`req`'s first prefill (or first prompt chunk) launches at `now`."""
        self.queue_time.observe(now - req.queue_start)

    def tokens_out(self, now: float, gaps: dict[float, int], firsts: Sequence[TimedRequest]) -> None:
        """A step's output tokens were processed at `now`: `firsts` got their first token,
        and gaps[t] requests whose previous token came at time t got their next."""
        for req in firsts:
            self.ttft.observe(now - req.arrival_time)
        itl = self.itl
        for last, times in gaps.items():
            itl.observe(now - last, times)

    def request_left(self, req: TimedRequest) -> None:
        """`req` ended and left the scheduler (called once per request)."""
        end = req.finish_time or time.perf_counter()
        self.e2e_latency.observe(end - req.arrival_time)
        self.prompt_tokens += len(req.origin_input_ids)
        self.cached_tokens += req.cached_tokens
        kind = req.finish_reason.kind.value if req.finish_reason is not None else "abort"
        self.finished[kind] += 1
