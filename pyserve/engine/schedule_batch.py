"""`Req` (one request's scheduling state) and `ScheduleBatch` (the requests of one step and the
host-only `StepPlan` the worker receives for it).

Loop thread only. A plan is built from the flat arrays the Rust core returns for the step
(`prepare_extend` / `prepare_decode`); the Rust core is the single source of every request's
stored-token count (`kv_len`), so nothing here recomputes it. A decode plan is O(batch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from pyserve.forward_batch_info import (
    FinishReason,
    ForwardMode,
    LogprobBatchInfo,
    SamplingRow,
    StepPlan,
)
from pyserve.io_struct import LogprobParams
from pyserve.mem_cache.kv_cache import Admission, BatchArrays
from pyserve.sampling_params import SamplingParams

# (attrgetters: the per-step passes over a batch's requests run in C)
_GREEDY = attrgetter("greedy")
_RETURN_LOGPROB = attrgetter("return_logprob")


def decodable(reqs: list[Req]) -> list[Req]:
    """The requests of `reqs` that the next decode step should include: running, not paused
    (a streaming client that is behind), and their planned tokens short of max_new_tokens (a
    length finish is known ahead, so it costs no extra step). One comprehension, no call per
    request: it runs over every running request each step."""
    return [r for r in reqs if r.finish_reason is None and r.num_planned < r.max_new_tokens and not r.paused]


class Req:
    """A request inside the scheduler.

    rid: the client's request id (a string, unique among running requests).
    admission: its hold on the KV core while admitted (the core's handle, its row, its stored
    prefix and chunk end: `pyserve.mem_cache.kv_cache.Admission`); None while it waits.
    origin_input_ids: the prompt, [n] int32 (made once, where it was tokenized; a list given
        here is converted). output_ids: tokens generated so far (processed results).
    max_new_tokens: already clipped so that prompt + output fits the context.
    num_planned: output tokens the steps launched so far will have produced (ahead of
        output_ids by the steps in flight); a request is not planned past max_new_tokens.
    num_inflight: launched steps holding it whose results are not processed yet; its KV and
        rows are released only at 0 (overlap: a request that finished may be in one more step).
    dropped_ids: tokens sampled after it finished (by a stop token, stop string or abort seen
        one step late); their inputs' KV was stored, so the radix cache may keep it.
    logprob: what logprobs it wants; input_logprobs_done once its prompt logprobs were sent.
    num_emitted / quiet: see TokenizedGenerateReq.quiet and step_pipeline.token_out.
    paused: its streaming client is behind (`Scheduler.pause_request`): no decode step takes
        it until the client catches up; it keeps its KV and row meanwhile.
    generator: the seeded torch.Generator (created here on `generator_device`, the model's:
        creating one launches nothing; used only by the worker, which then draws on the
        device without a host round trip), so a retracted request continues the same stream.
    """

    def __init__(
        self,
        rid: str,
        input_ids: np.ndarray | list[int],
        sampling_params: SamplingParams,
        max_new_tokens: int,
        stop_token_ids: frozenset[int],
        logprob: LogprobParams | None = None,
        generator_device: str = "cpu",
    ) -> None:
        self.rid = rid
        self.origin_input_ids = np.asarray(input_ids, dtype=np.int32)
        self.sampling_params = sampling_params
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = stop_token_ids
        self.output_ids: list[int] = []
        self.admission: Admission | None = None
        self.priority = 0  # priority scheduling: larger is more urgent (unless low-first)
        self._prefix_key: np.ndarray | None = None
        self._prefix_key_outputs = 0
        self.cached_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.num_retractions = 0
        self.num_planned = 0
        self.num_inflight = 0
        self.dropped_ids: list[int] = []
        self.num_emitted = 0  # output tokens handed to the detokenizer
        self.kv_invalid = False  # a step holding it failed: free its KV, never cache it
        self.quiet = False  # only the final output is wanted (TokenizedGenerateReq.quiet)
        self.paused = False
        self.logprob = logprob or LogprobParams()
        # read for every request of every step: plain attributes, not properties
        self.greedy = sampling_params.is_greedy
        self.return_logprob = self.logprob.return_logprob
        self.input_logprobs_done = False
        # the compiled grammar once the grammar queue has it
        self.grammar: Any = None
        self.generator: torch.Generator | None = None
        # perf_counter seconds, for /metrics (pyserve/metrics.py): arrival at the tokenizer
        # manager, entry into the waiting queue, the last output token's processing (None
        # before the first), the end (None while running); queued: no prefill launched yet
        self.arrival_time = self.queue_start = time.perf_counter()
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.queued = True
        if sampling_params.seed is not None:
            self.generator = torch.Generator(device=generator_device).manual_seed(sampling_params.seed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def remaining_new_tokens(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    def fill_ids(self) -> np.ndarray:
        """[n] int32: prompt plus output so far, what a (re-)admitted request prefills (the
        prompt array itself while there is no output: read only)."""
        if not self.output_ids:
            return self.origin_input_ids
        return np.concatenate((self.origin_input_ids, np.asarray(self.output_ids, dtype=np.int32)))

    @property
    def wants_input_logprobs(self) -> bool:
        lp = self.logprob
        return (
            lp.return_logprob
            and lp.logprob_start_len is not None
            and not self.input_logprobs_done
            and lp.logprob_start_len < len(self.origin_input_ids)
        )

    def prefix_key(self) -> np.ndarray:
        """[n] int32: the tokens whose cached KV it may reuse (fill_ids up to max_prefix_len),
        made once per length of its output (a waiting request's output changes only when it
        is retracted)."""
        key = self._prefix_key
        if key is None or self._prefix_key_outputs != len(self.output_ids):
            key = self.fill_ids()[: self.max_prefix_len()]
            self._prefix_key, self._prefix_key_outputs = key, len(self.output_ids)
        return key

    def can_chunk(self) -> bool:
        """Whether its prefill may be split into chunks: not while prompt logprobs are wanted
        (they are computed by one extend step)."""
        return not self.wants_input_logprobs

    def max_prefix_len(self) -> int:
        """Longest cached prefix this request may reuse: all but the last token, and no token
        whose logprob must be computed (the token before logprob_start_len is recomputed)."""
        limit = self.seq_len - 1
        if self.wants_input_logprobs:
            limit = min(limit, max(self.logprob.logprob_start_len - 1, 0))  # type: ignore[operator]
        return limit

    def kv_token_ids(self, kv_len: int) -> np.ndarray:
        """[kv_len] int32: the tokens whose K/V is stored, in order (what the radix cache may
        keep): the prompt, the outputs, then any sampled after the finish and fed to one more
        step."""
        ids = self.fill_ids()
        if self.dropped_ids:
            ids = np.concatenate((ids, np.asarray(self.dropped_ids, dtype=np.int32)))
        return ids[:kv_len]

    def check_finished(self) -> None:
        """Set finish_reason after a new token was appended (EOS/stop ids, then length). The
        scheduler's result loop calls it only when the token is a stop id or the length is
        reached: a new finish condition here must be added to that check too."""
        if self.finished or not self.output_ids:
            return
        last = self.output_ids[-1]
        if last in self.stop_token_ids:
            self.finish_reason = FinishReason.stop(last)
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = FinishReason.length_limit(self.max_new_tokens)

    def sampling_row(self) -> SamplingRow:
        """What the worker keeps for this request while it holds its row."""
        sp = self.sampling_params
        seen = None
        if sp.repetition_penalty != 1.0:
            seen = self.fill_ids()
        resumes = bool(self.output_ids) and (sp.has_penalties or self.grammar is not None)
        outputs = np.asarray(self.output_ids, dtype=np.int32) if resumes else None
        assert self.admission is not None
        return SamplingRow(
            self.admission.req_pool_idx,
            sp,
            self.stop_token_ids,
            seen_ids=seen,
            output_ids=outputs,
            num_sampled=len(self.output_ids),
            generator=self.generator,
            grammar=self.grammar,
        )


@dataclass
class ScheduleBatch:
    """The requests of one step (request i is row i of its plan) and its plan."""

    reqs: list[Req]
    plan: StepPlan
    # the request (at most one, the last) whose prompt this extend step leaves unfinished: its
    # sampled token is dropped, its sampling row starts with its last chunk
    partial: Req | None = None

    @property
    def forward_mode(self) -> ForwardMode:
        return self.plan.forward_mode

    @classmethod
    def extend(
        cls,
        reqs: list[Req],
        fill: list[np.ndarray],
        arrays: BatchArrays,
        released_rows: list[int],
        step_id: int,
        partial: Req | None = None,
        decodes: list[Req] | None = None,
    ) -> ScheduleBatch:
        """An EXTEND step: `fill[i]` are request i's tokens up to the end of this step; those
        after its prefix are new. Every request of it but `partial` (a prompt chunk that is
        not the last) starts its sampling row. `decodes`: running requests that decode one
        token each in the same step (a mixed chunk; rows after `reqs`, inputs on the worker)."""
        decodes = decodes or []
        input_ids = np.concatenate([f[r.admission.prefix_len :] for f, r in zip(fill, reqs)], dtype=np.int32)  # type: ignore[union-attr]
        prefills, reqs = reqs, reqs + decodes
        plan = StepPlan(
            ForwardMode.EXTEND,
            req_pool_indices=arrays.req_pool_indices,
            seq_lens=arrays.seq_lens,
            positions=arrays.positions,
            out_cache_loc=arrays.out_cache_loc,
            input_ids=input_ids,
            prefix_lens=arrays.prefix_lens,
            extend_lens=arrays.extend_lens,
            row_slots=arrays.kv_indices,
            num_decode_rows=len(decodes),
            new_sampling_rows=[r.sampling_row() for r in prefills if r is not partial],
            released_rows=released_rows,
            all_greedy=all(r.greedy for r in reqs if r is not partial),
            logprob_info=_logprob_info(reqs, extend=True, partial=partial),
            step_id=step_id,
        )
        return cls(reqs, plan, partial)

    @classmethod
    def decode(cls, reqs: list[Req], arrays: BatchArrays, released_rows: list[int], step_id: int) -> ScheduleBatch:
        """A DECODE step: one new token per request; its input is the request's last sampled
        token, which the worker reads from its token table."""
        plan = StepPlan(
            ForwardMode.DECODE,
            req_pool_indices=arrays.req_pool_indices,
            seq_lens=arrays.seq_lens,
            positions=arrays.positions,
            out_cache_loc=arrays.out_cache_loc,
            released_rows=released_rows,
            all_greedy=all(map(_GREEDY, reqs)),
            logprob_info=_logprob_info(reqs, extend=False),
            step_id=step_id,
        )
        return cls(reqs, plan)


def _logprob_info(reqs: list[Req], extend: bool, partial: Req | None = None) -> LogprobBatchInfo | None:
    """What logprobs the step's requests want (a partial prompt chunk: none)."""
    wanted = map(_RETURN_LOGPROB, reqs) if partial is None else (r.return_logprob for r in reqs if r is not partial)
    if not any(wanted):
        return None
    starts: list[int | None] = [None] * len(reqs)
    if extend:
        for i, r in enumerate(reqs):
            if r.wants_input_logprobs:
                starts[i] = r.logprob.logprob_start_len - r.admission.prefix_len  # type: ignore[operator,union-attr]
    wants = [r.logprob.return_logprob and r is not partial for r in reqs]
    return LogprobBatchInfo(
        return_logprob=wants,
        top_logprobs_nums=[r.logprob.top_logprobs_num if w else 0 for r, w in zip(reqs, wants)],
        token_ids_logprob=[r.logprob.token_ids_logprob if w else None for r, w in zip(reqs, wants)],
        input_logprob_starts=starts,
    )
