"""`BatchPlanner`: what the next step runs (DESIGN.md section 3, step 3). Loop thread only.

SGLang's prefill-first order: a prefill (EXTEND) step of waiting requests if any are
admitted, else one DECODE step of the running requests. It owns admission: the waiting
queue's order (`SchedulePolicy`, then priority through the `Retractor`), `PrefillAdder`
rounds under the new-token ratio (which decays here, once per decode step planned), chunked
prefill's turn-taking (a prompt cut into chunks alternates with the running requests'
decode steps, or with `enable_mixed_chunk` carries their decode tokens in its own steps:
SGLang's mixed chunk) and in-batch prompt sharing (`_share_prompts`). When a decode step
finds no KV even after eviction, or a more urgent request may preempt, it asks the
`Retractor`, once the steps in flight are drained (the step pipeline's drain flag).
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from pyserve.engine.retraction import Retractor
from pyserve.engine.schedule_batch import Req, ScheduleBatch, decodable
from pyserve.engine.schedule_policy import NewTokenRatio, PrefillAdder, SchedulePolicy
from pyserve.engine.schedule_state import ScheduleState
from pyserve.engine.step_pipeline import StepPipeline
from pyserve.mem_cache.kv_cache import Admission, KVCache

_REQ_ID = attrgetter("admission.req_id")  # (a decode plan's pass over its requests runs in C)


class BatchPlanner:
    """Plans the next step's batch (see the module docstring).

    chunked_prefill_size: new tokens one extend step computes at most (None: prompts are
    never cut). Mutates `state` (admitted requests leave `waiting`; the chunked request) and
    the KV cache (admission, the steps' slots); plans carry the pipeline's released rows.
    """

    def __init__(
        self,
        kv_cache: KVCache,
        state: ScheduleState,
        pipeline: StepPipeline,
        retractor: Retractor,
        new_token_ratio: NewTokenRatio,
        policy: SchedulePolicy,
        max_running_requests: int,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None = None,
        enable_mixed_chunk: bool = False,
    ) -> None:
        self.kv_cache = kv_cache
        self.state = state
        self.pipeline = pipeline
        self.retractor = retractor
        self.new_token_ratio = new_token_ratio
        self.policy = policy
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size  # None: prompts are never cut
        self._decode_turn = False  # while a prompt is chunked: a decode step goes next
        # prefill steps carry the running requests' decode tokens too (SGLang's mixed chunk)
        self.enable_mixed_chunk = enable_mixed_chunk

    def next_batch(self) -> ScheduleBatch | None:
        """The next step: a prefill (EXTEND) of admitted waiting requests if any fit (SGLang's
        prefill-first order), else the running requests' DECODE step, or None."""
        state = self.state
        chunked = state.chunked_req
        if chunked is not None and chunked.finished:  # aborted mid-prefill: released as usual
            state.chunked_req = chunked = None
        if chunked is not None and self._decode_turn and state.running and not self.enable_mixed_chunk:
            # a long prompt being chunked must not stop the running streams: its chunks and
            # decode steps take turns
            self._decode_turn = False
            batch = self._decode_batch()
            if batch is not None or self.pipeline.need_drain:
                return batch
        priority = self.retractor.enable_priority_scheduling
        # a full batch admits nothing (unless a more urgent request may preempt): skip the
        # ordering and the admission pass, which cost O(waiting + running) per step
        full = chunked is None and not priority and len(state.running) >= self.max_running_requests
        if (state.waiting and not full) or chunked is not None:
            self._order_waiting()
            adder = self._prefill_adder(chunked)
            admitted = adder.admit_from(state.waiting)
            if (
                not admitted
                and priority
                and state.waiting
                and chunked is None
                and self.retractor.preempt_for(state.waiting[0])
            ):
                self._order_waiting()  # the preempted wait behind it again
                adder = self._prefill_adder(None)
                admitted = adder.admit_from(state.waiting)
            if self.pipeline.need_drain and not admitted:
                return None
            state.chunked_req = adder.chunked_req
            self._decode_turn = state.chunked_req is not None
            if admitted:
                batch = self._extend_batch(admitted, self._mixed_decodes(admitted))
                if batch is not None:
                    self._share_prompts([r for r in admitted if id(r) in adder.leaders], batch.partial)
                    return batch
        if state.running:
            return self._decode_batch()
        return None

    def _prefill_adder(self, chunked: Req | None) -> PrefillAdder:
        return PrefillAdder(
            self.kv_cache,
            self.state.running,
            self.max_running_requests,
            self.max_prefill_tokens,
            self.chunked_prefill_size,
            chunked,
            self.new_token_ratio.value,
        )

    def _order_waiting(self) -> None:
        self.policy.order(self.state.waiting)
        self.retractor.order_by_priority()

    def _share_prompts(self, leaders: list[Req], partial: Req | None) -> None:
        """Put the prompts of `leaders` (admitted requests a waiting twin shares a prompt head
        with) into the radix cache now, so the twin reuses them next round: their KV is
        computed by the step just planned, which runs before any step of the twin. Skipped
        when the cache holds more of the prompt than the request locked (another request
        computed it meanwhile): caching would then swap the request's pages for the cache's
        under the worker's row. A chunk in progress is cached when its next chunk is planned."""
        for req in leaders:
            admission = req.admission
            if req is partial or admission is None:
                continue
            kv_len = self.kv_cache.kv_len(admission.req_id)
            stored = req.fill_ids()[:kv_len]
            if int(self.kv_cache.match_lens([stored])[0]) > admission.prefix_len:
                continue
            self.kv_cache.cache_unfinished_req(admission.req_id, stored)

    def _mixed_decodes(self, admitted: list[Req]) -> list[Req]:
        """The running requests that decode inside this prefill step (mixed chunk): all that
        can, unless logprobs are wanted by any (as SGLang, which does not mix them)."""
        running = self.state.running
        if not self.enable_mixed_chunk or not running:
            return []
        decodes = decodable(running)
        if any(r.logprob.return_logprob for r in decodes) or any(r.logprob.return_logprob for r in admitted):
            return []
        return decodes

    def _extend_batch(self, reqs: list[Req], decodes: list[Req] | None = None) -> ScheduleBatch | None:
        """The EXTEND step of `reqs` (each up to its `extend_end`) with `decodes` decoding one
        token each in it, or None, putting `reqs` back to wait, when their pages do not fit
        after all (without `decodes` first)."""
        decodes = decodes or []
        held = [_admission(r) for r in reqs]
        fill = [r.fill_ids() for r in reqs]
        fill = [f if a.extend_end is None else f[: a.extend_end] for f, a in zip(fill, held)]
        extend_lens = [len(f) - a.prefix_len for f, a in zip(fill, held)]
        ids = [a.req_id for a in held]
        arrays = self.kv_cache.prepare_extend(
            ids + [_admission(r).req_id for r in decodes], extend_lens + [1] * len(decodes)
        )
        if arrays is None and decodes:
            decodes = []
            arrays = self.kv_cache.prepare_extend(ids, extend_lens)
        state = self.state
        if arrays is None:  # admission raced with reservations: put them back
            for req in reversed(reqs):
                if _admission(req).prefix_len > req.cached_tokens:  # a chunked one: its own chunks are
                    req.num_retractions += 1  # not what it found cached at admission
                self._unadmit(req)
                state.waiting.appendleft(req)
            state.chunked_req = None  # a chunked one resumes from its cached chunks
            return None
        partial = state.chunked_req if state.chunked_req in reqs else None
        pipeline = self.pipeline
        return ScheduleBatch.extend(
            reqs, fill, arrays, pipeline.take_released_rows(), pipeline.num_steps, partial, decodes
        )

    def _decode_batch(self) -> ScheduleBatch | None:
        pipeline = self.pipeline
        while True:
            reqs = decodable(self.state.running)
            if not reqs:
                return None
            req_ids = np.fromiter(map(_REQ_ID, reqs), dtype=np.int64, count=len(reqs))
            arrays = self.kv_cache.prepare_decode(req_ids)
            if arrays is not None:
                self.new_token_ratio.decay()
                return ScheduleBatch.decode(reqs, arrays, pipeline.take_released_rows(), pipeline.num_steps)
            if pipeline.inflight:  # retract only once every token in flight is known
                pipeline.need_drain = True
                return None
            self.retractor.retract()

    def _unadmit(self, req: Req) -> None:
        """Free what `req` holds (no step ran it: the worker's tables never saw its row)."""
        self.kv_cache.release(req, None)


def _admission(req: Req) -> Admission:
    """An admitted request's hold on the KV core (set at admission, None once released)."""
    assert req.admission is not None
    return req.admission
