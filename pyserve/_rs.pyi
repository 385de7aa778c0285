"""Type stubs of `pyserve._rs`, the native KV bookkeeping core (Rust, rust/core + rust/py).

Units: token ids are ints that fit in int32; KV slots are int64, numbered 1..size (slot 0 is
the padding slot of the KV tensors and is never handed out). Array inputs accept numpy
integer arrays, lists/tuples of ints, or anything `numpy.asarray` turns into a 1-D integer
array; float inputs raise TypeError, negative indices/lengths raise ValueError. Array outputs
are 1-D int64 numpy arrays. Only the scheduler (loop) thread may call these objects; the heavy
calls release the GIL. Expected shortfalls (not enough free slots or rows) return None; broken
contracts raise the `CoreError` subclasses below.
"""

from typing import Sequence, Union

import numpy as np
import numpy.typing as npt

IntArray = Union[npt.NDArray[np.integer], Sequence[int]]
Int64Array = npt.NDArray[np.int64]

class CoreError(Exception):
    """Base class of every error raised by the pyserve Rust core."""

class UnknownRequestError(CoreError):
    """A req_pool_idx or radix cache node id that is not allocated / not live."""

class DoubleFreeError(CoreError):
    """A KV slot or request row freed while already free (or twice in one call)."""

class ShapeError(CoreError):
    """Inputs of mismatched lengths, or an index/length outside its valid range."""

class InvariantError(CoreError):
    """A broken internal invariant (dec_lock_ref below zero, inconsistent tree, ...)."""

class TokenToKVPoolAllocator:
    """Allocator of KV slots 1..=size, first-freed first-reused (slot 0 is never handed out)."""

    def __init__(self, size: int) -> None: ...
    def alloc(self, n: int) -> Int64Array | None:
        """`n` free slots ([n] int64), or None (nothing taken) if fewer than n are free."""
    def free(self, slots: IntArray) -> None:
        """Returns `slots` to the free list. Raises DoubleFreeError (already free, or repeated
        in `slots`) or ShapeError (not in 1..=size); nothing is freed then."""
    def available_size(self) -> int:
        """Number of free slots (tokens)."""
    def size(self) -> int:
        """Number of allocatable slots (excluding the padding slot 0)."""
    @property
    def page_size(self) -> int:
        """Tokens per page; always 1."""
    def is_free(self, slot: int) -> bool:
        """Whether `slot` is free (False for 0 and out-of-range slots)."""
    def clear(self) -> None:
        """Frees every slot (back to the freshly created state)."""

class ReqToTokenPool:
    """`size` request rows x `max_context_len` int64 KV slots: row[req_pool_idx][position]."""

    def __init__(self, size: int, max_context_len: int) -> None: ...
    def alloc(self) -> int | None:
        """A free row index (req_pool_idx), or None if every row is in use."""
    def free(self, req_pool_idx: int) -> None:
        """Frees a row. Raises UnknownRequestError (out of range) or DoubleFreeError."""
    def write(self, req_pool_idx: int, start: int, slots: IntArray) -> None:
        """Writes `slots` at columns [start, start + len(slots)). Raises UnknownRequestError
        (row not allocated) or ShapeError (past max_context_len)."""
    def read(self, req_pool_idx: int, start: int, end: int) -> Int64Array:
        """Copy of columns [start, end) ([end - start] int64). Raises as `write`."""
    def available_size(self) -> int:
        """Number of free rows."""
    def size(self) -> int:
        """Total number of rows."""
    def max_context_len(self) -> int:
        """Columns per row (max tokens per request)."""
    def clear(self) -> None:
        """Frees every row."""

class RadixCache:
    """Radix tree from token ids to KV slots; LRU eviction of unlocked leaves.

    Holds references to `req_to_token_pool` and `token_to_kv_pool_allocator` and frees into
    them. Node ids are ints; the root is 0. A node id stays valid while it is locked
    (`inc_lock_ref`); an unlocked node may be evicted and its id reused. `page_size` must be 1
    (ShapeError otherwise). With `disable=True` nothing is cached.
    """

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int = 1,
        disable: bool = False,
    ) -> None: ...
    @property
    def req_to_token_pool(self) -> ReqToTokenPool: ...
    @property
    def token_to_kv_pool_allocator(self) -> TokenToKVPoolAllocator: ...
    @property
    def page_size(self) -> int: ...
    @property
    def disable(self) -> bool: ...
    def match_prefix(self, key: IntArray) -> tuple[Int64Array, int]:
        """(slots of the longest cached prefix of `key` [prefix_len] int64, last_node).
        Splits the node where the match ends; refreshes access times. Disabled: (empty, 0)."""
    def insert(self, key: IntArray, value: IntArray) -> int:
        """Caches `key` with KV slots `value` (same length); returns how many leading tokens
        were already cached (value[:n] are then duplicates). Raises ShapeError on lengths."""
    def evict(self, num_tokens: int) -> int:
        """Frees least-recently-used unlocked leaves into the allocator until `num_tokens`
        slots are freed or nothing is evictable; returns the number of slots freed."""
    def inc_lock_ref(self, node: int) -> None:
        """Locks `node` and its ancestors (no-op for the root). UnknownRequestError if the
        node does not exist."""
    def dec_lock_ref(self, node: int) -> None:
        """Undoes one inc_lock_ref. UnknownRequestError (unknown node) or InvariantError
        (not locked); nothing changes then."""
    def lock_ref(self, node: int) -> int:
        """Current lock count of `node`."""
    def evictable_size(self) -> int:
        """Tokens held by unlocked nodes."""
    def protected_size(self) -> int:
        """Tokens held by locked nodes."""
    def total_size(self) -> int:
        """All tokens held by the tree."""
    def num_nodes(self) -> int:
        """Live nodes, root included."""
    def reset(self) -> None:
        """Empties the tree, freeing its slots into the allocator (drops all locks)."""
    def check_integrity(self) -> None:
        """Raises InvariantError if sizes, links or lock counts are inconsistent."""
    def cache_finished_req(
        self, req_pool_idx: int, token_ids: IntArray, prefix_len: int, last_node: int
    ) -> None:
        """A request finished. `token_ids` are exactly the tokens whose KV is in
        row[0:len(token_ids)]. Inserts them, frees the duplicate slots
        row[prefix_len:already_cached_len], dec_lock_ref(last_node), frees the row.
        Disabled: frees row[prefix_len:len] and the row. Inputs are checked before any change
        (UnknownRequestError, ShapeError, InvariantError)."""
    def cache_unfinished_req(
        self, req_pool_idx: int, token_ids: IntArray, prefix_len: int, last_node: int
    ) -> tuple[int, int]:
        """A prefill chunk ended; the request keeps running. Inserts `token_ids`, frees
        duplicates, rewrites row[0:len] with the tree's slots, locks the new last node and
        unlocks `last_node`. Returns (new_prefix_len == len(token_ids), new_last_node).
        Disabled: returns (len(token_ids), last_node) and changes nothing."""
    def release_req(
        self, req_pool_idx: int, kv_len: int, prefix_len: int, last_node: int
    ) -> None:
        """Drops a request without caching (abort): frees row[prefix_len:kv_len],
        dec_lock_ref(last_node), frees the row."""

def prepare_extend(
    req_to_token_pool: ReqToTokenPool,
    allocator: TokenToKVPoolAllocator,
    req_pool_indices: IntArray,
    prefix_lens: IntArray,
    extend_lens: IntArray,
) -> tuple[Int64Array, Int64Array, Int64Array, Int64Array] | None:
    """Allocates sum(extend_lens) slots and writes request i's into its row at
    [prefix_i, prefix_i + extend_i). Returns (out_cache_loc [sum(extend_lens)],
    positions [sum(extend_lens)], kv_indptr [B + 1], kv_indices [sum(prefix_i + extend_i)]),
    where kv_indices concatenates row[0:prefix_i + extend_i] per request; or None, with
    nothing changed, if too few slots are free. Raises ShapeError (lengths differ, a row
    repeated, past max_context_len) or UnknownRequestError (row not allocated)."""

def prepare_decode(
    req_to_token_pool: ReqToTokenPool,
    allocator: TokenToKVPoolAllocator,
    req_pool_indices: IntArray,
    seq_lens: IntArray,
) -> tuple[Int64Array, Int64Array, Int64Array, Int64Array] | None:
    """Allocates one slot per request, written at row[seq_len_i] (seq_len_i = tokens whose KV
    is already stored). Returns (out_cache_loc [B], positions [B] = seq_lens, kv_indptr
    [B + 1], kv_indices = row[0:seq_len_i + 1] per request), or None if fewer than B slots
    are free. Raises as `prepare_extend`."""
