"""`DeviceState`: the per-request state the worker keeps on its device between steps, and the
turning of a host-only `StepPlan` into a `ForwardBatch` (DESIGN.md section 1).

It holds the req_to_token table (each request row's KV slots, in position order), the token
table (each row's last sampled token: the input of its next decode step, so decode inputs
never round-trip through the host) and the sampling rows (`SamplingRows`). A decode plan adds
one slot per request to the table; an extend plan writes its requests' rows once. A decode
batch's `kv_indptr` / `kv_indices` are gathered from the table on the device only when its
attention backend asks (`ForwardBatch.ensure_kv_indices`). Worker thread only.
"""

from __future__ import annotations

import numpy as np
import torch

from pyserve.device_copy import to_device
from pyserve.forward_batch_info import ForwardBatch, ForwardMode, StepPlan
from pyserve.model_executor.grammar_rows import GrammarRows
from pyserve.model_executor.sampling_rows import SamplingRows


class DeviceState:
    """State of `num_rows` request rows of up to `row_width` tokens each, on `device`.

    req_to_token: [num_rows, row_width] int32 KV slots (0 where unused: the padding slot).
    token_table:  [num_rows] int32 last sampled token of each row.
    sampling:     SamplingRows of the same rows.
    grammar:      GrammarRows of the same rows (the matchers of requests with a grammar).
    Every index array of a step is int32, from the Rust core through the plan to these
    tables: num_rows * row_width stays below 2^31 (ValueError otherwise, as in the Rust
    core), so rows, positions and flat offsets into req_to_token fit.
    """

    def __init__(self, num_rows: int, row_width: int, vocab_size: int, device: str) -> None:
        if num_rows * row_width > _INT32_MAX:
            raise ValueError(
                f"a request table of {num_rows} rows x {row_width} tokens exceeds {_INT32_MAX} cells (int32 offsets)"
            )
        self.device = device
        self.req_to_token = torch.zeros(num_rows, row_width, dtype=torch.int32, device=device)
        self._req_to_token_flat = self.req_to_token.view(-1)  # the same memory, indexed flat
        self.token_table = torch.zeros(num_rows, dtype=torch.int32, device=device)
        self.sampling = SamplingRows(num_rows, vocab_size, device)
        self.grammar = GrammarRows(num_rows, vocab_size, device)

    def release_rows(self, rows: list[int]) -> None:
        """Drop the sampling and grammar state of requests that left."""
        self.sampling.release_rows(rows)
        self.grammar.release_rows(rows)

    def forward_batch(self, plan: StepPlan) -> ForwardBatch:
        """Apply `plan` to the tables (row releases and starts, new slots) and return the
        step's ForwardBatch. Raises ValueError when an EXTEND plan's arrays disagree or a
        request would not fit its row, TypeError when a plan array is not int32.

        The plan's integer arrays (all int32) reach the device as one packed int32 copy
        (`_pack`), and stay int32 there: nothing is converted on the way. The index arithmetic
        is done on the host in numpy, where the arrays already are, so the device gets its
        inputs in one transfer and few calls (each torch call costs the worker a GIL release
        and re-acquire; on CUDA each copy a pinned staging buffer). Tables are written with
        index_put_ (`t[idx] = v`), which takes int32 indices; index_copy_ would need int64."""
        # the requests that left are gone whether or not this plan holds: a refused plan must
        # not keep their sampling rows live (a later request on the row could not start)
        self.release_rows(plan.released_rows)
        batch_size = plan.batch_size
        row_width = self.req_to_token.shape[1]
        if batch_size and int(plan.seq_lens.max()) > row_width:  # the flat index would spill
            raise ValueError(f"a request's {int(plan.seq_lens.max())} tokens exceed its row of {row_width}")
        self.sampling.set_rows(plan.new_sampling_rows)
        self.grammar.set_rows(plan.new_sampling_rows)
        extend = plan.forward_mode is ForwardMode.EXTEND
        rows_np = plan.req_pool_indices
        parts = [rows_np, plan.seq_lens, plan.positions, plan.out_cache_loc]
        if extend:
            assert plan.input_ids is not None and plan.row_slots is not None
            assert plan.prefix_lens is not None and plan.extend_lens is not None
            total = int(plan.row_slots.shape[0])
            if total != int(plan.seq_lens.sum()):
                raise ValueError("row_slots does not hold seq_lens slots")
            indptr = np.zeros(batch_size + 1, dtype=np.int32)
            np.cumsum(plan.seq_lens, dtype=np.int32, out=indptr[1:])
            # each row's entries, flat in req_to_token: row * width + column, column counted
            # from the row's start in row_slots (below num_rows * width: int32)
            flat = np.repeat(rows_np * np.int32(row_width) - indptr[:-1], plan.seq_lens) + np.arange(
                total, dtype=np.int32
            )
            parts += [indptr, plan.prefix_lens, plan.extend_lens, plan.input_ids, plan.row_slots, flat]
            max_extend_len: int | None = int(plan.extend_lens.max()) if batch_size else 0
        views = _unpack(to_device(_pack(parts), torch.int32, self.device), parts)
        rows, seq_lens, positions, out_cache_loc = views[:4]
        kv_indptr = kv_indices = prefix_lens = extend_lens = None
        if extend:
            kv_indptr, prefix_lens, extend_lens, input_ids, kv_indices, flat_t = views[4:]
            self._req_to_token_flat[flat_t] = kv_indices
            if plan.num_decode_rows:  # a mixed chunk: the decoding rows' inputs are on the device
                decode_rows = rows[batch_size - plan.num_decode_rows :]
                input_ids = torch.cat([input_ids, self.token_table.index_select(0, decode_rows)])
        else:
            max_extend_len = None
            self.req_to_token[rows, positions] = out_cache_loc
            input_ids = self.token_table.index_select(0, rows)  # kv_indices: gathered if a backend asks
        return ForwardBatch(
            forward_mode=plan.forward_mode,
            batch_size=batch_size,
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            seq_lens=seq_lens,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            extend_prefix_lens=prefix_lens,
            extend_seq_lens=extend_lens,
            sampling_info=self.sampling.batch_info(plan.req_pool_indices, rows, plan.all_greedy),
            logprob_info=plan.logprob_info,
            req_pool_indices=rows,
            req_to_token=self.req_to_token,
            max_extend_len=max_extend_len,
        )

    def record_sampled(self, plan: StepPlan, batch: ForwardBatch, next_ids: torch.Tensor) -> torch.Tensor:
        """After sampling: each row's new token goes to the token table (the next decode's
        input) and into its penalty counts. next_ids: [B] int64 on the device (what torch's
        sampling ops return). Returns the ids as [B] int32 on the device: the one conversion
        of a step's ids, which the worker also copies to the host."""
        rows = batch.req_pool_indices
        assert rows is not None
        ids = next_ids.to(torch.int32)
        self.token_table[rows] = ids
        self.sampling.record_sampled(plan.req_pool_indices, rows, next_ids)
        return ids


_INT32_MAX = 2**31 - 1


def _pack(parts: list[np.ndarray]) -> np.ndarray:
    """The 1-D int32 arrays `parts`, end to end, as one int32 host array. TypeError for a
    part of another dtype: the plan's arrays are int32 from the Rust core on, and a silent
    cast here would hide a conversion (or a wrap) upstream."""
    for p in parts:
        if p.dtype != np.int32:
            raise TypeError(f"plan arrays must be int32, got {p.dtype}")
    return np.concatenate(parts)


def _unpack(packed: torch.Tensor, parts: list[np.ndarray]) -> tuple[torch.Tensor, ...]:
    """Views of `packed` (on the device) with the lengths of `parts`, in order."""
    return packed.split_with_sizes([p.shape[0] for p in parts])
