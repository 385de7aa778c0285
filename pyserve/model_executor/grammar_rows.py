"""`GrammarRows`: the grammar matchers of the requests under a grammar (structured output) and
their token bitmask, kept by the worker by request row (DESIGN.md sections 1 and 7).

A row's matcher (xgrammar's `GrammarMatcher`, made from the compiled grammar its sampling row
brings) follows the request's output: after step N's ids are sampled it accepts each grammar
row's new token; before step N+1 is sampled it fills the row's next allowed-token bitmask,
which the sampler applies as one more logit processor. On CUDA, step N's ids reach the host
by the worker's asynchronous copy: the matchers take them only when step N+1 is about to be
sampled, after its forward was launched, so only sampling waits for them. A batch with no
grammar row costs nothing here. Worker thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import xgrammar as xgr

from pyserve.device_copy import to_device
from pyserve.forward_batch_info import SamplingBatchInfo, SamplingRow

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Row:
    """One request's grammar state. `matcher` is None while the grammar waits for
    `start_ids` at the end of the output (`tail` keeps the last ids seen meanwhile); `done`
    once the grammar ended (its stop token accepted) or refused a token (the request then
    fails or ended already): nothing is masked after that."""

    compiled: xgr.CompiledGrammar
    start_ids: tuple[int, ...] | None
    matcher: xgr.GrammarMatcher | None = None
    tail: list[int] = field(default_factory=list)
    done: bool = False

    stop_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.start_ids is None:
            self._start()

    def _start(self) -> None:
        self.matcher = xgr.GrammarMatcher(self.compiled)
        self.stop_ids = frozenset(self.matcher.stop_token_ids)

    def accept(self, token: int) -> None:
        if self.done:
            return
        if self.matcher is None:
            assert self.start_ids is not None
            tail = self.tail
            tail.append(token)
            n = len(self.start_ids)
            if len(tail) >= n and tuple(tail[-n:]) == self.start_ids:
                self._start()
                tail.clear()
            elif len(tail) > n:
                del tail[: len(tail) - n]
            return
        self.after_accept(token, self.matcher.accept_token(token))

    def after_accept(self, token: int, accepted: bool) -> None:
        """Note the matcher's verdict on `token`: a refusal or a stop token that ended the
        grammar (only a stop token can end it: the others need no check) makes the row done."""
        assert self.matcher is not None
        if not accepted:
            logger.debug("a grammar refused token %d (its row had no token left to sample)", token)
            self.done = True
        elif token in self.stop_ids and self.matcher.is_terminated():
            self.done = True

    @property
    def constraining(self) -> bool:
        return self.matcher is not None and not self.done


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
        self._batch_matcher: xgr.BatchGrammarMatcher | None = None
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
            row = _Row(item.grammar, item.grammar_start_ids)
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
        active = [(p, int(rows_np[p]), row.matcher) for p, row in batch_rows if row.constraining]
        if not active:
            return
        bitmask = self._bitmask()
        matchers = [m for _, _, m in active if m is not None]  # (constraining: all of them)
        indices = [r for _, r, _ in active]
        if len(active) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, indices[0])
        else:
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher()
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, indices)
        picked = bitmask[torch.tensor(indices, dtype=torch.int64)]
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
        # the constraining rows' matchers take their tokens in one call; the rest (done, or
        # waiting for their start ids) one by one
        batch: list[tuple[_Row, int]] = []
        for position, row in rows:
            token = int(ids[position])
            if row.constraining:
                batch.append((row, token))
            else:
                row.accept(token)
        if not batch:
            return
        matchers = [row.matcher for row, _ in batch if row.matcher is not None]
        accepted = xgr.BatchGrammarMatcher.batch_accept_token(matchers, [t for _, t in batch])
        for (row, token), ok in zip(batch, accepted):
            row.after_accept(token, ok)

    def _bitmask(self) -> torch.Tensor:
        if self.bitmask is None:
            self.bitmask = torch.full(
                (self.num_rows, self.width), -1, dtype=torch.int32, pin_memory=self.device.startswith("cuda")
            )
        return self.bitmask
