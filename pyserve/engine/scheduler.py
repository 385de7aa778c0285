"""The scheduler task: continuous batching over the Rust KV core, one step at a time.

Each tick: drop finished/aborted requests (their KV goes to the radix cache or back to the
allocator), admit waiting requests into a prefill (EXTEND) batch if any fit, else run one
DECODE step for all running requests. The step runs on the worker thread; while it runs the
loop serves HTTP, tokenizes and detokenizes. Loop thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from pyserve.engine.schedule_batch import Req, ScheduleBatch
from pyserve.engine.schedule_policy import PrefillAdder
from pyserve.engine.worker import ModelWorker
from pyserve.io_struct import TokenizedGenerateReq
from pyserve.mem_cache.kv_cache import KVCache
from pyserve.model_executor.forward_batch import ForwardMode, StepOutput, TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass
class TokenOut:
    """New token ids of one request after one step (to the detokenizer), with their logprobs
    (output_logprobs: one entry per id of ids_delta) and, once, the prompt's (input_logprobs
    with the prompt ids they are about, input_logprob_ids) when the request asked."""

    rid: str
    ids_delta: list[int]
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    cached_tokens: int
    output_logprobs: TokenLogprobs | None = None
    input_logprobs: TokenLogprobs | None = None
    input_logprob_ids: list[int] | None = None


class Scheduler:
    """Owns the waiting queue, the running requests and the KV bookkeeping."""

    def __init__(self, kv_cache: KVCache, worker: ModelWorker, device: str, context_len: int,
                 max_running_requests: int, max_prefill_tokens: int,
                 emit: Callable[[list[TokenOut]], None], stats_interval_s: float = 10.0) -> None:
        self.kv_cache = kv_cache
        self.worker = worker
        self.device = device
        self.context_len = context_len
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.emit = emit
        self.stats_interval_s = stats_interval_s
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.reqs: dict[str, Req] = {}
        self._wake = asyncio.Event()
        self._stopping = False
        self.num_generated_tokens = 0
        self.last_gen_throughput = 0.0  # output tokens/s over the last stats interval
        self._last_stats = (time.monotonic(), 0)

    # ---- called by the tokenizer manager / detokenizer (loop thread) ------------------------
    def add_request(self, treq: TokenizedGenerateReq) -> None:
        sp = treq.sampling_params
        # A request must fit alone in both the context and the KV pool.
        room = min(self.context_len, self.kv_cache.max_total_tokens) - len(treq.input_ids)
        max_new = room if sp.max_new_tokens is None else min(sp.max_new_tokens, room)
        req = Req(treq.rid, treq.input_ids, sp, max_new, treq.stop_token_ids, treq.logprob)
        self.reqs[req.rid] = req
        # max_new_tokens 0 still prefills, as in SGLang: the prompt's KV enters the radix
        # cache (clients send such requests to cache a prefix) and prompt logprobs are
        # computed; the token sampled after it is dropped.
        self.waiting.append(req)
        self._wake.set()

    def finish_request(self, rid: str, finish_reason: dict[str, Any]) -> None:
        """End a request now (client gone, or a stop string matched). Its KV is released at
        the next tick; tokens computed meanwhile are dropped. Unknown rids are ignored."""
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return
        req.finish_reason = finish_reason
        if req.req_id is None:  # still waiting: nothing allocated
            self.waiting.remove(req)
            self._finish(req, emit=True)
        else:  # its KV goes at the next tick; the consumer hears of the end now
            self.emit([self._out(req, [])])
        self._wake.set()

    def flush_cache(self) -> bool:
        """Empty the radix cache (every cached prefix's KV is freed). Only while no request
        is queued, admitted or in a step; returns False, changing nothing, otherwise."""
        if not self.is_idle() or self.kv_cache.num_reqs() != 0:
            return False
        self.kv_cache.reset()
        return True

    def is_idle(self) -> bool:
        return not self.waiting and not self.running

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
        while not self._stopping:
            self._release_finished()
            self._maybe_log_stats()
            batch = self._get_next_batch()
            if batch is None:
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):  # wake up for the stats line
                    await asyncio.wait_for(self._wake.wait(), timeout=self.stats_interval_s)
                continue
            try:
                next_ids = await self.worker.submit(batch.to_forward_batch(self.device))
            except Exception as exc:
                for req in batch.reqs:
                    req.kv_len = len(req.fill_ids()) if batch.forward_mode is ForwardMode.EXTEND else req.kv_len + 1
                    if not req.finished:
                        # status_code: a server-side failure, not the client's (HTTP 500)
                        req.finish_reason = {"type": "abort", "message": f"model step failed: {exc}",
                                             "status_code": 500}
                        self.emit([self._out(req, [])])
                self._join_running(batch)
                continue
            self._process_batch_result(batch, next_ids)
        for req in list(self.waiting) + self.running:
            req.finish_reason = req.finish_reason or {"type": "abort", "message": "server shutting down"}
            self.emit([self._out(req, [])])

    def _get_next_batch(self) -> ScheduleBatch | None:
        if self.waiting:
            adder = PrefillAdder(self.kv_cache, self.running, self.max_running_requests,
                                 self.max_prefill_tokens)
            admitted = adder.admit_from(self.waiting)
            if admitted:
                batch = self._extend_batch(admitted)
                if batch is not None:
                    return batch
        if self.running:
            return self._decode_batch()
        return None

    def _extend_batch(self, reqs: list[Req]) -> ScheduleBatch | None:
        fill = [r.fill_ids() for r in reqs]
        prefix_lens = [r.prefix_len for r in reqs]
        extend_lens = [len(f) - p for f, p in zip(fill, prefix_lens)]
        arrays = self.kv_cache.prepare_extend([r.req_id for r in reqs], extend_lens)
        if arrays is None:  # admission raced with reservations: put them back
            for req in reversed(reqs):
                self._unadmit(req)
                self.waiting.appendleft(req)
            return None
        input_ids = [t for f, p in zip(fill, prefix_lens) for t in f[p:]]
        return ScheduleBatch(ForwardMode.EXTEND, reqs, input_ids, arrays)

    def _decode_batch(self) -> ScheduleBatch | None:
        while self.running:
            reqs = self.running
            arrays = self.kv_cache.prepare_decode([r.req_id for r in reqs])
            if arrays is not None:
                return ScheduleBatch(ForwardMode.DECODE, list(reqs), [r.output_ids[-1] for r in reqs],
                                     arrays)
            self._retract()
        return None

    def _retract(self) -> None:
        """The pool is full even after eviction: send the newest request back to the waiting
        queue, freeing its KV; it resumes later by prefilling prompt + output so far. A lone
        request cannot be helped by retraction: it finishes with reason length."""
        if len(self.running) == 1:
            self.running[0].finish_reason = {"type": "length", "length": len(self.running[0].output_ids)}
            self.emit([self._out(self.running[0], [])])
            self._release_finished()
            return
        req = self.running.pop()
        self.kv_cache.abort_req(req.req_id)
        req.req_id, req.prefix_len, req.kv_len = None, 0, 0
        req.num_retractions += 1
        self.waiting.appendleft(req)
        logger.warning("KV pool full: retracted request %s (%d tokens so far)", req.rid, req.seq_len)

    def _unadmit(self, req: Req) -> None:
        self.kv_cache.abort_req(req.req_id)
        req.req_id, req.prefix_len = None, 0

    def _process_batch_result(self, batch: ScheduleBatch, result: StepOutput) -> None:
        """Append each request's new token, decide who finished, emit TokenOuts."""
        outs = []
        extend = batch.forward_mode is ForwardMode.EXTEND
        failed = set(result.failed_rows) if result.failed_rows else ()
        for i, (req, token) in enumerate(zip(batch.reqs, result.next_token_ids)):
            req.kv_len = len(req.fill_ids()) if extend else req.kv_len + 1
            if req.finished:  # ended while the step ran: drop the extra token
                continue
            if i in failed:  # its own parameters left nothing to sample: it alone fails
                req.finish_reason = {"type": "abort", "status_code": 400, "message": (
                    "the sampling parameters leave no token to sample at output token "
                    f"{len(req.output_ids)} (every logit banned, or a bias or penalty overflowed)")}
                outs.append(self._out(req, []))
                continue
            if req.max_new_tokens == 0:  # a prefill-only request: no output token
                req.finish_reason = {"type": "length", "length": 0}
                token_out = self._out(req, [])
                self._add_input_logprobs(token_out, req, result, i)
                outs.append(token_out)
                continue
            req.output_ids.append(token)
            self.num_generated_tokens += 1
            req.check_finished()
            if not req.finished and req.seq_len >= self.context_len:
                req.finish_reason = {"type": "length", "length": len(req.output_ids)}
            out = self._out(req, [token])
            if result.output_logprobs is not None:
                out.output_logprobs = result.output_logprobs[i]
            self._add_input_logprobs(out, req, result, i)
            outs.append(out)
        self._join_running(batch)
        if outs:
            self.emit(outs)

    @staticmethod
    def _add_input_logprobs(out: TokenOut, req: Req, result: StepOutput, i: int) -> None:
        """Attach row i's prompt logprobs (once per request) to its TokenOut."""
        if result.input_logprobs is not None and result.input_logprobs[i] is not None:
            out.input_logprobs = result.input_logprobs[i]
            out.input_logprob_ids = req.origin_input_ids[req.logprob.logprob_start_len:]
            req.input_logprobs_done = True

    def _join_running(self, batch: ScheduleBatch) -> None:
        if batch.forward_mode is ForwardMode.EXTEND:
            self.running.extend(batch.reqs)

    def _release_finished(self) -> None:
        """Return the KV of finished requests: cached for normal finishes, freed for aborts."""
        if not any(r.finished for r in self.running):
            return
        keep = []
        for req in self.running:
            if not req.finished:
                keep.append(req)
                continue
            if req.finish_reason.get("type") == "abort":
                self.kv_cache.abort_req(req.req_id)
            else:
                self.kv_cache.cache_finished_req(req.req_id, req.kv_token_ids())
            req.req_id = None
            self._finish(req, emit=False)
        self.running = keep

    def _finish(self, req: Req, emit: bool) -> None:
        """Forget a finished request. `emit`: tell the detokenizer (when no step did)."""
        if self.reqs.get(req.rid) is req:  # the rid may already name a newer request
            del self.reqs[req.rid]
        if emit:
            self.emit([self._out(req, [])])

    def _out(self, req: Req, ids: list[int]) -> TokenOut:
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
        logger.info("running=%d queued=%d kv_used=%d/%d (%.1f%%) gen_throughput=%.1f tok/s",
                    len(self.running), len(self.waiting), used, total, 100.0 * used / total,
                    self.last_gen_throughput)
