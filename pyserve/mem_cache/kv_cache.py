"""`KVCache`: the scheduler's single handle on KV bookkeeping (Rust core facade).

It owns the Rust `ReqToTokenPool`, `TokenToKVPoolAllocator` and `RadixCache`, and adds the
one policy the Rust objects leave to the caller: when an allocation fails, evict unlocked
cache leaves and try once more. Loop thread only (the Rust objects are not shared with the
worker thread; the worker receives plain arrays).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pyserve import _rs


@dataclass
class PrefixMatch:
    """Result of matching a prompt against the radix cache.

    prefix_indices: [prefix_len] int64 KV slots of the cached prefix.
    last_node:      tree node to lock while the request uses the prefix.
    """

    prefix_indices: np.ndarray
    last_node: int

    @property
    def prefix_len(self) -> int:
        return int(self.prefix_indices.shape[0])


@dataclass
class BatchArrays:
    """Flat arrays of one step, all int64 numpy (see ForwardBatch for their meaning)."""

    out_cache_loc: np.ndarray
    positions: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray


class KVCache:
    """KV slots for `max_total_tokens` tokens and rows for `max_running_requests` requests.

    Slots are numbered 1..max_total_tokens (slot 0 is the padding slot of the KV tensors).
    """

    def __init__(self, max_total_tokens: int, max_running_requests: int, max_context_len: int,
                 disable_radix_cache: bool = False, page_size: int = 1) -> None:
        self.max_total_tokens = max_total_tokens
        self.allocator = _rs.TokenToKVPoolAllocator(max_total_tokens)
        # One spare row: a request is admitted before the finished ones of the step leave.
        self.req_to_token_pool = _rs.ReqToTokenPool(max_running_requests + 1, max_context_len + 1)
        self.tree = _rs.RadixCache(self.req_to_token_pool, self.allocator,
                                   page_size=page_size, disable=disable_radix_cache)

    # ---- sizes -------------------------------------------------------------------------------
    def available_size(self) -> int:
        """Free slots plus slots that eviction can reclaim."""
        return self.allocator.available_size() + self.tree.evictable_size()

    def free_slots(self) -> int:
        return self.allocator.available_size()

    def free_req_rows(self) -> int:
        return self.req_to_token_pool.available_size()

    # ---- a request's life ----------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int]) -> PrefixMatch:
        indices, last_node = self.tree.match_prefix(token_ids)
        return PrefixMatch(np.asarray(indices, dtype=np.int64), int(last_node))

    def admit(self, match: PrefixMatch) -> int | None:
        """Take a request row, write the prefix slots into it and lock the prefix.
        Returns req_pool_idx, or None when no row is free."""
        req_pool_idx = self.req_to_token_pool.alloc()
        if req_pool_idx is None:
            return None
        if match.prefix_len:
            self.req_to_token_pool.write(req_pool_idx, 0, match.prefix_indices)
        self.tree.inc_lock_ref(match.last_node)
        return int(req_pool_idx)

    def cache_finished_req(self, req_pool_idx: int, token_ids: list[int], prefix_len: int,
                           last_node: int) -> None:
        """Hand the request's computed KV (`token_ids`, exactly the tokens with stored KV) to
        the tree, free duplicates, unlock, release the row."""
        self.tree.cache_finished_req(req_pool_idx, token_ids, prefix_len, last_node)

    def release_req(self, req_pool_idx: int, kv_len: int, prefix_len: int, last_node: int) -> None:
        """Free everything an aborted request holds without caching it."""
        self.tree.release_req(req_pool_idx, kv_len, prefix_len, last_node)

    # ---- one step ------------------------------------------------------------------------------
    def _ensure_free(self, num_tokens: int) -> None:
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            self.tree.evict(short)

    def prepare_extend(self, req_pool_indices: list[int], prefix_lens: list[int],
                       extend_lens: list[int]) -> BatchArrays | None:
        """Allocate sum(extend_lens) slots (evicting if needed); None if they do not fit."""
        self._ensure_free(sum(extend_lens))
        arrays = _rs.prepare_extend(self.req_to_token_pool, self.allocator,
                                    np.asarray(req_pool_indices, dtype=np.int64),
                                    np.asarray(prefix_lens, dtype=np.int64),
                                    np.asarray(extend_lens, dtype=np.int64))
        return None if arrays is None else BatchArrays(*arrays)

    def prepare_decode(self, req_pool_indices: list[int], seq_lens: list[int]) -> BatchArrays | None:
        """Allocate one slot per request (evicting if needed); None if they do not fit."""
        self._ensure_free(len(req_pool_indices))
        arrays = _rs.prepare_decode(self.req_to_token_pool, self.allocator,
                                    np.asarray(req_pool_indices, dtype=np.int64),
                                    np.asarray(seq_lens, dtype=np.int64))
        return None if arrays is None else BatchArrays(*arrays)
