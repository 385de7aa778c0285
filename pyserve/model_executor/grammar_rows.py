"""`GrammarRows`: the grammar matchers of the requests under a grammar (structured output) and
their token bitmask, kept by the worker by request row (DESIGN.md sections 1 and 7).

A row's matcher (made by the compiled grammar its sampling row brings: xgrammar's or
llguidance's, whichever backend the server runs) follows the request's output: after step N's
ids are sampled it accepts each grammar row's new token; before step N+1 is sampled it fills
the row's next allowed-token bitmask (int32, one bit a token, the same layout in both
libraries), which the sampler applies as one more logit processor. A thinking block before the
answer is part of the grammar itself. On CUDA, step N's ids reach the host by the worker's
asynchronous copy: the matchers take them only when step N+1 is about to be sampled, after its
forward was launched, so only sampling waits for them. A batch with no grammar row costs
nothing here. Worker thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pyserve.device_copy import to_device
from pyserve.forward_batch_info import SamplingBatchInfo, SamplingRow

logger = logging.getLogger(__name__)


class _Row:
    """One request's grammar state: its matcher, and the backend's matcher operations (`ops`,
    shared by the rows of one backend). `done` once the grammar ended (its stop token
    accepted) or refused a token (the request then fails or ended already): nothing is masked
    after that."""

    __slots__ = ("matcher", "ops", "stop_ids", "done")

    def __init__(self, compiled: Any, ops: Any) -> None:
        self.matcher = compiled.new_matcher()
        self.ops = ops
        self.stop_ids = frozenset(self.matcher.stop_token_ids)
        self.done = False

    def accept(self, token: int) -> None:
        if not self.done:
            self.after_accept(token, self.matcher.accept_token(token))

    def after_accept(self, token: int, accepted: bool) -> None:
        """Note the matcher's verdict on `token`: a refusal or a stop token that ended the
        grammar (only a stop token can end it: the others need no check) makes the row done."""
        if not accepted:
            logger.debug("a grammar refused token %d (its row had no token left to sample)", token)
            self.done = True
        elif token in self.stop_ids and self.matcher.is_terminated():
            self.done = True


class GrammarRows:
    """Grammar state of `num_rows` request rows over a vocabulary of `vocab_size`, masks for
    `device`.

    bitmask: [num_rows, ceil(vocab_size / 32)] int32 on the host (pinned on CUDA), made on
    first use; row r holds request row r's latest allowed-token mask. num_live: rows with a
    grammar (the idle leak check reads it from the loop thread: a plain int).
    """

    def __init__(self, num_rows: int, vocab_size: int, device: str) -> None:
        self.num_rows = num_rows
        self.vocab_size = vocab_size
        self.width = (vocab_size + 31) // 32
        self.device = device
        self.has_grammar = np.zeros(num_rows, dtype=bool)
        self.rows: dict[int, _Row] = {}
        self.bitmask: torch.Tensor | None = None
        # each backend's matcher operations (by the compiled grammar's type), made on first use
        self._ops: dict[type, Any] = {}
        # the rows (and their batch positions) whose matchers take the step's sampled ids
        self._to_record: list[tuple[int, _Row]] = []
        # rows and the ids they still have to accept, with the wait for those ids' copy (CUDA)
        self._pending: tuple[list[tuple[int, _Row]], np.ndarray, Callable[[], None] | None] | None = None

    @property
    def num_live(self) -> int:
        return len(self.rows)

    # ---- row lifetime ----------------------------------------------------------------------
    def set_rows(self, new_rows: list[SamplingRow]) -> None:
        """Start the matchers of newly admitted requests with a grammar; a resumed request's
        matcher replays its output so far."""
        for item in new_rows:
            if item.grammar is None:
                continue
            ops = self._ops.get(type(item.grammar))
            if ops is None:
                ops = self._ops[type(item.grammar)] = item.grammar.new_ops()
            row = _Row(item.grammar, ops)
            for token in item.output_ids if item.output_ids is not None else ():
                row.accept(int(token))
            self.rows[item.req_pool_idx] = row
            self.has_grammar[item.req_pool_idx] = True

    def release_rows(self, rows: list[int]) -> None:
        """Forget the grammars of `rows` (ids still pending for them go to the dropped state
        objects, never to a request that takes the row next)."""
        if not self.rows:
            return
        for r in rows:
            if self.rows.pop(r, None) is not None:
                self.has_grammar[r] = False

    # ---- per step --------------------------------------------------------------------------
    def prepare(self, info: SamplingBatchInfo, rows_np: np.ndarray) -> None:
        """Before the batch (request i in row rows_np[i], host int32 [B]) is sampled: the
        matchers take the previous step's ids, then the masks of the batch's constrained rows
        go into info.grammar_bitmask / info.grammar_rows (left None when no row is
        constrained). Remembers which rows take this step's ids (`record`)."""
        self._resolve_pending()
        self._to_record = []
        if not self.rows:
            return
        positions = np.flatnonzero(self.has_grammar[rows_np])
        if positions.shape[0] == 0:
            return
        batch_rows = [(int(p), self.rows[int(rows_np[p])]) for p in positions]
        self._to_record = [(p, row) for p, row in batch_rows if not row.done]
        active = [(p, int(rows_np[p]), row) for p, row in self._to_record]
        if not active:
            return
        bitmask = self._bitmask()
        for ops, group in _by_ops([(row, r) for _, r, row in active]):
            ops.fill([row.matcher for row, _ in group], bitmask, [r for _, r in group])
        picked = bitmask[torch.tensor([r for _, r, _ in active], dtype=torch.int64)]
        info.grammar_bitmask = picked.to(self.device, non_blocking=True) if self.device != "cpu" else picked
        info.grammar_rows = to_device(np.array([p for p, _, _ in active], dtype=np.int32), torch.int32, self.device)

    def record(self, ids: np.ndarray, wait: Callable[[], None] | None = None) -> None:
        """After sampling: the rows noted by `prepare` take their new ids (ids: host int32
        [B], the step's sampled ids). With `wait` (CUDA: ids lands once it returns) they are
        taken at the next `prepare` or `flush`; else at once."""
        if not self._to_record:
            return
        self._pending = (self._to_record, ids, wait)
        self._to_record = []
        if wait is None:
            self._resolve_pending()

    def flush(self) -> None:
        """Take any pending ids now (before the worker idles)."""
        self._resolve_pending()

    def _resolve_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        rows, ids, wait = pending
        if wait is not None:
            wait()
        # the rows' matchers take their tokens in one call per backend
        batch = [(row, int(ids[position])) for position, row in rows if not row.done]
        for ops, group in _by_ops(batch):
            accepted = ops.accept([row.matcher for row, _ in group], [t for _, t in group])
            for (row, token), ok in zip(group, accepted):
                row.after_accept(token, ok)

    def _bitmask(self) -> torch.Tensor:
        if self.bitmask is None:
            self.bitmask = torch.full(
                (self.num_rows, self.width), -1, dtype=torch.int32, pin_memory=self.device.startswith("cuda")
            )
        return self.bitmask


def _by_ops(items: list[tuple[_Row, int]]) -> list[tuple[Any, list[tuple[_Row, int]]]]:
    """`items` (row, int) grouped by their rows' backend operations, in order (one group
    where the server runs one backend)."""
    groups: dict[int, tuple[Any, list[tuple[_Row, int]]]] = {}
    for row, value in items:
        entry = groups.get(id(row.ops))
        if entry is None:
            entry = groups[id(row.ops)] = (row.ops, [])
        entry[1].append((row, value))
    return list(groups.values())
