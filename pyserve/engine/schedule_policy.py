"""Which waiting requests join the next prefill batch (`PrefillAdder`), first come first served,
and where a long prompt is cut into chunks (chunked prefill).

Admission reserves KV for each running request's remaining output, clipped at
`CLIP_MAX_NEW_TOKENS` like SGLang's estimate, so a full pool is rare; when it still happens the
scheduler retracts a request (see Scheduler._retract). A request whose prompt is being
prefilled in chunks keeps its whole remaining prompt and output reserved, so chunking never
admits more than prefilling whole prompts would.

Chunked prefill (SGLang's `--chunked-prefill-size`): an extend batch computes at most
`chunk_size` new tokens. A request whose remaining prompt does not fit in what is left of it
is cut at a page boundary and becomes the batch's chunked request (one at a time, as in
SGLang); nothing more is admitted behind it. Each later batch first continues it
(`add_chunked`): the tokens its chunks stored are inserted into the radix cache
(`cache_unfinished_req`, so a request arriving meanwhile can share them) and the next chunk
extends them.
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
    """Admits requests from the head of `waiting` while the token budget, the chunk budget,
    the running-request limit and the KV pool (free + evictable, minus reservations) allow.

    chunk_size: tokens one extend batch computes at most (None: no chunking); chunked_req: the
    request whose prompt the previous batches left unfinished (continued first). After
    admission, `chunked_req` is the request this batch leaves unfinished (or None) and each
    admitted request's `extend_end` says where its part of this batch ends.
    """

    def __init__(self, kv_cache: KVCache, running: list[Req], max_running_requests: int,
                 max_prefill_tokens: int, chunk_size: int | None = None,
                 chunked_req: Req | None = None) -> None:
        self.kv_cache = kv_cache
        self.num_running = len(running)
        self.max_running_requests = max_running_requests
        self.prefill_budget = max_prefill_tokens
        self.chunk_budget = chunk_size
        self.reserved = sum(reserved_tokens(r) for r in running if not r.finished)
        self.admitted: list[Req] = []
        self.chunked_req: Req | None = None
        if chunked_req is not None:
            self._continue(chunked_req)

    def admit_from(self, waiting: deque[Req]) -> list[Req]:
        while waiting and self.chunked_req is None:
            if self.num_running + len(self.admitted) >= self.max_running_requests:
                break
            if not self._try_admit(waiting[0]):
                break
            waiting.popleft()
        return self.admitted

    def _continue(self, req: Req) -> None:
        """Plan the next chunk of `req` (admitted, its prompt partly prefilled): cache what
        its chunks stored, then take as much of the rest as the chunk budget allows."""
        assert req.req_id is not None
        kv_len = self.kv_cache.kv_len(req.req_id)
        fill_ids = req.fill_ids()
        self.kv_cache.cache_unfinished_req(req.req_id, fill_ids[:kv_len])
        req.prefix_len = kv_len  # the stored tokens: the next chunk starts after them
        remaining = len(fill_ids) - kv_len
        # the rest of its prompt and its output stay reserved
        self._take(req, remaining, remaining + reserved_tokens(req) + self.kv_cache.page_size - 1)

    def _take(self, req: Req, extend_len: int, need: int) -> None:
        """Admit `req` into the batch with the part of its `extend_len` new tokens that fits
        the chunk budget (all of them, or a page-aligned chunk), `need` tokens reserved."""
        chunk = self._chunk_len(extend_len)
        req.extend_end = req.prefix_len + chunk if chunk < extend_len else None
        if chunk < extend_len:
            self.chunked_req = req
        self.reserved += need
        self.prefill_budget -= chunk
        if self.chunk_budget is not None:
            self.chunk_budget -= chunk
        self.admitted.append(req)

    def _chunk_len(self, extend_len: int) -> int:
        """How many of `extend_len` new tokens fit what is left of the chunk budget: all of
        them, or a page-aligned part (0 when not one page is left)."""
        if self.chunk_budget is None or extend_len <= self.chunk_budget:
            return extend_len
        page = self.kv_cache.page_size
        return self.chunk_budget // page * page

    def _try_admit(self, req: Req) -> bool:
        fill_ids = req.fill_ids()
        # Keep at least one token to compute (its logits give the next token), and every
        # token whose prompt logprob was asked for. Admission matches and locks in one Rust
        # call; a request that then does not fit is let go.
        admitted = self.kv_cache.admit(fill_ids[:req.max_prefix_len()])
        if admitted is None:
            return False
        extend_len = len(fill_ids) - admitted.prefix_len
        chunk = self._chunk_len(extend_len)
        # A partly used last page costs a whole page; a chunked prompt reserves all of it.
        need = extend_len + reserved_tokens(req) + self.kv_cache.page_size - 1
        too_big = extend_len > self.prefill_budget or chunk == 0 or (chunk < extend_len and not req.can_chunk())
        if (self.admitted and too_big) or need > self.kv_cache.available_size() - self.reserved:
            self.kv_cache.abort_req(admitted.req_id)
            return False
        req.req_id = admitted.req_id
        req.prefix_len = admitted.prefix_len
        if req.num_retractions == 0:
            req.cached_tokens = admitted.prefix_len
        if req.can_chunk():
            self._take(req, extend_len, need)
        else:  # prompt logprobs: one extend step, however long
            self.reserved += need
            self.prefill_budget -= extend_len
            if self.chunk_budget is not None:
                self.chunk_budget = max(0, self.chunk_budget - extend_len)
            req.extend_end = None
            self.admitted.append(req)
        return True
