"""`Req` (one request's scheduling state) and `ScheduleBatch` (the requests of one step).

Loop thread only. A ScheduleBatch turns into the device-side `ForwardBatch` through
`to_forward_batch`, from the flat arrays the Rust core returned for the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pyserve.mem_cache.kv_cache import BatchArrays
from pyserve.model_executor.forward_batch import ForwardBatch, ForwardMode, SamplingBatchInfo
from pyserve.sampling_params import SamplingParams


class Req:
    """A request inside the scheduler.

    origin_input_ids: the prompt. output_ids: tokens generated so far.
    req_id: the Rust core's handle while admitted (None while waiting).
    kv_len: tokens whose K/V is stored in the request's row (prompt + all outputs but the last
        once decoding). prefix_len: tokens of the cached prefix reused at admission (whole
        pages; their KV is not recomputed).
    max_new_tokens: already clipped so that prompt + output fits the context.
    """

    def __init__(self, rid: str, input_ids: list[int], sampling_params: SamplingParams,
                 max_new_tokens: int, stop_token_ids: frozenset[int]) -> None:
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
    arrays: BatchArrays
    seq_lens: list[int]
    extend_prefix_lens: list[int] | None = None
    extend_lens: list[int] | None = None

    def to_forward_batch(self, device: str) -> ForwardBatch:
        """Tensors for the worker. numpy arrays become tensors without a copy on CPU."""
        def t(x: Any) -> torch.Tensor:
            tensor = torch.as_tensor(x, dtype=torch.int64)
            return tensor.to(device, non_blocking=True) if device != "cpu" else tensor

        params = [r.sampling_params for r in self.reqs]
        all_tokens = 1 << 30  # top_k at or above the vocabulary size keeps every token
        sampling = SamplingBatchInfo(
            temperatures=torch.tensor([0.0 if p.is_greedy else p.temperature for p in params],
                                      dtype=torch.float32, device=device),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_ks=torch.tensor([min(p.top_k, all_tokens) if p.top_k > 0 else all_tokens for p in params],
                                dtype=torch.int64, device=device),
            generators=[r.generator for r in self.reqs],
        )
        return ForwardBatch(
            forward_mode=self.forward_mode,
            batch_size=len(self.reqs),
            input_ids=t(self.input_ids),
            positions=t(self.arrays.positions),
            out_cache_loc=t(self.arrays.out_cache_loc),
            seq_lens=t(self.seq_lens),
            kv_indptr=t(self.arrays.kv_indptr),
            kv_indices=t(self.arrays.kv_indices),
            extend_prefix_lens=None if self.extend_prefix_lens is None else t(self.extend_prefix_lens),
            extend_seq_lens=None if self.extend_lens is None else t(self.extend_lens),
            sampling_info=sampling,
        )
