"""Which waiting requests join the next prefill batch (`PrefillAdder`), first come first served.

Admission reserves KV for each running request's remaining output, clipped at
`CLIP_MAX_NEW_TOKENS` like SGLang's estimate, so a full pool is rare; when it still happens the
scheduler retracts a request (see Scheduler._retract).
"""

from __future__ import annotations

from collections import deque

from pyserve.engine.schedule_batch import Req
from pyserve.mem_cache.kv_cache import KVCache

# Output tokens reserved per request at most when admitting (a guess, not a bound).
CLIP_MAX_NEW_TOKENS = 4096


def reserved_tokens(req: Req) -> int:
    return min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS)


class PrefillAdder:
    """Admits requests from the head of `waiting` while the token budget, the running-request
    limit and the KV pool (free + evictable, minus reservations) allow."""

    def __init__(self, kv_cache: KVCache, running: list[Req], max_running_requests: int,
                 max_prefill_tokens: int) -> None:
        self.kv_cache = kv_cache
        self.num_running = len(running)
        self.max_running_requests = max_running_requests
        self.prefill_budget = max_prefill_tokens
        self.reserved = sum(reserved_tokens(r) for r in running if not r.finished)
        self.admitted: list[Req] = []

    def admit_from(self, waiting: deque[Req]) -> list[Req]:
        while waiting:
            if self.num_running + len(self.admitted) >= self.max_running_requests:
                break
            if not self._try_admit(waiting[0]):
                break
            waiting.popleft()
        return self.admitted

    def _try_admit(self, req: Req) -> bool:
        fill_ids = req.fill_ids()
        # Keep at least one token to compute (its logits give the next token), and every
        # token whose prompt logprob was asked for. Admission matches and locks in one Rust
        # call; a request that then does not fit is let go.
        admitted = self.kv_cache.admit(fill_ids[:req.max_prefix_len()])
        if admitted is None:
            return False
        extend_len = len(fill_ids) - admitted.prefix_len
        # A partly used last page costs a whole page.
        need = extend_len + reserved_tokens(req) + self.kv_cache.page_size - 1
        if ((self.admitted and extend_len > self.prefill_budget)
                or need > self.kv_cache.available_size() - self.reserved):
            self.kv_cache.abort_req(admitted.req_id)
            return False
        req.req_id = admitted.req_id
        req.prefix_len = admitted.prefix_len
        if req.num_retractions == 0:
            req.cached_tokens = admitted.prefix_len
        self.reserved += need
        self.prefill_budget -= extend_len
        self.admitted.append(req)
        return True
