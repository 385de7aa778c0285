"""`SamplingRows`: every running request's sampling parameters, kept on the worker's device by
request row and updated incrementally (DESIGN.md sections 1 and 7).

A request's row is set once, when its admission plan arrives (`set_rows`), and dropped when a
later plan says the request left (`release_rows`). Each step gathers the batch's rows
(`batch_info`) and, after sampling, counts the new tokens (`record_sampled`). Nothing is
rebuilt from Python lists per step: dense per-row tensors hold temperature, top-p, top-k and
min-p; the penalties' token counts and seen-token masks are [num_rows, vocab] tensors made on
first use; logit biases, min_new_tokens bans and seeded generators are kept only for the rows
that have them. Worker thread only.
"""

from __future__ import annotations

import numpy as np
import torch

from pyserve.device_copy import to_device
from pyserve.forward_batch_info import SamplingBatchInfo, SamplingRow

# top_k at or above the vocabulary size keeps every token
ALL_TOKENS = 1 << 30

# the rows of SamplingRows.dense and each one's value for a row without it (no effect)
_TEMPERATURE, _TOP_P, _MIN_P, _FREQUENCY, _PRESENCE, _REPETITION = range(6)
_DEFAULTS = (0.0, 1.0, 0.0, 0.0, 0.0, 1.0)


class SamplingRows:
    """Sampling state of `num_rows` request rows for a vocabulary of `vocab_size` on `device`.

    Dense state: dense [6, num_rows] float32, one row per field (temperature (0 = greedy),
    top_p, min_p, frequency, presence and repetition penalty, in the order of the _FIELD
    constants); top_ks [num_rows] int64. Host flags per row (numpy) say which optional parts
    a row uses. num_live: rows set and not yet released (the idle leak check
    reads it from the loop thread: a plain int).
    """

    def __init__(self, num_rows: int, vocab_size: int, device: str) -> None:
        self.num_rows = num_rows
        self.vocab_size = vocab_size
        self.device = device
        # the float fields of every row in one tensor, a field per row of it, so starting
        # rows and gathering a batch are one indexing call each (every torch call costs the
        # worker a GIL release)
        self.dense = torch.tensor(_DEFAULTS, dtype=torch.float32, device=device)[:, None].repeat(1, num_rows)
        self.top_ks = torch.full((num_rows,), ALL_TOKENS, dtype=torch.int64, device=device)
        self.live = np.zeros(num_rows, dtype=bool)
        self.greedy = np.ones(num_rows, dtype=bool)  # host mirror of temperatures == 0
        self.uses_min_p = np.zeros(num_rows, dtype=bool)
        self.uses_counts = np.zeros(num_rows, dtype=bool)  # frequency or presence penalty
        self.uses_seen = np.zeros(num_rows, dtype=bool)  # repetition penalty
        # live rows using each optional part: a batch looks at its own rows' flags only when
        # some live row uses the part (usually none does: nothing is checked per step)
        self.num_min_p = self.num_counts = self.num_seen = 0
        self.num_sampled = np.zeros(num_rows, dtype=np.int64)  # kept for rows with a ban only
        self.min_new_tokens = np.zeros(num_rows, dtype=np.int64)
        self.output_counts: torch.Tensor | None = None  # [num_rows, vocab] float32
        self.seen_mask: torch.Tensor | None = None  # [num_rows, vocab] bool
        self.logit_bias: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.banned: dict[int, torch.Tensor] = {}  # stop ids, while below min_new_tokens
        self.generators: dict[int, torch.Generator] = {}
        self.num_live = 0

    # ---- row lifetime ----------------------------------------------------------------------
    def release_rows(self, rows: list[int]) -> None:
        """Forget the requests of `rows` (their rows may be set again later)."""
        for row in rows:
            if not self.live[row]:
                continue
            self.live[row] = False
            self.num_live -= 1
            self.logit_bias.pop(row, None)
            self.banned.pop(row, None)
            self.generators.pop(row, None)
            self.num_min_p -= int(self.uses_min_p[row])
            self.num_counts -= int(self.uses_counts[row])
            self.num_seen -= int(self.uses_seen[row])
            self.uses_min_p[row] = self.uses_counts[row] = self.uses_seen[row] = False

    def set_rows(self, new_rows: list[SamplingRow]) -> None:
        """Start the sampling rows of newly admitted requests: one write of the dense fields
        and one of top_k for all of them, then the optional parts of the requests that use them."""
        if not new_rows:
            return
        rows = [item.req_pool_idx for item in new_rows]
        if self.live[rows].any() or len(set(rows)) != len(rows):
            raise RuntimeError(f"sampling rows {rows} set while still live")
        self.live[rows] = True
        self.num_live += len(rows)
        params = [item.params for item in new_rows]
        # every field is written, the unused penalties too (0, 0 and 1 are no penalty): a batch
        # gathers every row's penalties once any row uses them, and a reused row must not
        # keep its previous request's values
        dense = np.array(
            [
                (
                    0.0 if p.is_greedy else p.temperature,
                    p.top_p,
                    p.min_p,
                    p.frequency_penalty,
                    p.presence_penalty,
                    p.repetition_penalty,
                )
                for p in params
            ],
            dtype=np.float32,
        )
        rows_t = to_device(np.array(rows, dtype=np.int64), torch.int64, self.device)
        self.dense.index_copy_(1, rows_t, to_device(np.ascontiguousarray(dense.T), torch.float32, self.device))
        self.top_ks.index_copy_(
            0,
            rows_t,
            to_device(
                np.array([min(p.top_k, ALL_TOKENS) if p.top_k > 0 else ALL_TOKENS for p in params], dtype=np.int64),
                torch.int64,
                self.device,
            ),
        )
        uses_min_p = dense[:, _MIN_P] > 0
        self.uses_min_p[rows] = uses_min_p
        self.num_min_p += int(uses_min_p.sum())
        self.greedy[rows] = [p.is_greedy for p in params]
        self.num_sampled[rows] = [item.num_sampled for item in new_rows]
        self.min_new_tokens[rows] = [p.min_new_tokens for p in params]
        for item in new_rows:
            row, p = item.req_pool_idx, item.params
            if p.min_new_tokens > item.num_sampled and item.stop_token_ids:
                self.banned[row] = to_device(sorted(item.stop_token_ids), torch.int64, self.device)
            if item.generator is not None:
                self.generators[row] = item.generator
            if p.logit_bias:
                ids, values = zip(*p.logit_bias_items)
                self.logit_bias[row] = (
                    to_device(list(ids), torch.int64, self.device),
                    to_device(list(values), torch.float32, self.device),
                )
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                self.uses_counts[row] = True
                self.num_counts += 1
                counts = self._counts()
                counts[row].zero_()
                if item.output_ids is not None and len(item.output_ids):
                    ids_t = to_device(np.asarray(item.output_ids), torch.int64, self.device)
                    counts[row].index_add_(0, ids_t, torch.ones(ids_t.shape[0], device=self.device))
            if p.repetition_penalty != 1.0:
                self.uses_seen[row] = True
                self.num_seen += 1
                seen = self._seen()
                seen[row].zero_()
                if item.seen_ids is not None and len(item.seen_ids):
                    seen[row, to_device(np.asarray(item.seen_ids), torch.int64, self.device)] = True

    def _counts(self) -> torch.Tensor:
        if self.output_counts is None:
            self.output_counts = torch.zeros(self.num_rows, self.vocab_size, dtype=torch.float32, device=self.device)
        return self.output_counts

    def _seen(self) -> torch.Tensor:
        if self.seen_mask is None:
            self.seen_mask = torch.zeros(self.num_rows, self.vocab_size, dtype=torch.bool, device=self.device)
        return self.seen_mask

    # ---- per step --------------------------------------------------------------------------
    def batch_info(self, rows_np: np.ndarray, rows: torch.Tensor, all_greedy: bool) -> SamplingBatchInfo:
        """The SamplingBatchInfo of a batch whose request i sits in row rows_np[i] (host
        int32 [B]; `rows`: the same as an int32 tensor on the device). greedy_rows (host)
        only when not all_greedy; the optional parts only when a row of the batch uses them."""
        dense = self.dense.index_select(1, rows)  # [fields, B]: each field's row is contiguous
        info = SamplingBatchInfo(
            temperatures=dense[_TEMPERATURE],
            top_ps=dense[_TOP_P],
            top_ks=self.top_ks.index_select(0, rows),
            all_greedy=all_greedy,
            greedy_rows=None if all_greedy else self.greedy[rows_np],
        )
        if self.generators:
            info.generators = [self.generators.get(int(r)) for r in rows_np]
        if self.num_min_p and self.uses_min_p[rows_np].any():
            info.min_ps = dense[_MIN_P]
        if self.num_counts and self.uses_counts[rows_np].any():
            info.frequency_penalties = dense[_FREQUENCY]
            info.presence_penalties = dense[_PRESENCE]
            info.output_token_counts = self._counts()[rows]
        if self.num_seen and self.uses_seen[rows_np].any():
            info.repetition_penalties = dense[_REPETITION]
            info.seen_token_mask = self._seen()[rows]
        if self.logit_bias:
            self._sparse(info, rows_np, self.logit_bias, bias=True)
        if self.banned:
            self._sparse(info, rows_np, self.banned, bias=False)
        return info

    def _sparse(self, info: SamplingBatchInfo, rows_np: np.ndarray, table: dict, bias: bool) -> None:
        picked = [(i, table[int(r)]) for i, r in enumerate(rows_np) if int(r) in table]
        if not picked:
            return
        ids = [entry[0] if bias else entry for _, entry in picked]
        batch_rows = torch.cat(
            [torch.full((t.shape[0],), i, dtype=torch.int64, device=self.device) for (i, _), t in zip(picked, ids)]
        )
        if bias:
            info.logit_bias_rows, info.logit_bias_ids = batch_rows, torch.cat(ids)
            info.logit_bias_values = torch.cat([entry[1] for _, entry in picked])
        else:
            info.banned_rows, info.banned_ids = batch_rows, torch.cat(ids)

    def record_sampled(self, rows_np: np.ndarray, rows: torch.Tensor, next_ids: torch.Tensor) -> None:
        """Count the batch's new tokens (next_ids [B] int64 on the device) into the rows'
        penalty state; lift min_new_tokens bans that are now met (the sampled count is
        kept only for rows with a ban: nothing else reads it)."""
        if self.num_counts or self.num_seen:
            use_counts = self.uses_counts[rows_np]
            use_seen = self.uses_seen[rows_np]
            if use_counts.any():
                sel = to_device(np.flatnonzero(use_counts), torch.int64, self.device)
                self._counts().index_put_(
                    (rows[sel], next_ids[sel]), torch.ones(sel.shape[0], device=self.device), accumulate=True
                )
            if use_seen.any():
                sel = to_device(np.flatnonzero(use_seen), torch.int64, self.device)
                self._seen()[rows[sel], next_ids[sel]] = True
        if self.banned:
            banned, num_sampled, min_new = self.banned, self.num_sampled, self.min_new_tokens
            for r in rows_np.tolist():
                if r in banned:
                    num_sampled[r] += 1
                    if num_sampled[r] >= min_new[r]:
                        del banned[r]
