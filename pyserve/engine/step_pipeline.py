"""`StepPipeline`: the steps handed to the worker and what comes back of them (DESIGN.md
sections 1 and 3). Loop thread only.

It owns the steps in flight (launched, their results not processed yet, oldest first): the
launch of a planned step, the processing of a step's results (each request's new token, who
finished, the `TokenOut`s for the detokenizer), and the release of finished requests (their
KV goes to the radix cache or back to the allocator, their rows to the next plan). It also
holds the drain flag: a plan that may only be made once every token in flight is known
(retraction, preemption) asks for a drain, and the scheduler plans again once none is left.

One step late: a request whose stop token (or stop string, or abort) is seen when step N's
results are processed is already in step N+1. Its extra token is dropped and its resources
are released once, after N+1 (`Req.num_inflight`). A length finish is known when planning, so
it costs no extra step.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pyserve.engine.schedule_batch import Req, ScheduleBatch
from pyserve.engine.schedule_state import ScheduleState
from pyserve.engine.worker import ModelWorker
from pyserve.forward_batch_info import EndCause, FinishReason, ForwardMode, StepOutput, TokenOut
from pyserve.mem_cache.kv_cache import KVCache


@dataclass
class Launched:
    """A step handed to the worker whose results are not processed yet."""

    batch: ScheduleBatch
    future: asyncio.Future


def token_out(req: Req) -> TokenOut:
    """The request's output tokens not handed on yet (one per step, or all of a quiet
    request's at its end) and its finish reason."""
    start, req.num_emitted = req.num_emitted, len(req.output_ids)
    ids = req.output_ids[start:] if start < req.num_emitted else []
    return TokenOut(req.rid, ids, req.finish_reason, len(req.origin_input_ids), req.cached_tokens)


class StepPipeline:
    """The steps in flight, their results and the release of finished requests (see the
    module docstring).

    worker: takes the plans (`submit`, `release_rows`); emit: hands TokenOuts on (to the
    detokenizer); on_step_done: the loop callback the worker runs when a step's future
    resolves (the scheduler's). Mutates `state` (running, reqs) and the requests it
    processes.
    """

    def __init__(
        self,
        kv_cache: KVCache,
        worker: ModelWorker,
        state: ScheduleState,
        emit: Callable[[list[TokenOut]], None],
        on_step_done: Callable[[asyncio.Future], None],
    ) -> None:
        self.kv_cache = kv_cache
        self.worker = worker
        self.state = state
        self.emit = emit
        self._on_step_done = on_step_done
        self.inflight: deque[Launched] = deque()
        self.need_drain = False  # the next plan waits until every step in flight is processed
        self.num_steps = 0
        self.num_generated_tokens = 0
        self._to_release: list[Req] = []  # finished, not yet released
        self.released_rows: list[int] = []  # for the next plan (the worker's sampling rows)

    def launch(self, batch: ScheduleBatch) -> None:
        for req in batch.reqs:
            req.num_inflight += 1
            req.num_planned += 1
        if batch.forward_mode is ForwardMode.EXTEND:  # its prefills join (decode rows are in)
            prefills = batch.reqs[: len(batch.reqs) - batch.plan.num_decode_rows]
            self.state.running.extend(r for r in prefills if r is not batch.partial)
            metrics = self.state.metrics
            if metrics is not None:
                now = time.perf_counter()
                for req in prefills:
                    if req.queued:
                        req.queued = False
                        metrics.first_prefill(req, now)
        if batch.partial is not None:
            batch.partial.num_planned -= 1  # a prompt chunk plans no output token
        self.num_steps += 1
        self.inflight.append(Launched(batch, self.worker.submit(batch.plan, self._on_step_done)))

    def process_done_steps(self) -> None:
        """Process the steps whose results arrived, in launch order."""
        while self.inflight and self.inflight[0].future.done():
            self._process_done(self.inflight.popleft())

    def take_released_rows(self) -> list[int]:
        """The rows released since the last plan (the next plan carries them)."""
        rows, self.released_rows = self.released_rows, []
        return rows

    def send_released_rows(self) -> None:
        """No plan follows for now: hand the released rows to the worker directly."""
        if self.released_rows:  # idle: the worker drops the rows of who left
            self.worker.release_rows(self.released_rows)
            self.released_rows = []

    def _process_done(self, launched: Launched) -> None:
        batch = launched.batch
        exc = launched.future.exception()
        if exc is not None:
            for req in batch.reqs:
                req.num_inflight -= 1
                # this step wrote (some of) its KV: never cache it, even for a request that
                # had finished normally one step before (its stop token's KV is in here)
                req.kv_invalid = True
                if not req.finished:
                    self.end(req, FinishReason.abort(EndCause.STEP_FAILED, f"model step failed: {exc}"))
                    self.emit([token_out(req)])
            return
        self.process_batch_result(batch, launched.future.result())

    def process_batch_result(self, batch: ScheduleBatch, result: StepOutput) -> None:
        """Append each request's new token, decide who finished, emit TokenOuts."""
        outs = []
        failed = set(result.failed_rows) if result.failed_rows else ()
        ids = result.next_token_ids.tolist()
        with_logprobs = result.output_logprobs is not None or result.input_logprobs is not None
        generated = 0
        now = time.perf_counter()
        metrics = self.state.metrics
        # the loop below runs per output token: it only groups the inter-token gaps by the
        # time of each request's previous token (most share one: the previous step's), and
        # the histograms take each group once, after it
        gaps: dict[float, int] | None = {} if metrics is not None else None
        firsts: list[Req] = []
        for i, (req, token) in enumerate(zip(batch.reqs, ids)):
            req.num_inflight -= 1
            if req is batch.partial:  # a prompt chunk: its token is not an output
                continue
            if req.finish_reason is not None:  # ended while the step ran: drop the extra token
                req.dropped_ids.append(token)
                continue
            if i in failed:  # its own parameters left nothing to sample: it alone fails
                self.end(
                    req,
                    FinishReason.abort(
                        EndCause.BAD_PARAMS,
                        "the sampling parameters leave no token to sample at output token "
                        f"{len(req.output_ids)} (every logit banned or masked by its grammar, or a bias or "
                        "penalty overflowed)",
                    ),
                )
                outs.append(token_out(req))
                continue
            if req.max_new_tokens == 0:  # a prefill-only request: no output token
                self.end(req, FinishReason.length_limit(0))
                req.dropped_ids.append(token)
                out = token_out(req)
                if result.embeddings is not None:
                    out.embedding = result.embeddings[i]
                self._add_input_logprobs(out, req, result, i)
                outs.append(out)
                continue
            output_ids = req.output_ids
            output_ids.append(token)
            generated += 1
            if gaps is not None:
                last = req.last_token_time
                req.last_token_time = now
                if last is None:
                    firsts.append(req)
                else:
                    gaps[last] = gaps.get(last, 0) + 1
            if token in req.stop_token_ids or len(output_ids) >= req.max_new_tokens:
                req.check_finished()  # (only these two can end it: see its docstring)
            if req.finish_reason is not None:
                req.finish_time = now
                self._to_release.append(req)
            elif req.quiet:
                continue  # its tokens go to the detokenizer once, when it ends
            out = token_out(req)
            if with_logprobs:
                if result.output_logprobs is not None:
                    out.output_logprobs = result.output_logprobs[i]
                self._add_input_logprobs(out, req, result, i)
            outs.append(out)
        self.num_generated_tokens += generated
        if metrics is not None and gaps is not None:
            metrics.tokens_out(now, gaps, firsts)
        if outs:
            self.emit(outs)

    @staticmethod
    def _add_input_logprobs(out: TokenOut, req: Req, result: StepOutput, i: int) -> None:
        """Attach row i's prompt logprobs (once per request) to its TokenOut."""
        if result.input_logprobs is not None and result.input_logprobs[i] is not None:
            out.input_logprobs = result.input_logprobs[i]
            out.input_logprob_ids = req.origin_input_ids[req.logprob.logprob_start_len :].tolist()
            req.input_logprobs_done = True

    def end(self, req: Req, reason: FinishReason) -> None:
        """An admitted request ends: it is released once no step in flight holds it."""
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        self._to_release.append(req)

    def release_finished(self) -> None:
        """Return the KV of finished requests that no step in flight holds: cached for normal
        finishes, freed for aborts. Each is released exactly once."""
        if not self._to_release:
            return
        pending, released = [], set()
        for req in self._to_release:
            if req.num_inflight > 0:
                pending.append(req)
                continue
            if req.admission is not None:
                abort = req.finish_reason.is_abort or req.kv_invalid  # type: ignore[union-attr]
                self.released_rows.append(self.kv_cache.release(req, None if abort else req.kv_token_ids))
            released.add(id(req))
            self.state.forget(req)
        self._to_release = pending
        if released:
            self.state.running = [r for r in self.state.running if id(r) not in released]
