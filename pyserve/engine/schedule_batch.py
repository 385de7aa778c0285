"""`Req` (one request's scheduling state) and `ScheduleBatch` (the requests of one step).

Loop thread only. A ScheduleBatch turns into the device-side `ForwardBatch` through
`to_forward_batch`, from the flat arrays the Rust core returned for the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pyserve.io_struct import LogprobParams
from pyserve.mem_cache.kv_cache import BatchArrays
from pyserve.model_executor.forward_batch import (
    ForwardBatch,
    ForwardMode,
    LogprobBatchInfo,
    SamplingBatchInfo,
)
from pyserve.sampling_params import SamplingParams


class Req:
    """A request inside the scheduler.

    origin_input_ids: the prompt. output_ids: tokens generated so far.
    req_id: the Rust core's handle while admitted (None while waiting).
    kv_len: tokens whose K/V is stored in the request's row (prompt + all outputs but the last
        once decoding). prefix_len: tokens of the cached prefix reused at admission (whole
        pages; their KV is not recomputed).
    max_new_tokens: already clipped so that prompt + output fits the context.
    logprob: what logprobs it wants; input_logprobs_done once its prompt logprobs were sent.
    """

    def __init__(self, rid: str, input_ids: list[int], sampling_params: SamplingParams,
                 max_new_tokens: int, stop_token_ids: frozenset[int],
                 logprob: LogprobParams | None = None) -> None:
        self.rid = rid
        self.origin_input_ids = input_ids
        self.sampling_params = sampling_params
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = stop_token_ids
        self.output_ids: list[int] = []
        self.req_id: int | None = None
        self.prefix_len = 0
        self.kv_len = 0
        self.cached_tokens = 0
        self.finish_reason: dict[str, Any] | None = None
        self.num_retractions = 0
        self.logprob = logprob or LogprobParams()
        self.input_logprobs_done = False
        self._seen_ids: set[int] | None = None  # prompt + output ids, for repetition_penalty
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling_params.seed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def remaining_new_tokens(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    def fill_ids(self) -> list[int]:
        """Prompt plus output so far: what a (re-)admitted request prefills."""
        return self.origin_input_ids + self.output_ids

    @property
    def wants_input_logprobs(self) -> bool:
        lp = self.logprob
        return (lp.return_logprob and lp.logprob_start_len is not None and not self.input_logprobs_done
                and lp.logprob_start_len < len(self.origin_input_ids))

    def max_prefix_len(self) -> int:
        """Longest cached prefix this request may reuse: all but the last token, and no token
        whose logprob must be computed (the token before logprob_start_len is recomputed)."""
        limit = len(self.fill_ids()) - 1
        if self.wants_input_logprobs:
            limit = min(limit, max(self.logprob.logprob_start_len - 1, 0))  # type: ignore[operator]
        return limit

    def seen_ids(self) -> set[int]:
        """Distinct prompt and output ids (kept incrementally once asked for)."""
        if self._seen_ids is None:
            self._seen_ids = set(self.origin_input_ids)
            self._num_seen_outputs = 0
        if self._num_seen_outputs < len(self.output_ids):
            self._seen_ids.update(self.output_ids[self._num_seen_outputs:])
            self._num_seen_outputs = len(self.output_ids)
        return self._seen_ids

    def kv_token_ids(self) -> list[int]:
        """The tokens whose K/V is stored, in order (what the radix cache may keep)."""
        return self.fill_ids()[: self.kv_len]

    def check_finished(self) -> None:
        """Set finish_reason after a new token was appended (EOS/stop ids, then length)."""
        if self.finished or not self.output_ids:
            return
        last = self.output_ids[-1]
        if last in self.stop_token_ids:
            self.finish_reason = {"type": "stop", "matched": last}
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = {"type": "length", "length": self.max_new_tokens}


@dataclass
class ScheduleBatch:
    """The requests of one step and the arrays the Rust core built for it."""

    forward_mode: ForwardMode
    reqs: list[Req]
    input_ids: list[int]
    arrays: BatchArrays  # per-request lengths too: prefix_lens, extend_lens, seq_lens

    @property
    def seq_lens(self) -> list[int]:
        return self.arrays.seq_lens.tolist()

    def to_forward_batch(self, device: str) -> ForwardBatch:
        """Tensors for the worker. numpy arrays become tensors without a copy on CPU."""
        def t(x: Any, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            tensor = torch.as_tensor(x, dtype=dtype)
            return tensor.to(device, non_blocking=True) if device != "cpu" else tensor

        extend = self.forward_mode is ForwardMode.EXTEND
        return ForwardBatch(
            forward_mode=self.forward_mode,
            batch_size=len(self.reqs),
            input_ids=t(self.input_ids),
            positions=t(self.arrays.positions),
            out_cache_loc=t(self.arrays.out_cache_loc),
            seq_lens=t(self.arrays.seq_lens),
            kv_indptr=t(self.arrays.kv_indptr),
            kv_indices=t(self.arrays.kv_indices, torch.int32),
            extend_prefix_lens=t(self.arrays.prefix_lens) if extend else None,
            extend_seq_lens=t(self.arrays.extend_lens) if extend else None,
            sampling_info=sampling_batch_info(self.reqs, device),
            logprob_info=self._logprob_info(),
        )

    def _logprob_info(self) -> LogprobBatchInfo | None:
        reqs = self.reqs
        if not any(r.logprob.return_logprob for r in reqs):
            return None
        starts: list[int | None] = [None] * len(reqs)
        if self.forward_mode is ForwardMode.EXTEND:
            for i, r in enumerate(reqs):
                if r.wants_input_logprobs:
                    starts[i] = r.logprob.logprob_start_len - r.prefix_len  # type: ignore[operator]
        return LogprobBatchInfo(
            return_logprob=[r.logprob.return_logprob for r in reqs],
            top_logprobs_nums=[r.logprob.top_logprobs_num if r.logprob.return_logprob else 0 for r in reqs],
            token_ids_logprob=[r.logprob.token_ids_logprob if r.logprob.return_logprob else None
                               for r in reqs],
            input_logprob_starts=starts,
        )


def sampling_batch_info(reqs: list[Req], device: str) -> SamplingBatchInfo:
    """The SamplingBatchInfo of `reqs` (row i = reqs[i]). Optional parts are built only when
    some request uses them; penalties cost O(its output length) (frequency/presence) or
    O(distinct seen ids) (repetition) host work per step and request."""
    def f32(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    def i64(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    params = [r.sampling_params for r in reqs]
    all_tokens = 1 << 30  # top_k at or above the vocabulary size keeps every token
    info = SamplingBatchInfo(
        temperatures=f32([0.0 if p.is_greedy else p.temperature for p in params]),
        top_ps=f32([p.top_p for p in params]),
        top_ks=i64([min(p.top_k, all_tokens) if p.top_k > 0 else all_tokens for p in params]),
        generators=[r.generator for r in reqs],
    )
    if any(p.min_p > 0 for p in params):
        info.min_ps = f32([p.min_p for p in params])
    if any(p.has_penalties for p in params):
        info.frequency_penalties = f32([p.frequency_penalty for p in params])
        info.presence_penalties = f32([p.presence_penalty for p in params])
        rows = [i for i, r in enumerate(reqs) if r.sampling_params.has_penalties for _ in r.output_ids]
        ids = [t for r in reqs if r.sampling_params.has_penalties for t in r.output_ids]
        info.output_token_rows, info.output_token_ids = i64(rows), i64(ids)
    if any(p.repetition_penalty != 1.0 for p in params):
        info.repetition_penalties = f32([p.repetition_penalty for p in params])
        seen = [(i, r.seen_ids()) for i, r in enumerate(reqs) if r.sampling_params.repetition_penalty != 1.0]
        info.seen_token_rows = i64([i for i, ids in seen for _ in ids])
        info.seen_token_ids = i64([t for _, ids in seen for t in ids])
    if any(p.logit_bias for p in params):
        items = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias_items]
        info.logit_bias_rows = i64([i for i, _, _ in items])
        info.logit_bias_ids = i64([t for _, t, _ in items])
        info.logit_bias_values = f32([b for _, _, b in items])
    banned = [(i, t) for i, r in enumerate(reqs)
              if len(r.output_ids) < r.sampling_params.min_new_tokens for t in sorted(r.stop_token_ids)]
    if banned:
        info.banned_rows = i64([i for i, _ in banned])
        info.banned_ids = i64([t for _, t in banned])
    return info
