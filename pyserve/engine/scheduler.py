"""The scheduler task: continuous batching over the Rust KV core, with overlap scheduling.

Each tick: release the requests that finished and are in no step still in flight (their KV
goes to the radix cache or back to the allocator), admit waiting requests into a prefill
(EXTEND) batch if any fit, else plan one DECODE step for the running requests; hand the plan
to the worker; then process the results of the previous step. With overlap (the default) the
worker computes step N+1 while the loop processes step N's results, detokenizes and serves
HTTP; `overlap=False` (`--disable-overlap-schedule`) awaits each step before planning the next.
A step's results are processed, and the next step planned and launched, in the loop callback
that resolves it (`_step_done`); the `run` task only starts an empty pipeline.

`Scheduler` is the thin owner of that loop. It wires its collaborators, each an object with
its own module and state, and keeps the surface the tokenizer manager, the detokenizer and
the engine use:
  ScheduleState  schedule_state.py  the requests by where they are (waiting, running, the
                                    chunked one, every one not yet released by rid)
  StepPipeline   step_pipeline.py   the steps in flight: launch, results, release of the
                                    finished (one step late: see there)
  BatchPlanner   batch_planner.py   the next step: admission, chunked prefill turns, mixed
                                    chunks, prompt sharing, the new-token ratio
  Retractor      retraction.py      giving KV back: retraction, priority order, preemption
  GrammarQueue   grammar_queue.py   requests whose grammar is still compiling

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

from pyserve.constrained import GrammarBackend, GrammarKey
from pyserve.engine.batch_planner import BatchPlanner
from pyserve.engine.grammar_queue import GrammarQueue
from pyserve.engine.retraction import Retractor
from pyserve.engine.schedule_batch import Req
from pyserve.engine.schedule_policy import NewTokenRatio, SchedulePolicy
from pyserve.engine.schedule_state import ScheduleState
from pyserve.engine.scheduler_config import SchedulerConfig
from pyserve.engine.step_pipeline import Launched, StepPipeline, token_out
from pyserve.engine.worker import ModelWorker
from pyserve.forward_batch_info import SHUTTING_DOWN_MESSAGE, EndCause, FinishReason, ForwardMode, TokenOut
from pyserve.io_struct import TokenizedGenerateReq
from pyserve.mem_cache.kv_cache import KVCache
from pyserve.metrics import RequestMetrics

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns the requests (`state`) and the loop that plans (`planner`), launches and
    processes (`pipeline`) steps; KV is given back by the `retractor`, grammars wait in the
    `grammar_queue` (see the module docstring)."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCache,
        worker: ModelWorker,
        emit: Callable[[list[TokenOut]], None],
        grammar_backend: GrammarBackend | None = None,
        metrics: RequestMetrics | None = None,
    ) -> None:
        """config: the flags it runs by (SchedulerConfig.from_server_args). emit: hands each
        step's TokenOuts on (the detokenizer's queue). grammar_backend: compiles the grammars
        of structured-output requests (None: refused earlier). metrics: the request
        histograms to fill (--enable-metrics), or None. Raises ValueError for an unknown
        schedule policy."""
        self.config = config
        self.kv_cache = kv_cache
        self.worker = worker
        self.context_len = config.context_len
        self.emit = emit
        # runtime toggles (the tests and `pyserve bench host` change them)
        self.stats_interval_s = config.stats_interval_s
        self.overlap = config.overlap
        policy = SchedulePolicy(config.schedule_policy, kv_cache, seed=config.random_seed)
        new_token_ratio = NewTokenRatio(config.schedule_conservativeness)
        # seeded requests draw from a generator on the model's device
        self.generator_device = config.device
        self.state = ScheduleState(metrics=metrics)
        self.pipeline = StepPipeline(kv_cache, worker, self.state, emit, self._step_done)
        self.retractor = Retractor(
            kv_cache,
            self.state,
            self.pipeline,
            new_token_ratio,
            config.max_running_requests,
            config.enable_priority_scheduling,
            config.low_priority_values_first,
            config.preemption_threshold,
        )
        self.planner = BatchPlanner(
            kv_cache,
            self.state,
            self.pipeline,
            self.retractor,
            new_token_ratio,
            policy,
            config.max_running_requests,
            config.max_prefill_tokens,
            config.chunked_prefill_size,
            config.enable_mixed_chunk,
        )
        # requests whose grammar compiles; they join `waiting` once it is ready
        self.grammar_queue = GrammarQueue(
            grammar_backend,
            config.grammar_compile_timeout_s,
            self._admit_compiled,
            lambda req, reason: self.end(req.rid, reason),
        )
        self._failure: BaseException | None = None  # a bug in a step-done callback
        self._wake = asyncio.Event()
        self._stopping = False
        self.last_gen_throughput = 0.0  # output tokens/s over the last stats interval
        self._last_stats = (time.monotonic(), 0)
        self._last_retracted = 0  # retractions when the last stats line was written

    # ---- what the engine, the server info and the tests read ---------------------------------
    @property
    def waiting(self) -> deque[Req]:
        return self.state.waiting

    @property
    def running(self) -> list[Req]:
        return self.state.running

    @property
    def reqs(self) -> dict[str, Req]:
        return self.state.reqs

    @property
    def chunked_req(self) -> Req | None:
        return self.state.chunked_req

    @property
    def inflight(self) -> deque[Launched]:
        return self.pipeline.inflight

    @property
    def num_steps(self) -> int:
        return self.pipeline.num_steps

    @property
    def num_generated_tokens(self) -> int:
        return self.pipeline.num_generated_tokens

    @property
    def chunked_prefill_size(self) -> int | None:
        return self.planner.chunked_prefill_size

    @property
    def enable_mixed_chunk(self) -> bool:
        return self.planner.enable_mixed_chunk

    @property
    def enable_priority_scheduling(self) -> bool:
        return self.retractor.enable_priority_scheduling

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
        if treq.arrival_time is not None:
            req.arrival_time = treq.arrival_time
        self.state.reqs[req.rid] = req
        grammar = sp.grammar_key
        if grammar is not None:  # it waits for its grammar; nothing else does
            self.grammar_queue.add(req, GrammarKey(*grammar, think=treq.grammar_think))
            return
        # max_new_tokens 0 still prefills, as in SGLang: the prompt's KV enters the radix
        # cache (clients send such requests to cache a prefix) and prompt logprobs are
        # computed; the token sampled after it is dropped.
        self.state.waiting.append(req)
        self._wake.set()

    def end(self, rid: str, reason: FinishReason, emit: bool = True) -> None:
        """End request `rid` now with `reason` (an abort with its `EndCause`, or the stop string
        the detokenizer matched). Its KV is released once no step in flight holds it; tokens
        computed meanwhile are dropped. emit: its consumer is told (a last TokenOut); False:
        nobody listens (`TokenizerManager.forget`), so nothing of it is emitted or
        detokenized. Unknown or finished rids are ignored."""
        req = self.state.reqs.get(rid)
        if req is None or req.finished:
            return
        if req.admission is None:  # not admitted (waiting, or its grammar compiles or failed)
            req.finish_reason = reason
            if self.grammar_queue.remove(rid) is None and req in self.state.waiting:
                self.state.waiting.remove(req)
            self.state.forget(req)
        else:  # its KV goes once no step holds it
            self.pipeline.end(req, reason)
        if emit:
            self.emit([token_out(req)])
        self._wake.set()

    def pause_request(self, rid: str, paused: bool) -> None:
        """Pause (True) or resume a running request: a paused one is left out of decode steps
        and keeps its KV and row (its streaming client is behind, so tokens made now would
        only queue; see server/asgi_writer.py). A prefill under way finishes first; a step in
        flight may still give it one token. Unknown or finished rids are ignored."""
        req = self.state.reqs.get(rid)
        if req is None or req.finished or req.paused == paused:
            return
        req.paused = paused
        if not paused:
            self._wake.set()  # the pipeline may be empty: every running request was paused

    def num_paused(self) -> int:
        """Running or retracted requests paused for a client that is behind."""
        return sum(r.paused for r in self.state.reqs.values())

    def priority_of(self, priority: int | None) -> int:
        """A request's priority as the scheduler keeps it (`Retractor.priority_of`)."""
        return self.retractor.priority_of(priority)

    def bump_for(self, priority: int) -> bool:
        """Queue full, a request of `priority` arrives: with priority scheduling, if it is
        strictly more urgent than the least urgent waiting request (the newest of equals),
        that one ends (EndCause.BUMPED: its consumer is told) and True lets the new one in."""
        victim = self.retractor.bumped_by(priority)
        if victim is None:
            return False
        self.end(
            victim.rid,
            FinishReason.abort(EndCause.BUMPED, "the request was let go from the full queue for a more urgent one"),
        )
        return True

    @property
    def accepts_grammars(self) -> bool:
        """Whether requests with a grammar are served (a grammar backend is configured)."""
        return self.grammar_queue.backend is not None

    def _admit_compiled(self, req: Req) -> None:
        """The grammar queue has the request's grammar: it waits for admission now."""
        req.queue_start = time.perf_counter()
        self.state.waiting.append(req)
        self._wake.set()

    def flush_cache(self) -> bool:
        """Empty the radix cache (every cached prefix's KV is freed). Only while no request
        is queued, admitted or in a step; returns False, changing nothing, otherwise."""
        if not self.is_idle() or self.kv_cache.num_reqs() != 0:
            return False
        self.kv_cache.reset()
        return True

    def is_idle(self) -> bool:
        state = self.state
        return (
            not state.waiting
            and not state.running
            and not self.pipeline.inflight
            and state.chunked_req is None
            and not self.grammar_queue
        )

    def load(self) -> int:
        """SGLang's load figure: KV slots held by admitted requests (neither free nor
        evictable) plus the prompt tokens of the waiting ones."""
        kv = self.kv_cache
        held = kv.max_total_tokens - kv.free_slots() - kv.evictable_slots()
        return held + sum(len(r.origin_input_ids) for r in self.state.waiting)

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
        inflight = self.pipeline.inflight
        while not self._stopping:
            if not inflight:
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
        while inflight:  # let the worker finish what it has before we go
            with contextlib.suppress(Exception):
                await inflight.popleft().future
        state = self.state
        chunked = [state.chunked_req] if state.chunked_req is not None else []
        for req in list(state.waiting) + state.running + chunked + self.grammar_queue.take_all():
            if not req.finished:
                req.finish_reason = FinishReason.abort(EndCause.STOPPED, SHUTTING_DOWN_MESSAGE)
                self.emit([token_out(req)])

    def _pump(self) -> None:
        """Launch steps until the pipeline is full (two in flight with overlap: the next is
        planned while one runs; a third behind a prefill, `_room_behind_prefill`; one
        without) or nothing can run yet. Loop thread."""
        pipeline = self.pipeline
        depth = 2 if self.overlap else 1
        while not self._stopping:
            pipeline.release_finished()
            self._maybe_log_stats()
            if len(pipeline.inflight) >= depth and not self._room_behind_prefill():
                return
            batch = None if pipeline.need_drain else self.planner.next_batch()
            if batch is not None:
                pipeline.launch(batch)
                continue
            if pipeline.inflight:  # nothing to plan until a step in flight ends
                return
            drained, pipeline.need_drain = pipeline.need_drain, False
            if drained:  # every token in flight is known now: plan again (maybe retract)
                continue
            pipeline.send_released_rows()
            return

    def _room_behind_prefill(self) -> bool:
        """With overlap, whether a third step may follow the two in flight: yes when the newer
        is a prefill of requests in no other step (no decode rows, no chunk continued). Then
        no request is in two unprocessed steps yet, so planning the next one now keeps the
        one-step-late bound, and the device, done with the short prefill, need not wait for
        the older step's results to be processed first. At most three in flight."""
        inflight = self.pipeline.inflight
        if not self.overlap or len(inflight) != 2:
            return False
        newer = inflight[-1].batch
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
            self.pipeline.process_done_steps()
            self._pump()
        except BaseException as exc:
            self._failure = exc
            self._wake.set()
            raise

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        last_t, last_n = self._last_stats
        if now - last_t < self.stats_interval_s:
            return
        num_generated = self.pipeline.num_generated_tokens
        self._last_stats = (now, num_generated)
        self.last_gen_throughput = (num_generated - last_n) / (now - last_t)
        if self.is_idle() and num_generated == last_n:
            return
        kv = self.kv_cache
        total, cached = kv.max_total_tokens, kv.evictable_slots()
        used = total - kv.free_slots() - cached
        logger.info(
            "running=%d (paused %d) queued=%d kv_used=%d/%d (%.1f%%) kv_cached=%d gen_throughput=%.1f tok/s",
            len(self.state.running),
            self.num_paused(),
            len(self.state.waiting),
            used,
            total,
            100.0 * used / total,
            cached,
            self.last_gen_throughput,
        )
        retracted = self.retractor.num_retracted - self._last_retracted
        if retracted:
            self._last_retracted += retracted
            logger.warning(
                "KV pool full: %d retractions in the last %.0f s (requests sent back to wait and "
                "prefilled again); a larger --max-total-tokens or a lower --max-running-requests avoids them",
                retracted,
                now - last_t,
            )
