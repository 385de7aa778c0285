"""`SchedulerConfig`: what the scheduler is built from, in one frozen object (the flags'
meanings: docs/flags.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyserve.config import ServerArgs


@dataclass(frozen=True)
class SchedulerConfig:
    """context_len: the model's context (tokens). max_running_requests: requests in a step
    at most. max_prefill_tokens: new tokens a prefill step takes at most.
    stats_interval_s: seconds between stats lines. overlap: plan step N+1 while step N runs.
    chunked_prefill_size: tokens per prompt chunk (None: whole prompts). enable_mixed_chunk:
    decode rows ride along with a prompt chunk. schedule_policy: "fcfs", "lpm", "dfs-weight",
    "lof" or "random" (schedule_policy.py); random_seed: its seed. enable_priority_scheduling,
    low_priority_values_first, preemption_threshold: priority order and preemption
    (retraction.py). schedule_conservativeness: scales SGLang's new-token ratio.
    grammar_compile_timeout_s: a grammar's compile limit (grammar_queue.py). device: the
    model's ("cpu", "cuda:0"...): seeded requests draw from a generator there."""

    context_len: int
    max_running_requests: int
    max_prefill_tokens: int
    stats_interval_s: float = 10.0
    overlap: bool = True
    chunked_prefill_size: int | None = None
    enable_mixed_chunk: bool = False
    schedule_policy: str = "fcfs"
    random_seed: int | None = None
    enable_priority_scheduling: bool = False
    low_priority_values_first: bool = False
    preemption_threshold: int = 10
    schedule_conservativeness: float = 1.0
    grammar_compile_timeout_s: float = 60.0
    device: str = "cpu"

    @classmethod
    def from_server_args(
        cls, args: ServerArgs, context_len: int, chunked_prefill_size: int | None, device: str
    ) -> SchedulerConfig:
        """The scheduler's part of the server's flags; `chunked_prefill_size` as resolved for
        the device (ServerArgs.resolved_chunked_prefill_size; None for an embedding model)."""
        return cls(
            context_len=context_len,
            max_running_requests=args.max_running_requests,
            max_prefill_tokens=args.max_prefill_tokens,
            stats_interval_s=args.stats_interval_s,
            overlap=not args.disable_overlap_schedule,
            chunked_prefill_size=chunked_prefill_size,
            enable_mixed_chunk=args.enable_mixed_chunk,
            schedule_policy=args.schedule_policy,
            random_seed=args.random_seed,
            enable_priority_scheduling=args.enable_priority_scheduling,
            low_priority_values_first=args.schedule_low_priority_values_first,
            preemption_threshold=args.priority_scheduling_preemption_threshold,
            schedule_conservativeness=args.schedule_conservativeness,
            grammar_compile_timeout_s=args.grammar_compile_timeout_s,
            device=device,
        )
