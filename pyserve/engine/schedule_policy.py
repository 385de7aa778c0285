"""Which waiting requests join the next prefill batch: the order of the waiting queue
(`SchedulePolicy`), who is admitted (`PrefillAdder`) against what the running requests keep
reserved (`NewTokenRatio`), and where a long prompt is cut into chunks (chunked prefill).

Policies (SGLang's `--schedule-policy`): `fcfs` keeps arrival order; `lpm` (longest prefix
match) puts the requests with the longest cached prefix first, and falls back to fcfs when
more than `LPM_MAX_WAITING` requests wait (matching them all each round costs too much);
`dfs-weight` orders requests depth-first by the radix tree's branches, heaviest branch first
(rust/core radix_cache/schedule.rs), so requests sharing a cached prefix run together; `lof`
puts the longest max_new_tokens first; `random` shuffles. Matching for the policies changes
nothing in the cache (no split, no LRU refresh).

In-batch prefix sharing (every policy): a waiting request whose cached prefix is shorter than
`IN_BATCH_PREFIX_TOKENS` and whose first `IN_BATCH_PREFIX_TOKENS` tokens equal those of a
request admitted in the same round waits a round (the later requests may still be admitted):
its twin's prompt enters the radix cache as soon as its step is planned (the batch planner's
`_share_prompts`), so the next round it reuses the twin's KV instead of computing it too.
(SGLang's lpm only moves such requests to the back of the queue; the threshold is its
IN_BATCH_PREFIX_CACHING thresholds' value.) In `lpm`, such requests also sort last.

Admission reserves KV for each running request's remaining output, clipped at
`CLIP_MAX_NEW_TOKENS` and scaled by the new-token ratio (`NewTokenRatio`: SGLang's estimate
of the share of max_new_tokens requests really generate; it starts at 0.7 x
--schedule-conservativeness, decays each decode step to 0.14 of that, and is raised again
by a retraction), and for an admitted request its whole clipped max_new_tokens. When decode
still runs out of KV the `Retractor` retracts a request (engine/retraction.py). Admission
matches first without locking (`match_unlocked`), so a request that cannot fit is turned away
without taking and giving back a lock. A request whose prompt is being
prefilled in chunks keeps its whole remaining prompt and output reserved, so chunking never
admits more than prefilling whole prompts would.

Chunked prefill (SGLang's `--chunked-prefill-size`): an extend batch computes at most
`chunk_size` new tokens. A request whose remaining prompt does not fit in what is left of it
is cut at a page boundary and becomes the batch's chunked request (one at a time, as in
SGLang); nothing more is admitted behind it. Each later batch first continues it (a
`PrefillAdder` given `chunked_req`, `_continue`): the tokens its chunks stored are inserted
into the radix cache (`cache_unfinished_req`, so a request arriving meanwhile can share them)
and the next chunk extends them.
"""

from __future__ import annotations

import random
from collections import deque

from pyserve.engine.schedule_batch import Req
from pyserve.mem_cache.kv_cache import KVCache

# Output tokens reserved per request at most when admitting (a guess, not a bound).
CLIP_MAX_NEW_TOKENS = 4096
# SGLang's defaults for the new-token ratio
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
LPM_MAX_WAITING = 128  # SGLang's limit: above it lpm is fcfs
IN_BATCH_PREFIX_TOKENS = 32


def prompt_head(req: Req) -> bytes | None:
    """The first IN_BATCH_PREFIX_TOKENS tokens of `req`'s prefix key (as bytes, a dict key),
    or None when the key is shorter."""
    key = req.prefix_key()
    return key[:IN_BATCH_PREFIX_TOKENS].tobytes() if len(key) >= IN_BATCH_PREFIX_TOKENS else None


class SchedulePolicy:
    """Orders the waiting queue before each admission round (see the module docstring).
    Raises ValueError for an unknown policy name. Loop thread only."""

    def __init__(self, policy: str, kv_cache: KVCache, seed: int | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"schedule policy {policy!r}: expected one of {', '.join(POLICIES)}")
        self.policy = policy
        self.kv_cache = kv_cache
        self.rng = random.Random(seed)

    def order(self, waiting: deque[Req]) -> None:
        """Reorder `waiting` in place (stable: ties keep their order)."""
        policy = self.policy
        if policy == "lpm" and len(waiting) > LPM_MAX_WAITING:
            policy = "fcfs"
        if policy == "fcfs" or len(waiting) < 2:
            return
        reqs = list(waiting)
        if policy == "lof":
            reqs.sort(key=lambda r: -r.max_new_tokens)
        elif policy == "random":
            self.rng.shuffle(reqs)
        elif policy == "lpm":
            lens = self.kv_cache.match_lens([r.prefix_key() for r in reqs]).tolist()
            seen: set[bytes] = set()
            rank = []
            for req, cached in zip(reqs, lens):
                head = prompt_head(req) if cached < IN_BATCH_PREFIX_TOKENS else None
                if head is not None and head in seen:
                    rank.append(float("inf"))  # its twin goes first; it reuses the twin's KV
                    continue
                if head is not None:
                    seen.add(head)
                rank.append(-cached)
            reqs = [reqs[k] for k in sorted(range(len(reqs)), key=rank.__getitem__)]
        else:  # dfs-weight
            order = self.kv_cache.dfs_weight_order([r.prefix_key() for r in reqs]).tolist()
            reqs = [reqs[k] for k in order]
        waiting.clear()
        waiting.extend(reqs)


def reserved_tokens(req: Req) -> int:
    return min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS)


def span_tokens(start: int, end: int, page_size: int) -> int:
    """KV slots a request holding positions 0..start-1 takes to hold up to position end-1:
    the whole pages past those it has (a partly used last page already counts)."""
    return -(-end // page_size) * page_size - -(-start // page_size) * page_size


class NewTokenRatio:
    """SGLang's new-token ratio: the share of running requests' remaining max_new_tokens
    admission reserves (`value`); it decays per decode step (`decay`) from `init_value` to
    `min_value`, and a retraction raises it again (engine/retraction.py). One object, shared
    by the batch planner (decay, admission) and the retractor. Loop thread only."""

    __slots__ = ("init_value", "min_value", "decay_per_step", "value")

    def __init__(self, schedule_conservativeness: float = 1.0) -> None:
        self.init_value = min(INIT_NEW_TOKEN_RATIO * schedule_conservativeness, 1.0)
        self.min_value = min(self.init_value * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.decay_per_step = (self.init_value - self.min_value) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.value = self.init_value

    def decay(self) -> None:
        """A decode step was planned: admission may count on a little less of each running
        request's remaining output being generated."""
        self.value = max(self.value - self.decay_per_step, self.min_value)


class PrefillAdder:
    """Admits requests from the head of `waiting` while the token budget, the chunk budget,
    the running-request limit and the KV pool (free + evictable, minus reservations) allow.

    chunk_size: tokens one extend batch computes at most (None: no chunking); chunked_req: the
    request whose prompt the previous batches left unfinished (continued first). After
    admission, `chunked_req` is the request this batch leaves unfinished (or None) and each
    admitted request's `extend_end` says where its part of this batch ends.
    """

    def __init__(
        self,
        kv_cache: KVCache,
        running: list[Req],
        max_running_requests: int,
        max_prefill_tokens: int,
        chunk_size: int | None = None,
        chunked_req: Req | None = None,
        new_token_ratio: float = 1.0,
    ) -> None:
        self.kv_cache = kv_cache
        self.num_running = len(running)
        self.max_running_requests = max_running_requests
        self.prefill_budget = max_prefill_tokens
        self.chunk_budget = chunk_size
        self.reserved = int(sum(reserved_tokens(r) for r in running if not r.finished) * new_token_ratio)
        self.admitted: list[Req] = []
        self.chunked_req: Req | None = None
        self._heads: dict[bytes, Req] = {}  # prompt heads admitted this round
        self.leaders: set[int] = set()  # ids of admitted requests a twin waits for
        if chunked_req is not None:
            self._continue(chunked_req)

    def admit_from(self, waiting: deque[Req]) -> list[Req]:
        """Admit from the head of `waiting` (removing the admitted) until one does not fit;
        a request whose prompt head a request admitted in this round shares waits a round
        without stopping the others (in-batch prefix sharing), as does a paused one (see
        Scheduler.pause_request). Returns the admitted."""
        skipped: list[Req] = []
        while waiting and self.chunked_req is None:
            if self.num_running + len(self.admitted) >= self.max_running_requests:
                break
            req = waiting[0]
            if req.paused:  # retracted while its client is behind: it waits for the client
                skipped.append(waiting.popleft())
                continue
            match = self.kv_cache.match_unlocked(req.prefix_key())
            head = self._shared_head(req, match[0])
            if head is not None and head in self._heads:
                skipped.append(waiting.popleft())
                self.leaders.add(id(self._heads[head]))
                continue
            if not self._try_admit(req, match):
                break
            waiting.popleft()
            if head is not None:
                self._heads[head] = req
        waiting.extendleft(reversed(skipped))
        return self.admitted

    def _shared_head(self, req: Req, cached: int) -> bytes | None:
        """`req`'s prompt head when its cached prefix is too short to make it safe from
        computing what a twin in this batch computes (see IN_BATCH_PREFIX_TOKENS), else None."""
        if self.kv_cache.disable_radix_cache:
            return None
        head = prompt_head(req)
        return None if head is None or cached >= IN_BATCH_PREFIX_TOKENS else head

    def _continue(self, req: Req) -> None:
        """Plan the next chunk of `req` (admitted, its prompt partly prefilled): cache what
        its chunks stored, then take as much of the rest as the chunk budget allows."""
        admission = req.admission
        assert admission is not None
        kv_len = self.kv_cache.kv_len(admission.req_id)
        fill_ids = req.fill_ids()
        self.kv_cache.cache_unfinished_req(admission.req_id, fill_ids[:kv_len])
        admission.prefix_len = kv_len  # the stored tokens: the next chunk starts after them
        remaining = len(fill_ids) - kv_len
        # the rest of its prompt and its output stay reserved
        self._take(req, remaining, span_tokens(kv_len, len(fill_ids) + reserved_tokens(req), self.kv_cache.page_size))

    def _take(self, req: Req, extend_len: int, need: int) -> None:
        """Admit `req` into the batch with the part of its `extend_len` new tokens that fits
        the chunk budget (all of them, or a page-aligned chunk), `need` tokens reserved."""
        chunk = self._chunk_len(extend_len)
        admission = req.admission
        assert admission is not None
        admission.extend_end = admission.prefix_len + chunk if chunk < extend_len else None
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

    def _try_admit(self, req: Req, match: tuple[int, int]) -> bool:
        """Admit `req` if it fits; `match`: (cached, unlocked) of its prefix key, as
        `KVCache.match_unlocked` gives it."""
        seq_len = req.seq_len
        # Keep at least one token to compute (its logits give the next token), and every
        # token whose prompt logprob was asked for (prefix_key). Matched first, without a
        # lock, counting what locking its prefix would take out of the evictable pool: a
        # request that does not fit is turned away before anything is locked.
        cached, unlocked = match
        room = self.kv_cache.available_size() - unlocked - self.reserved
        page = self.kv_cache.page_size
        estimate = span_tokens(cached, seq_len + reserved_tokens(req), page)
        if estimate > room or (self.admitted and seq_len - cached > self.prefill_budget):
            return False
        if self.kv_cache.free_req_rows() == 0:
            return False
        admission = self.kv_cache.admit(req.prefix_key())
        if admission is None:
            return False
        extend_len = seq_len - admission.prefix_len
        chunk = self._chunk_len(extend_len)
        # Whole pages; a chunked prompt reserves all of it.
        need = span_tokens(admission.prefix_len, seq_len + reserved_tokens(req), page)
        too_big = extend_len > self.prefill_budget or chunk == 0 or (chunk < extend_len and not req.can_chunk())
        if (self.admitted and too_big) or need > self.kv_cache.available_size() - self.reserved:
            self.kv_cache.free_req(admission.req_id)
            return False
        req.admission = admission
        if req.num_retractions == 0:
            req.cached_tokens = admission.prefix_len
        if req.can_chunk():
            self._take(req, extend_len, need)
        else:  # prompt logprobs: one extend step, however long
            self.reserved += need
            self.prefill_budget -= extend_len
            if self.chunk_budget is not None:
                self.chunk_budget = max(0, self.chunk_budget - extend_len)
            self.admitted.append(req)
        return True
