"""The scheduler task: continuous batching over the Rust KV core, with overlap scheduling.

Each tick: release the requests that finished and are in no step still in flight (their KV
goes to the radix cache or back to the allocator), admit waiting requests into a prefill
(EXTEND) batch if any fit, else plan one DECODE step for the running requests; hand the plan
to the worker; then process the results of the previous step. With overlap (the default) the
worker computes step N+1 while the loop processes step N's results, detokenizes and serves
HTTP; `overlap=False` (`--disable-overlap-schedule`) awaits each step before planning the next.
A step's results are processed, and the next step planned and launched, in the loop callback
that resolves it (`_step_done`); the `run` task only starts an empty pipeline.

One step late: a request whose stop token (or stop string, or abort) is seen when step N's
results are processed is already in step N+1. Its extra token is dropped and its resources
are released once, after N+1 (`Req.num_inflight`). A length finish is known when planning, so
it costs no extra step.

A prefill (EXTEND) step of newly admitted requests holds no running request, so with overlap
the decode step right behind a prefill that is the newer of two steps in flight is planned
at once, a third in flight, without waiting for the older step's results: every request is
still in at most two unprocessed steps (no request runs more than one step past its
finish), and a short prefill step does not leave the device waiting for the loop. Loop
thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from pyserve.engine.retraction import Retraction
from pyserve.engine.schedule_batch import Req, ScheduleBatch, decodable
from pyserve.engine.schedule_policy import PrefillAdder, SchedulePolicy
from pyserve.engine.worker import ModelWorker
from pyserve.forward_batch_info import FinishReason, ForwardMode, StepOutput, TokenLogprobs
from pyserve.io_struct import TokenizedGenerateReq
from pyserve.mem_cache.kv_cache import KVCache

_REQ_ID = attrgetter("req_id")  # (a decode plan's pass over its requests runs in C)
logger = logging.getLogger(__name__)

# SGLang's defaults for the new-token ratio
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600


@dataclass(slots=True)
class TokenOut:
    """New token ids of one request after one step (to the detokenizer), with their logprobs
    (output_logprobs: one entry per id of ids_delta) and, once, the prompt's (input_logprobs
    with the prompt ids they are about, input_logprob_ids) when the request asked."""

    rid: str
    ids_delta: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    output_logprobs: TokenLogprobs | None = None
    input_logprobs: TokenLogprobs | None = None
    input_logprob_ids: list[int] | None = None


@dataclass
class Launched:
    """A step handed to the worker whose results are not processed yet."""

    batch: ScheduleBatch
    future: asyncio.Future


class Scheduler(Retraction):
    """Owns the waiting queue, the running requests and the KV bookkeeping (giving KV back,
    by retraction or priority preemption, is `Retraction`'s part)."""

    def __init__(
        self,
        kv_cache: KVCache,
        worker: ModelWorker,
        context_len: int,
        max_running_requests: int,
        max_prefill_tokens: int,
        emit: Callable[[list[TokenOut]], None],
        stats_interval_s: float = 10.0,
        overlap: bool = True,
        chunked_prefill_size: int | None = None,
        enable_mixed_chunk: bool = False,
        schedule_policy: str = "fcfs",
        random_seed: int | None = None,
        enable_priority_scheduling: bool = False,
        low_priority_values_first: bool = False,
        preemption_threshold: int = 10,
        schedule_conservativeness: float = 1.0,
    ) -> None:
        self.kv_cache = kv_cache
        self.worker = worker
        self.context_len = context_len
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.emit = emit
        self.stats_interval_s = stats_interval_s
        self.overlap = overlap
        self.chunked_prefill_size = chunked_prefill_size  # None: prompts are never cut
        self.chunked_req: Req | None = None  # admitted, its prompt partly prefilled
        self._decode_turn = False  # while a prompt is chunked: a decode step goes next
        # prefill steps carry the running requests' decode tokens too (SGLang's mixed chunk)
        self.enable_mixed_chunk = enable_mixed_chunk
        self.policy = SchedulePolicy(schedule_policy, kv_cache, seed=random_seed)
        self.enable_priority_scheduling = enable_priority_scheduling
        self.low_priority_values_first = low_priority_values_first
        self.preemption_threshold = preemption_threshold
        # SGLang's new-token ratio: the share of running requests' remaining max_new_tokens
        # admission reserves; it decays per decode step and a retraction raises it again
        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * schedule_conservativeness, 1.0)
        self.min_new_token_ratio = min(self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.new_token_ratio_decay = (
            self.init_new_token_ratio - self.min_new_token_ratio
        ) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_new_token_ratio
        # seeded requests draw from a generator on the model's device
        self.generator_device = str(getattr(getattr(worker, "model_runner", None), "device", "cpu"))
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        self.inflight: deque[Launched] = deque()
        self._to_release: list[Req] = []  # finished, not yet released
        self._released_rows: list[int] = []  # for the next plan (the worker's sampling rows)
        self._need_drain = False
        self._failure: BaseException | None = None  # a bug in a step-done callback
        self._wake = asyncio.Event()
        self._stopping = False
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.last_gen_throughput = 0.0  # output tokens/s over the last stats interval
        self._last_stats = (time.monotonic(), 0)

    # ---- called by the tokenizer manager / detokenizer (loop thread) ------------------------
    def add_request(self, treq: TokenizedGenerateReq) -> None:
        sp = treq.sampling_params
        # A request must fit alone in both the context and the KV pool.
        room = min(self.context_len, self.kv_cache.max_total_tokens) - len(treq.input_ids)
        max_new = room if sp.max_new_tokens is None else min(sp.max_new_tokens, room)
        req = Req(
            treq.rid,
            treq.input_ids,
            sp,
            max_new,
            treq.stop_token_ids,
            treq.logprob,
            generator_device=self.generator_device,
        )
        req.quiet = treq.quiet
        req.priority = treq.priority
        self.reqs[req.rid] = req
        # max_new_tokens 0 still prefills, as in SGLang: the prompt's KV enters the radix
        # cache (clients send such requests to cache a prefix) and prompt logprobs are
        # computed; the token sampled after it is dropped.
        self.waiting.append(req)
        self._wake.set()

    def finish_request(self, rid: str, finish_reason: FinishReason) -> None:
        """End a request now (client gone, or a stop string matched). Its KV is released once
        no step in flight holds it; tokens computed meanwhile are dropped. Unknown rids are
        ignored."""
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return
        if req.req_id is None:  # still waiting: nothing allocated
            req.finish_reason = finish_reason
            self.waiting.remove(req)
            self._forget(req)
        else:  # its KV goes once no step holds it; the consumer hears of the end now
            self._end(req, finish_reason)
        self.emit([self._out(req)])
        self._wake.set()

    def flush_cache(self) -> bool:
        """Empty the radix cache (every cached prefix's KV is freed). Only while no request
        is queued, admitted or in a step; returns False, changing nothing, otherwise."""
        if not self.is_idle() or self.kv_cache.num_reqs() != 0:
            return False
        self.kv_cache.reset()
        return True

    def is_idle(self) -> bool:
        return not self.waiting and not self.running and not self.inflight and self.chunked_req is None

    def load(self) -> int:
        """SGLang's load figure: KV slots held by admitted requests (neither free nor
        evictable) plus the prompt tokens of the waiting ones."""
        kv = self.kv_cache
        held = kv.max_total_tokens - kv.free_slots() - kv.evictable_slots()
        return held + sum(len(r.origin_input_ids) for r in self.waiting)

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    # ---- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        """The scheduler task: it starts steps when the pipeline is empty (at start, and when a
        request arrives while nothing runs) and sleeps otherwise; while steps are in flight,
        each step's completion processes its results and launches the next step itself
        (`_step_done`, run by the worker's resolve callback), so a finished step never waits
        behind the loop's other ready callbacks before the device gets its next step."""
        while not self._stopping:
            if not self.inflight:
                self._pump()
            if self._failure is not None:
                raise self._failure
            if self._stopping:
                break
            self._wake.clear()
            # until a request arrives (steps in flight drive themselves meanwhile, and may
            # leave the pipeline empty): wake up for the stats line even so
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.stats_interval_s)
            self._maybe_log_stats()
        while self.inflight:  # let the worker finish what it has before we go
            with contextlib.suppress(Exception):
                await self.inflight.popleft().future
        chunked = [self.chunked_req] if self.chunked_req is not None else []
        for req in list(self.waiting) + self.running + chunked:
            if not req.finished:
                req.finish_reason = FinishReason.abort("server shutting down")
                self.emit([self._out(req)])

    def _pump(self) -> None:
        """Launch steps until the pipeline is full (two in flight with overlap: the next is
        planned while one runs; a third behind a prefill, `_room_behind_prefill`; one
        without) or nothing can run yet. Loop thread."""
        depth = 2 if self.overlap else 1
        while not self._stopping:
            self._release_finished()
            self._maybe_log_stats()
            if len(self.inflight) >= depth and not self._room_behind_prefill():
                return
            batch = None if self._need_drain else self._get_next_batch()
            if batch is not None:
                self._launch(batch)
                continue
            if self.inflight:  # nothing to plan until a step in flight ends
                return
            drained, self._need_drain = self._need_drain, False
            if drained:  # every token in flight is known now: plan again (maybe retract)
                continue
            if self._released_rows:  # idle: the worker drops the rows of who left
                self.worker.release_rows(self._released_rows)
                self._released_rows = []
            return

    def _room_behind_prefill(self) -> bool:
        """With overlap, whether a third step may follow the two in flight: yes when the newer
        is a prefill of requests in no other step (no decode rows, no chunk continued). Then
        no request is in two unprocessed steps yet, so planning the next one now keeps the
        one-step-late bound, and the device, done with the short prefill, need not wait for
        the older step's results to be processed first. At most three in flight."""
        if not self.overlap or len(self.inflight) != 2:
            return False
        newer = self.inflight[-1].batch
        return (
            newer.forward_mode is ForwardMode.EXTEND
            and newer.plan.num_decode_rows == 0
            and all(r.num_inflight == 1 for r in newer.reqs)
        )

    def _step_done(self, future: asyncio.Future) -> None:
        """The worker resolved `future` (a step's output). Runs on the loop, right when the
        step's result arrives: process the done steps in launch order, then plan and launch
        the next. An error here is a scheduler bug: it ends the scheduler task with it."""
        if self._stopping or self._failure is not None:
            return
        try:
            while self.inflight and self.inflight[0].future.done():
                self._process_done(self.inflight.popleft())
            self._pump()
        except BaseException as exc:
            self._failure = exc
            self._wake.set()
            raise

    def _launch(self, batch: ScheduleBatch) -> None:
        for req in batch.reqs:
            req.num_inflight += 1
            req.num_planned += 1
        if batch.forward_mode is ForwardMode.EXTEND:  # its prefills join (decode rows are in)
            prefills = batch.reqs[: len(batch.reqs) - batch.plan.num_decode_rows]
            self.running.extend(r for r in prefills if r is not batch.partial)
        if batch.partial is not None:
            batch.partial.num_planned -= 1  # a prompt chunk plans no output token
        self.num_steps += 1
        self.inflight.append(Launched(batch, self.worker.submit(batch.plan, self._step_done)))

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
                    # status_code: a server-side failure, not the client's (HTTP 500)
                    self._end(req, FinishReason.abort(f"model step failed: {exc}", status_code=500))
                    self.emit([self._out(req)])
            return
        self._process_batch_result(batch, launched.future.result())

    def _get_next_batch(self) -> ScheduleBatch | None:
        """The next step: a prefill (EXTEND) of admitted waiting requests if any fit (SGLang's
        prefill-first order), else the running requests' DECODE step, or None."""
        chunked = self.chunked_req
        if chunked is not None and chunked.finished:  # aborted mid-prefill: released as usual
            self.chunked_req = chunked = None
        if chunked is not None and self._decode_turn and self.running and not self.enable_mixed_chunk:
            # a long prompt being chunked must not stop the running streams: its chunks and
            # decode steps take turns
            self._decode_turn = False
            batch = self._decode_batch()
            if batch is not None or self._need_drain:
                return batch
        # a full batch admits nothing (unless a more urgent request may preempt): skip the
        # ordering and the admission pass, which cost O(waiting + running) per step
        full = (
            chunked is None and not self.enable_priority_scheduling and len(self.running) >= self.max_running_requests
        )
        if (self.waiting and not full) or chunked is not None:
            self._order_waiting()
            adder = PrefillAdder(
                self.kv_cache,
                self.running,
                self.max_running_requests,
                self.max_prefill_tokens,
                self.chunked_prefill_size,
                chunked,
                self.new_token_ratio,
            )
            admitted = adder.admit_from(self.waiting)
            if (
                not admitted
                and self.enable_priority_scheduling
                and self.waiting
                and chunked is None
                and self._preempt_for(self.waiting[0])
            ):
                self._order_waiting()  # the preempted wait behind it again
                adder = PrefillAdder(
                    self.kv_cache,
                    self.running,
                    self.max_running_requests,
                    self.max_prefill_tokens,
                    self.chunked_prefill_size,
                    None,
                    self.new_token_ratio,
                )
                admitted = adder.admit_from(self.waiting)
            if self._need_drain and not admitted:
                return None
            self.chunked_req = adder.chunked_req
            self._decode_turn = self.chunked_req is not None
            if admitted:
                batch = self._extend_batch(admitted, self._mixed_decodes(admitted))
                if batch is not None:
                    self._share_prompts([r for r in admitted if id(r) in adder.leaders], batch.partial)
                    return batch
        if self.running:
            return self._decode_batch()
        return None

    def _take_released_rows(self) -> list[int]:
        rows, self._released_rows = self._released_rows, []
        return rows

    def _share_prompts(self, leaders: list[Req], partial: Req | None) -> None:
        """Put the prompts of `leaders` (admitted requests a waiting twin shares a prompt head
        with) into the radix cache now, so the twin reuses them next round: their KV is
        computed by the step just planned, which runs before any step of the twin. Skipped
        when the cache holds more of the prompt than the request locked (another request
        computed it meanwhile): caching would then swap the request's pages for the cache's
        under the worker's row. A chunk in progress is cached when its next chunk is planned."""
        for req in leaders:
            if req is partial or req.req_id is None:
                continue
            kv_len = self.kv_cache.kv_len(req.req_id)
            stored = req.fill_ids()[:kv_len]
            if int(self.kv_cache.match_lens([stored])[0]) > req.prefix_len:
                continue
            self.kv_cache.cache_unfinished_req(req.req_id, stored)

    def _mixed_decodes(self, admitted: list[Req]) -> list[Req]:
        """The running requests that decode inside this prefill step (mixed chunk): all that
        can, unless logprobs are wanted by any (as SGLang, which does not mix them)."""
        if not self.enable_mixed_chunk or not self.running:
            return []
        decodes = decodable(self.running)
        if any(r.logprob.return_logprob for r in decodes) or any(r.logprob.return_logprob for r in admitted):
            return []
        return decodes

    def _extend_batch(self, reqs: list[Req], decodes: list[Req] | None = None) -> ScheduleBatch | None:
        """The EXTEND step of `reqs` (each up to its `extend_end`) with `decodes` decoding one
        token each in it, or None, putting `reqs` back to wait, when their pages do not fit
        after all (without `decodes` first)."""
        decodes = decodes or []
        fill = [r.fill_ids() for r in reqs]
        fill = [f if r.extend_end is None else f[: r.extend_end] for f, r in zip(fill, reqs)]
        extend_lens = [len(f) - r.prefix_len for f, r in zip(fill, reqs)]
        ids = [_kv_id(r) for r in reqs]
        arrays = self.kv_cache.prepare_extend(ids + [_kv_id(r) for r in decodes], extend_lens + [1] * len(decodes))
        if arrays is None and decodes:
            decodes = []
            arrays = self.kv_cache.prepare_extend(ids, extend_lens)
        if arrays is None:  # admission raced with reservations: put them back
            for req in reversed(reqs):
                if req.prefix_len > req.cached_tokens:  # a chunked one: its own chunks are
                    req.num_retractions += 1  # not what it found cached at admission
                self._unadmit(req)
                self.waiting.appendleft(req)
            self.chunked_req = None  # a chunked one resumes from its cached chunks
            return None
        partial = self.chunked_req if self.chunked_req in reqs else None
        return ScheduleBatch.extend(reqs, fill, arrays, self._take_released_rows(), self.num_steps, partial, decodes)

    def _decode_batch(self) -> ScheduleBatch | None:
        while True:
            reqs = decodable(self.running)
            if not reqs:
                return None
            req_ids = np.fromiter(map(_REQ_ID, reqs), dtype=np.int64, count=len(reqs))
            arrays = self.kv_cache.prepare_decode(req_ids)
            if arrays is not None:
                self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
                return ScheduleBatch.decode(reqs, arrays, self._take_released_rows(), self.num_steps)
            if self.inflight:  # retract only once every token in flight is known
                self._need_drain = True
                return None
            self._retract()

    def _unadmit(self, req: Req) -> None:
        self.kv_cache.abort_req(_kv_id(req))
        req.req_id, req.req_pool_idx, req.prefix_len, req.extend_end = None, None, 0, None

    def _process_batch_result(self, batch: ScheduleBatch, result: StepOutput) -> None:
        """Append each request's new token, decide who finished, emit TokenOuts."""
        outs = []
        failed = set(result.failed_rows) if result.failed_rows else ()
        ids = result.next_token_ids.tolist()
        with_logprobs = result.output_logprobs is not None or result.input_logprobs is not None
        generated = 0
        for i, (req, token) in enumerate(zip(batch.reqs, ids)):
            req.num_inflight -= 1
            if req is batch.partial:  # a prompt chunk: its token is not an output
                continue
            if req.finish_reason is not None:  # ended while the step ran: drop the extra token
                req.dropped_ids.append(token)
                continue
            if i in failed:  # its own parameters left nothing to sample: it alone fails
                self._end(
                    req,
                    FinishReason.abort(
                        "the sampling parameters leave no token to sample at output token "
                        f"{len(req.output_ids)} (every logit banned, or a bias or penalty overflowed)",
                        status_code=400,
                    ),
                )
                outs.append(self._out(req))
                continue
            if req.max_new_tokens == 0:  # a prefill-only request: no output token
                self._end(req, FinishReason.length_limit(0))
                req.dropped_ids.append(token)
                token_out = self._out(req)
                self._add_input_logprobs(token_out, req, result, i)
                outs.append(token_out)
                continue
            output_ids = req.output_ids
            output_ids.append(token)
            generated += 1
            if token in req.stop_token_ids or len(output_ids) >= req.max_new_tokens:
                req.check_finished()  # (only these two can end it: see its docstring)
            if req.finish_reason is not None:
                self._to_release.append(req)
            elif req.quiet:
                continue  # its tokens go to the detokenizer once, when it ends
            out = self._out(req)
            if with_logprobs:
                if result.output_logprobs is not None:
                    out.output_logprobs = result.output_logprobs[i]
                self._add_input_logprobs(out, req, result, i)
            outs.append(out)
        self.num_generated_tokens += generated
        if outs:
            self.emit(outs)

    @staticmethod
    def _add_input_logprobs(out: TokenOut, req: Req, result: StepOutput, i: int) -> None:
        """Attach row i's prompt logprobs (once per request) to its TokenOut."""
        if result.input_logprobs is not None and result.input_logprobs[i] is not None:
            out.input_logprobs = result.input_logprobs[i]
            out.input_logprob_ids = req.origin_input_ids[req.logprob.logprob_start_len :].tolist()
            req.input_logprobs_done = True

    def _end(self, req: Req, reason: FinishReason) -> None:
        """An admitted request ends: it is released once no step in flight holds it."""
        req.finish_reason = reason
        self._to_release.append(req)

    def _release_finished(self) -> None:
        """Return the KV of finished requests that no step in flight holds: cached for normal
        finishes, freed for aborts. Each is released exactly once."""
        if not self._to_release:
            return
        pending, released = [], set()
        for req in self._to_release:
            if req.num_inflight > 0:
                pending.append(req)
                continue
            if req.req_id is not None:
                if req.finish_reason.is_abort or req.kv_invalid:  # type: ignore[union-attr]
                    self.kv_cache.abort_req(req.req_id)
                else:
                    kv_len = self.kv_cache.kv_len(req.req_id)
                    self.kv_cache.cache_finished_req(req.req_id, req.kv_token_ids(kv_len))
                assert req.req_pool_idx is not None  # admitted: it holds a row
                self._released_rows.append(req.req_pool_idx)
                req.req_id = req.req_pool_idx = None
            released.add(id(req))
            self._forget(req)
        self._to_release = pending
        if released:
            self.running = [r for r in self.running if id(r) not in released]

    def _forget(self, req: Req) -> None:
        if self.reqs.get(req.rid) is req:  # the rid may already name a newer request
            del self.reqs[req.rid]

    def _out(self, req: Req) -> TokenOut:
        """The request's output tokens not handed on yet (one per step, or all of a quiet
        request's at its end) and its finish reason."""
        start, req.num_emitted = req.num_emitted, len(req.output_ids)
        ids = req.output_ids[start:] if start < req.num_emitted else []
        return TokenOut(req.rid, ids, req.finish_reason, len(req.origin_input_ids), req.cached_tokens)

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        last_t, last_n = self._last_stats
        if now - last_t < self.stats_interval_s:
            return
        self._last_stats = (now, self.num_generated_tokens)
        self.last_gen_throughput = (self.num_generated_tokens - last_n) / (now - last_t)
        if self.is_idle() and self.num_generated_tokens == last_n:
            return
        total = self.kv_cache.max_total_tokens
        used = total - self.kv_cache.free_slots()
        logger.info(
            "running=%d queued=%d kv_used=%d/%d (%.1f%%) gen_throughput=%.1f tok/s",
            len(self.running),
            len(self.waiting),
            used,
            total,
            100.0 * used / total,
            self.last_gen_throughput,
        )


def _kv_id(req: Req) -> int:
    """The Rust core's id of an admitted request (set at admission, None once released)."""
    assert req.req_id is not None
    return req.req_id
