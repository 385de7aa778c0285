"""`KVCache`: the scheduler's single handle on KV bookkeeping (a facade over `pyserve._rs`).

The Rust `KVCache` owns the page allocator, the request rows, the radix cache and every
admitted request (by `req_id`); each method here is one Rust call. Eviction when the free
pages run short happens inside the step calls. Loop thread only (the Rust object is not
shared with the worker thread; the worker receives plain arrays).

Pool layout: `max_total_tokens` is rounded down to a multiple of `page_size`; page p covers
KV slots `p * page_size .. (p + 1) * page_size - 1` and page 0 (holding the padding slot 0)
is reserved, so the KV tensors need `max_total_tokens + page_size` rows (`num_slot_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pyserve import _rs

BatchArrays = _rs.BatchArrays


@dataclass(slots=True)
class Admission:
    """A request's hold on the KV core, from `KVCache.admit` to `KVCache.release` (the only
    places that make and end one).

    req_id: the core's handle; req_pool_idx: its row of the request tables.
    prefix_len: tokens with stored KV before its next extend step: the cached prefix found at
    admission (whole pages: reused, not recomputed), then, while its prompt is prefilled in
    chunks, what the chunks so far stored. extend_end: while its prompt is prefilled in
    chunks, where the chunk being planned ends (an index into its fill ids); None: the extend
    covers all of them."""

    req_id: int
    req_pool_idx: int
    prefix_len: int
    extend_end: int | None = None


class Admitted(Protocol):
    """What holds an Admission (the scheduler's `Req`): None while it waits."""

    admission: Admission | None


def usable_pool_tokens(max_total_tokens: int, page_size: int) -> int:
    """Tokens of a pool of `max_total_tokens` slots usable in whole pages of `page_size`.
    Raises ValueError if not even one page fits."""
    usable = max_total_tokens - max_total_tokens % page_size
    if usable <= 0:
        raise ValueError(f"a KV pool of {max_total_tokens} tokens holds no page of {page_size}")
    return usable


class KVCache:
    """KV pages for `max_total_tokens` tokens and rows for `max_running_requests` requests.

    Raises ValueError if the pool holds no whole page.
    """

    def __init__(
        self,
        max_total_tokens: int,
        max_running_requests: int,
        max_context_len: int,
        disable_radix_cache: bool = False,
        page_size: int = 1,
    ) -> None:
        self.page_size = page_size
        self.disable_radix_cache = disable_radix_cache
        self.max_total_tokens = usable_pool_tokens(max_total_tokens, page_size)
        # One spare row: a request is admitted before the finished ones of the step leave.
        self.num_rows = max_running_requests + 1
        self.max_context_len = max_context_len + 1  # tokens a row holds
        self.core = _rs.KVCache(
            self.max_total_tokens,
            self.num_rows,
            self.max_context_len,
            page_size=page_size,
            disable_radix_cache=disable_radix_cache,
        )

    # ---- sizes (tokens) --------------------------------------------------------------------
    def available_size(self) -> int:
        """Free slots plus slots that eviction can reclaim."""
        return self.core.available_size()

    def free_slots(self) -> int:
        return self.core.free_size()

    def evictable_slots(self) -> int:
        return self.core.evictable_size()

    def protected_slots(self) -> int:
        return self.core.protected_size()

    def free_req_rows(self) -> int:
        return self.core.free_rows()

    def num_reqs(self) -> int:
        """Requests admitted (holding a row) right now."""
        return self.core.num_reqs()

    def reset(self) -> None:
        """Empty the radix cache, freeing its pages. InvariantError while requests are admitted."""
        self.core.reset()

    # ---- what the scheduling policies read (nothing changes) ---------------------------------
    def match_lens(self, keys: list[np.ndarray]) -> np.ndarray:
        """[n] int64: the cached page-aligned prefix length of each int32 key (one Rust call;
        no split, no LRU refresh)."""
        tokens, offsets = _flat(keys)
        return self.core.match_lens(tokens, offsets)

    def match_unlocked(self, key: np.ndarray) -> tuple[int, int]:
        """(cached prefix length of the int32 `key`, the part of it no request locks: what
        admitting it takes out of the evictable pool). Changes nothing."""
        return self.core.match_unlocked(key)

    def dfs_weight_order(self, keys: list[np.ndarray]) -> np.ndarray:
        """[n] int64: the `dfs-weight` admission order of requests with these keys (indices
        into `keys`; see rust/core radix_cache/schedule.rs)."""
        tokens, offsets = _flat(keys)
        return self.core.dfs_weight_order(tokens, offsets)

    # ---- a request's life ----------------------------------------------------------------------
    def admit(self, key: list[int] | np.ndarray) -> Admission | None:
        """Match `key` (the tokens whose cached KV may be reused), take a row, lock the
        prefix. None when no row is free."""
        out = self.core.add_req(np.asarray(key, dtype=np.int32))
        return None if out is None else Admission(*out)

    def release(self, holder: Admitted, stored_ids: Callable[[int], np.ndarray] | None) -> int:
        """End `holder`'s admission and clear it: its stored KV goes to the radix cache
        (`stored_ids(kv_len)`: the int32 tokens of the kv_len slots it stored) or, with
        `stored_ids` None (an abort, a failed step, a request never run), is freed. Returns its
        row, which the worker's tables then forget."""
        admission = holder.admission
        assert admission is not None, "released twice"
        holder.admission = None
        if stored_ids is None:
            self.core.free_req(admission.req_id)
        else:
            kv_len = self.kv_len(admission.req_id)
            self.core.cache_finished_req(admission.req_id, np.asarray(stored_ids(kv_len), dtype=np.int32))
        return admission.req_pool_idx

    def cache_unfinished_req(self, req_id: int, token_ids: list[int] | np.ndarray) -> int:
        """A prefill chunk ended and the request goes on: its stored KV (`token_ids`, exactly
        the tokens with stored KV) enters the cache in whole pages, duplicate pages are freed
        and the request re-locks the cached prefix. Returns the new cached prefix length."""
        return self.core.cache_unfinished_req(req_id, np.asarray(token_ids, dtype=np.int32))

    def cache_finished_req(self, req_id: int, token_ids: list[int] | np.ndarray) -> bool:
        """Hand the request's stored KV (`token_ids`, exactly the tokens with stored KV) to
        the cache and release it. False if it was released already."""
        return self.core.cache_finished_req(req_id, np.asarray(token_ids, dtype=np.int32))

    def kv_len(self, req_id: int) -> int:
        """Tokens with stored KV of a live request (the Rust core's count)."""
        return self.core.req_info(req_id)[2]

    def free_req(self, req_id: int) -> bool:
        """Free everything a request holds without caching it. False if released already."""
        return self.core.free_req(req_id)

    # ---- one step ------------------------------------------------------------------------------
    def prepare_extend(self, req_ids: list[int], extend_lens: list[int]) -> BatchArrays | None:
        """Allocate the pages of an extend batch (evicting if needed); None if they do not fit."""
        return self.core.prepare_extend(np.asarray(req_ids, dtype=np.int64), np.asarray(extend_lens, dtype=np.int64))

    def prepare_decode(self, req_ids: list[int] | np.ndarray) -> BatchArrays | None:
        """Allocate one token per request (a new page only at page boundaries, evicting if
        needed); None if they do not fit. O(batch): the arrays hold no kv_indices."""
        return self.core.prepare_decode(np.asarray(req_ids, dtype=np.int64))


def _flat(keys: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Keys as one int32 array and [n + 1] int64 offsets (what crosses into Rust)."""
    offsets = np.zeros(len(keys) + 1, dtype=np.int64)
    np.cumsum([len(k) for k in keys], out=offsets[1:])
    tokens = np.concatenate(keys).astype(np.int32, copy=False) if keys else np.zeros(0, dtype=np.int32)
    return tokens, offsets
