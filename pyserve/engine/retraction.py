"""`Retractor`: giving KV back. Retraction when a decode step cannot get its slots, priority
preemption, and the priority order of the waiting queue. Loop thread only.

It holds what it reads and moves explicitly: the KV cache, the scheduler's requests
(`ScheduleState`: a retracted request leaves `running` or `chunked_req` for the head of
`waiting`), the step pipeline (steps in flight, released rows, ending a request) and the
new-token ratio it raises.

Retraction follows SGLang's rule: a prompt still being prefilled in chunks goes first (it has
no output yet), then the running request with the fewest output tokens (of those, the
longest prompt). A retracted request's stored tokens go to the radix cache (unlocked:
eviction may take them), so it resumes by prefilling only what was evicted; the new-token
ratio is set to SGLang's new estimate. Priority preemption (SGLang 0.5.6's rules): a waiting
request more than the threshold more urgent retracts the least urgent running requests (the
newest first among equals), and only when they free enough room.
"""

from __future__ import annotations

import logging

from pyserve.engine.schedule_batch import Req
from pyserve.engine.schedule_policy import NewTokenRatio, reserved_tokens, span_tokens
from pyserve.engine.schedule_state import ScheduleState
from pyserve.engine.step_pipeline import StepPipeline, token_out
from pyserve.forward_batch_info import FinishReason
from pyserve.mem_cache.kv_cache import KVCache

logger = logging.getLogger("pyserve.engine.scheduler")

# SGLang's steps of headroom in the new estimate after a retraction
RETRACT_DECODE_STEPS = 20
# the priority of a request that gives none under priority scheduling (SGLang's values)
LEAST_URGENT = -(2**63)
LEAST_URGENT_LOW_FIRST = 2**63 - 1


class Retractor:
    """Retraction, priority order and priority preemption (see the module docstring).

    enable_priority_scheduling: requests carry a priority (else every request is equal);
    low_priority_values_first: smaller values are more urgent; preemption_threshold: how much
    more urgent a waiting request must be to preempt a running one.
    """

    def __init__(
        self,
        kv_cache: KVCache,
        state: ScheduleState,
        pipeline: StepPipeline,
        new_token_ratio: NewTokenRatio,
        max_running_requests: int,
        enable_priority_scheduling: bool = False,
        low_priority_values_first: bool = False,
        preemption_threshold: int = 10,
    ) -> None:
        self.kv_cache = kv_cache
        self.state = state
        self.pipeline = pipeline
        self.new_token_ratio = new_token_ratio
        self.max_running_requests = max_running_requests
        self.enable_priority_scheduling = enable_priority_scheduling
        self.low_priority_values_first = low_priority_values_first
        self.preemption_threshold = preemption_threshold
        # retractions since start (the scheduler's stats line sums them up per interval)
        self.num_retracted = 0

    def retract(self) -> None:
        """The pool is full even after eviction: send a request back to the waiting queue,
        a paused one first, then by SGLang's rule the one with the fewest output tokens (of
        those, the longest prompt);
        its computed tokens go to the radix cache, so it resumes by prefilling only what was
        evicted meanwhile. A lone request cannot be helped by retraction: it finishes with
        reason length. Only with no step in flight."""
        chunked = self.state.chunked_req
        if chunked is not None and not chunked.finished:
            # a prompt being prefilled in chunks has no output yet (the first pick of
            # SGLang's rule) and holds its chunks: it goes back, they stay cached
            self.send_back(chunked)
            self.num_retracted += 1
            logger.debug(
                "KV pool full: retracted the prefill of request %s (%d tokens so far)",
                chunked.rid,
                len(chunked.origin_input_ids),
            )
            return
        live = [r for r in self.state.running if not r.finished]
        if len(live) == 1:
            self.pipeline.end(live[0], FinishReason.length_limit(len(live[0].output_ids)))
            self.pipeline.emit([token_out(live[0])])
            self.pipeline.release_finished()
            return
        # a paused request first (its client is behind: nobody waits for its tokens)
        req = min(reversed(live), key=lambda r: (not r.paused, len(r.output_ids), -len(r.origin_input_ids)))
        self.send_back(req)
        # SGLang's new estimate: what the rest decoded so far plus a few more steps each,
        # over what they may still decode in all
        rest = [r for r in self.state.running if not r.finished]
        total_max = sum(r.max_new_tokens for r in rest)
        if total_max:
            decoded = sum(len(r.output_ids) for r in rest)
            self.new_token_ratio.value = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(rest)) / total_max)
        self.num_retracted += 1
        logger.debug("KV pool full: retracted request %s (%d tokens so far)", req.rid, req.seq_len)

    def send_back(self, req: Req) -> None:
        """Retract a running request, or the one whose prompt is being prefilled in chunks
        (no step in flight holds it): its stored tokens are cached (unlocked: eviction may
        take them), its row and sampling row are released, and it waits again at the head of
        the queue with its output so far (its cached_tokens stays what it found at first)."""
        state = self.state
        if req is state.chunked_req:
            state.chunked_req = None
        else:
            state.running.remove(req)
        row = self.kv_cache.release(req, None if req.kv_invalid else req.kv_token_ids)
        self.pipeline.released_rows.append(row)
        req.num_planned = len(req.output_ids)
        req.num_retractions += 1
        state.waiting.appendleft(req)

    def _urgency(self, req: Req) -> int:
        """Larger runs first (priority scheduling)."""
        return req.priority if not self.low_priority_values_first else -req.priority

    def priority_of(self, priority: int | None) -> int:
        """A request's priority as the scheduler keeps it: 0 with priority scheduling off;
        with it on, None is the least urgent value there is (as in SGLang)."""
        if not self.enable_priority_scheduling:
            return 0
        if priority is None:
            return LEAST_URGENT_LOW_FIRST if self.low_priority_values_first else LEAST_URGENT
        return priority

    def bumped_by(self, priority: int) -> Req | None:
        """Queue full, a request of `priority` arrives: with priority scheduling, the least
        urgent waiting request (the newest of equals) if the new one is strictly more urgent
        (the scheduler lets it go for the new one), else None."""
        if not self.enable_priority_scheduling or not self.state.waiting:
            return None
        urgency = priority if not self.low_priority_values_first else -priority
        candidates = list(self.state.waiting)
        victim = min(reversed(candidates), key=self._urgency)
        if urgency <= self._urgency(victim):
            return None
        return victim

    def order_by_priority(self) -> None:
        """Reorder the waiting queue (already in the policy's order) by urgency."""
        if self.enable_priority_scheduling:  # priority first, the policy's order within it
            waiting = self.state.waiting
            ordered = sorted(waiting, key=lambda r: -self._urgency(r))
            waiting.clear()
            waiting.extend(ordered)

    def preempt_for(self, head: Req) -> bool:
        """Priority scheduling: retract running requests at least `preemption_threshold`
        less urgent than the waiting `head` (least urgent first, then the newest) until it
        has a row and its KV fits. True if it now fits; with steps in flight, asks for a
        drain first (their KV is being written) and returns False."""
        running = self.state.running
        victims = sorted(
            (
                r
                for r in reversed(running)
                if not r.finished  # newest first
                and self._urgency(head) - self._urgency(r) > self.preemption_threshold
            ),
            key=self._urgency,
        )
        if not victims:
            return False
        kv = self.kv_cache
        # as SGLang: preempt only when the victims (least urgent first) free enough
        short = span_tokens(
            int(kv.match_lens([head.prefix_key()])[0]), head.seq_len + reserved_tokens(head), kv.page_size
        ) - (kv.available_size() - self._reserved())
        rows_short = len(running) + 1 > self.max_running_requests or kv.free_req_rows() <= 1
        chosen: list[Req] = []
        for victim in victims:
            if short <= 0 and not rows_short:
                break
            chosen.append(victim)
            rows_short = False
            assert victim.admission is not None  # running requests hold their KV
            short -= self.kv_cache.kv_len(victim.admission.req_id) + int(
                reserved_tokens(victim) * self.new_token_ratio.value
            )
        if not chosen or short > 0:
            return False
        if self.pipeline.inflight:  # their KV is being written: drain first, decide again then
            self.pipeline.need_drain = True
            return False
        for victim in chosen:
            self.send_back(victim)
            logger.info(
                "preempted request %s (priority %d) for %s (priority %d)",
                victim.rid,
                victim.priority,
                head.rid,
                head.priority,
            )
        return True

    def _reserved(self) -> int:
        """KV kept for the running requests' future tokens (as PrefillAdder counts it)."""
        return int(sum(reserved_tokens(r) for r in self.state.running if not r.finished) * self.new_token_ratio.value)
