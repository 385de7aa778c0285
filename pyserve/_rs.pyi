"""Type stubs of `pyserve._rs`, the native KV bookkeeping core (Rust, rust/core + rust/py).

Units: token ids are ints that fit in int32; lengths are tokens; KV slots are below 2^31.
A batch's arrays (`BatchArrays`) are all int32, the dtype the worker's device tables index
with, so they reach the device unconverted; other array outputs are int64. Slots come
in pages of `page_size`: page p holds slots p * page_size .. (p + 1) * page_size - 1, page 0
(with the padding slot 0) is reserved, so the KV tensors need `num_slot_rows` =
max_total_tokens + page_size rows. Cached prefixes are whole pages.

Array inputs accept numpy integer arrays, lists/tuples of ints, or anything `numpy.asarray`
turns into a 1-D integer array; anything else (floats, 2-D, negative ids or lengths) raises
ShapeError. Array outputs are 1-D numpy arrays handed over without an element copy.
Only the scheduler (loop) thread may call these objects. Every call but `check_integrity`
(O(pool), tests and debugging) keeps the GIL: each takes microseconds (tens for a per-batch
call), while releasing the GIL on the loop lets another Python thread take it, and the loop
then waits up to the interpreter's switch interval (5 ms) to get it back. The calls on one
request's token ids (`match_prefix`, `add_req`, `cache_*_req`) read a C-contiguous int32
token array in place. Expected shortfalls (not enough free KV or rows) return None; broken contracts
raise the `CoreError` subclasses below, with nothing changed unless stated.
"""

from collections.abc import Sequence
from typing import final

import numpy as np
import numpy.typing as npt

__all__ = [
    "BatchArrays",
    "CoreError",
    "DoubleFreeError",
    "DuplicateRequestError",
    "InvariantError",
    "KVCache",
    "ShapeError",
    "UnknownRequestError",
    "send_each",
]

_IntArray = npt.NDArray[np.integer] | Sequence[int]
_Int64Array = npt.NDArray[np.int64]
_Int32Array = npt.NDArray[np.int32]

class CoreError(Exception):
    """Base class of every error raised by the pyserve Rust core."""

class UnknownRequestError(CoreError):
    """A request id, req_pool_idx or radix cache node id that is not admitted / not live."""

class DuplicateRequestError(CoreError):
    """A request id given twice where it must appear once (e.g. twice in one batch)."""

class DoubleFreeError(CoreError):
    """A KV slot or request row freed while already free (or twice in one call)."""

class ShapeError(CoreError):
    """Bad array input: mismatched lengths, wrong dtype or dimensions, a negative or
    out-of-range index or length."""

class InvariantError(CoreError):
    """A broken internal invariant (dec_lock_ref below zero, inconsistent bookkeeping)."""

@final
class BatchArrays:
    """All arrays of one forward batch of B requests (1-D, int32: every value fits, as the
    request table has at most 2^31 - 1 cells and slots stay below 2^31)."""

    @property
    def req_pool_indices(self) -> _Int32Array:
        """[B] row of each request."""
    @property
    def prefix_lens(self) -> _Int32Array:
        """[B] tokens whose KV was stored before this step."""
    @property
    def extend_lens(self) -> _Int32Array:
        """[B] new tokens per request (1 for decode)."""
    @property
    def seq_lens(self) -> _Int32Array:
        """[B] tokens with KV after this step (prefix_lens + extend_lens)."""
    @property
    def out_cache_loc(self) -> _Int32Array:
        """[sum(extend_lens)] KV slot of each new token, request by request."""
    @property
    def positions(self) -> _Int32Array:
        """[sum(extend_lens)] position of each new token in its sequence."""
    @property
    def kv_indptr(self) -> _Int32Array:
        """Extend: [B + 1] CSR offsets, request i's row is kv_indices[kv_indptr[i]:kv_indptr[i+1]].
        Decode: empty (a decode step is O(batch); the worker keeps the rows)."""
    @property
    def kv_indices(self) -> _Int32Array:
        """Extend: [sum(seq_lens)] the KV slots of every token of each request's row (prefix
        and new tokens). Decode: empty."""

@final
class KVCache:
    """KV page allocator + request rows + radix prefix cache + admitted requests.

    `max_total_tokens` slots (a multiple of `page_size`, else ShapeError) in pages of
    `page_size`; `num_rows` request rows of `max_context_len` tokens (num_rows *
    max_context_len at most 2^31 - 1, else ShapeError). A request admitted with
    `add_req` gets a `req_id` (increasing, never reused) for every later call; finishing or
    aborting it twice returns False the second time.
    """

    def __new__(
        cls,
        max_total_tokens: int,
        num_rows: int,
        max_context_len: int,
        page_size: int = 1,
        disable_radix_cache: bool = False,
    ) -> KVCache: ...
    @property
    def page_size(self) -> int: ...
    @property
    def max_total_tokens(self) -> int:
        """Allocatable slots (tokens), excluding the reserved page 0."""
    @property
    def num_slot_rows(self) -> int:
        """Rows the KV tensors need: max_total_tokens + page_size."""
    @property
    def disable_radix_cache(self) -> bool: ...
    def free_size(self) -> int:
        """Free slots (tokens; whole free pages)."""
    def available_size(self) -> int:
        """Free slots plus slots eviction can reclaim."""
    def evictable_size(self) -> int:
        """Tokens held by unlocked radix cache nodes."""
    def protected_size(self) -> int:
        """Tokens held by radix cache nodes that running requests lock."""
    def num_nodes(self) -> int:
        """Live radix cache nodes, root included."""
    def num_reqs(self) -> int:
        """Admitted requests."""
    def free_rows(self) -> int:
        """Free request rows."""
    def match_prefix(self, key: _IntArray) -> tuple[_Int64Array, int]:
        """(slots of the longest cached page-aligned prefix of `key`, last node id). Splits
        the node where the match ends; refreshes LRU times. Disabled: (empty, 0)."""
    def match_lens(self, tokens: _IntArray, offsets: _IntArray) -> _Int64Array:
        """[n] the cached page-aligned prefix length of each key (key i is
        tokens[offsets[i]:offsets[i + 1]]; offsets rise from 0 to len(tokens), else
        ShapeError), changing nothing (no split, no access-time update)."""
    def match_unlocked(self, key: _IntArray) -> tuple[int, int]:
        """(cached page-aligned prefix length of `key`, how many of those tokens no request
        locks): what admitting it would take out of the evictable pool. Changes nothing."""
    def dfs_weight_order(self, tokens: _IntArray, offsets: _IntArray) -> _Int64Array:
        """[n] the order (indices into the keys, given as in `match_lens`) in which the
        dfs-weight policy admits requests with these keys: depth-first over the tree from the
        deepest node each key fully matches, heaviest branch (most keys) first, older node on
        ties, each node's keys in their given order. Changes nothing."""
    def add_req(self, key: _IntArray) -> tuple[int, int, int] | None:
        """Admit a request: match `key`, take a row, write the prefix slots, lock the prefix.
        Returns (req_id, req_pool_idx, prefix_len), or None if no row is free. ShapeError if
        `key` is longer than max_context_len."""
    def prepare_extend(self, req_ids: _IntArray, extend_lens: _IntArray) -> BatchArrays | None:
        """Each request adds extend_lens[i] tokens after its stored ones: fills its partly used
        last page first, then takes new pages (evicting LRU cache leaves if short). None, with
        the requests unchanged, if the pages do not fit. Raises ShapeError (lengths differ,
        past max_context_len), DuplicateRequestError, UnknownRequestError."""
    def prepare_decode(self, req_ids: _IntArray) -> BatchArrays | None:
        """Each request adds one token; a new page only at a page boundary. As prepare_extend."""
    def cache_unfinished_req(self, req_id: int, token_ids: _IntArray) -> int:
        """A prefill chunk ended; the request keeps running. `token_ids` are exactly its stored
        tokens. Caches their whole pages, frees duplicate pages, re-locks; returns the new
        prefix_len. UnknownRequestError, ShapeError (wrong token count)."""
    def cache_finished_req(self, req_id: int, token_ids: _IntArray) -> bool:
        """A request finished: cache the whole pages of its stored tokens (`token_ids`, all of
        them), free its duplicate and partial pages, unlock, free its row. False if it was
        released already. UnknownRequestError (never admitted), ShapeError."""
    def free_req(self, req_id: int) -> bool:
        """Drop a request without caching (abort, retraction): free its own pages, unlock,
        free its row. False if it was released already."""
    def req_info(self, req_id: int) -> tuple[int, int, int, int]:
        """(req_pool_idx, prefix_len, kv_len, last_node) of a live request."""
    def req_slots(self, req_id: int) -> _Int64Array:
        """[kv_len] KV slots of a live request's stored tokens (a copy)."""
    def evict(self, num_tokens: int) -> int:
        """Free LRU unlocked leaves until `num_tokens` slots are freed or none is evictable;
        returns the slots freed (whole nodes)."""
    def reset(self) -> None:
        """Empty the radix cache. InvariantError while requests are admitted."""
    def check_integrity(self) -> None:
        """Verify every invariant (page ownership, refcounts, sizes, rows); InvariantError
        naming the first violation."""

def send_each(fds: Sequence[int], chunks: Sequence[bytes]) -> list[int]:
    """Send chunks[i] to the non-blocking socket fds[i], for each i in order, with the GIL
    released (the SSE stream writer's thread calls it). For each: the bytes sent (fewer than
    its length once that socket's buffer was full) or the negated errno of a failed send
    (MSG_NOSIGNAL: a closed peer is -EPIPE). The fds are borrowed, never closed. Raises
    ValueError if the lists differ in length."""
