"""The native core `pyserve._rs` through its Python binding: exact slots, arrays and errors.

The logic itself is tested by `cargo test -p pyserve-core`; these tests pin the binding:
argument conversion (numpy arrays and lists), numpy int64 outputs, None on shortfall, and the
exception hierarchy.
"""

from __future__ import annotations

import numpy as np
import pytest

from pyserve import _rs
from pyserve.errors import (
    CoreError,
    DoubleFreeError,
    InvariantError,
    ShapeError,
    UnknownRequestError,
)


def make(num_slots: int = 20, rows: int = 4, max_context_len: int = 16, disable: bool = False):
    alloc = _rs.TokenToKVPoolAllocator(num_slots)
    pool = _rs.ReqToTokenPool(rows, max_context_len)
    cache = _rs.RadixCache(pool, alloc, page_size=1, disable=disable)
    return alloc, pool, cache


def admit(cache, pool, alloc, token_ids):
    """Match, lock, take a row, write the prefix and extend the rest (as the scheduler does)."""
    prefix, node = cache.match_prefix(token_ids)
    cache.inc_lock_ref(node)
    row = pool.alloc()
    pool.write(row, 0, prefix)
    arrays = _rs.prepare_extend(pool, alloc, [row], [len(prefix)], [len(token_ids) - len(prefix)])
    assert arrays is not None
    return row, len(prefix), node


def test_exception_hierarchy():
    for exc in (UnknownRequestError, DoubleFreeError, ShapeError, InvariantError):
        assert issubclass(exc, CoreError)
        assert exc.__module__ == "pyserve._rs"
    assert issubclass(CoreError, Exception)


def test_allocator_alloc_free_exact_slots():
    alloc = _rs.TokenToKVPoolAllocator(5)
    assert (alloc.size(), alloc.page_size, alloc.available_size()) == (5, 1, 5)
    slots = alloc.alloc(3)
    assert slots.dtype == np.int64
    assert slots.tolist() == [1, 2, 3]
    assert alloc.alloc(3) is None
    assert alloc.available_size() == 2
    alloc.free(np.array([2], dtype=np.int64))
    alloc.free([1])
    assert alloc.alloc(4).tolist() == [4, 5, 2, 1]
    assert alloc.available_size() == 0


def test_allocator_errors_free_nothing():
    alloc = _rs.TokenToKVPoolAllocator(4)
    alloc.alloc(2)
    with pytest.raises(DoubleFreeError, match="double free of index 3"):
        alloc.free([1, 3])
    with pytest.raises(DoubleFreeError):
        alloc.free([1, 1])
    with pytest.raises(ShapeError, match="kv slot 0 out of range"):
        alloc.free([0])
    with pytest.raises(TypeError):
        alloc.free(np.array([1.0]))
    assert alloc.available_size() == 2
    assert not alloc.is_free(1) and alloc.is_free(3)


def test_req_to_token_pool():
    pool = _rs.ReqToTokenPool(2, 4)
    assert (pool.size(), pool.max_context_len(), pool.available_size()) == (2, 4, 2)
    assert pool.alloc() == 0
    assert pool.alloc() == 1
    assert pool.alloc() is None
    pool.write(1, 1, np.array([7, 8], dtype=np.int32))
    assert pool.read(1, 0, 4).tolist() == [0, 7, 8, 0]
    with pytest.raises(ShapeError):
        pool.write(1, 3, [1, 2])
    pool.free(0)
    with pytest.raises(DoubleFreeError):
        pool.free(0)
    with pytest.raises(UnknownRequestError):
        pool.read(0, 0, 1)
    with pytest.raises(UnknownRequestError):
        pool.free(2)


def test_match_insert_split_exact_indices():
    alloc, _, cache = make()
    assert cache.insert([1, 2, 3, 4], np.array([10, 11, 12, 13])) == 0
    indices, node = cache.match_prefix(np.array([1, 2, 3, 4, 5], dtype=np.int64))
    assert indices.dtype == np.int64
    assert indices.tolist() == [10, 11, 12, 13]
    assert node != 0
    indices, mid = cache.match_prefix([1, 2, 9])  # splits [1 2 3 4] into [1 2] + [3 4]
    assert (indices.tolist(), cache.num_nodes()) == ([10, 11], 3)
    assert cache.insert([1, 2, 5], [20, 21, 22]) == 2
    assert cache.match_prefix((7,))[0].tolist() == []
    assert cache.match_prefix((7,))[1] == 0
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (5, 0, 5)
    with pytest.raises(ShapeError):
        cache.insert([1], [1, 2])
    cache.check_integrity()


def test_lock_sizes_and_errors():
    _, _, cache = make()
    cache.insert([1, 2, 3], [10, 11, 12])
    cache.insert([1, 2, 4], [10, 11, 13])
    _, node = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(node)
    assert (cache.evictable_size(), cache.protected_size(), cache.lock_ref(node)) == (1, 3, 1)
    cache.dec_lock_ref(node)
    assert (cache.evictable_size(), cache.protected_size()) == (4, 0)
    with pytest.raises(InvariantError, match="below zero"):
        cache.dec_lock_ref(node)
    with pytest.raises(UnknownRequestError, match="unknown radix cache node 999"):
        cache.inc_lock_ref(999)
    with pytest.raises(CoreError):
        cache.dec_lock_ref(999)
    cache.inc_lock_ref(0)  # the root: no-op
    cache.dec_lock_ref(0)


def test_evict_lru_frees_into_allocator():
    alloc, _, cache = make(num_slots=6)
    cache.insert([1, 2], alloc.alloc(2))  # slots 1 2
    cache.insert([3], alloc.alloc(1))  # slot 3
    cache.insert([4], alloc.alloc(1))  # slot 4
    cache.match_prefix([1, 2])
    _, node4 = cache.match_prefix([4])
    cache.inc_lock_ref(node4)
    assert alloc.available_size() == 2
    assert cache.evict(1) == 1  # [3] is the least recently used unlocked leaf
    assert alloc.is_free(3) and alloc.available_size() == 3
    assert cache.evict(10) == 2  # then [1 2]; [4] is locked
    assert alloc.available_size() == 5
    assert (cache.total_size(), cache.protected_size()) == (1, 1)
    cache.check_integrity()


def test_cache_finished_req_frees_exact_duplicates():
    alloc, pool, cache = make()
    # C and D compute the same prompt concurrently (no cache hit for either).
    rc, pc, nc = admit(cache, pool, alloc, [8, 9, 10])
    rd, pd, nd = admit(cache, pool, alloc, [8, 9, 10, 11])
    assert pool.read(rd, 0, 4).tolist() == [4, 5, 6, 7]
    assert alloc.available_size() == 13
    cache.cache_finished_req(rc, [8, 9, 10], pc, nc)
    assert (alloc.available_size(), pool.available_size()) == (13, 3)
    cache.cache_finished_req(rd, np.array([8, 9, 10, 11]), pd, nd)
    assert (alloc.available_size(), pool.available_size()) == (16, 4)  # D's 4 5 6 went back
    assert cache.match_prefix([8, 9, 10, 11])[0].tolist() == [1, 2, 3, 7]
    # E reuses the prefix: nothing of it is freed again.
    re_, pe, ne = admit(cache, pool, alloc, [8, 9, 10, 11, 12])
    assert (pe, cache.protected_size()) == (4, 4)
    cache.cache_finished_req(re_, [8, 9, 10, 11, 12], pe, ne)
    assert alloc.available_size() == 15
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    cache.check_integrity()


def test_cache_unfinished_req_and_release():
    alloc, pool, cache = make()
    row, p, node = admit(cache, pool, alloc, [11, 12, 13])
    new_prefix_len, new_node = cache.cache_unfinished_req(row, [11, 12, 13], p, node)
    assert new_prefix_len == 3
    assert cache.lock_ref(new_node) == 1
    assert (cache.evictable_size(), cache.protected_size()) == (0, 3)
    # next chunk, then abort
    out = _rs.prepare_extend(pool, alloc, [row], [3], [2])
    assert out[0].tolist() == [4, 5]
    cache.release_req(row, 5, new_prefix_len, new_node)
    assert (alloc.available_size(), pool.available_size()) == (17, 4)
    assert (cache.evictable_size(), cache.protected_size()) == (3, 0)
    with pytest.raises(UnknownRequestError):
        cache.release_req(row, 0, 0, 0)
    cache.check_integrity()


def test_lifecycle_errors_change_nothing():
    alloc, pool, cache = make()
    row, p, node = admit(cache, pool, alloc, [1, 2])
    with pytest.raises(UnknownRequestError):
        cache.cache_finished_req(row, [1, 2], p, 42)
    with pytest.raises(UnknownRequestError):
        cache.cache_finished_req(3, [1, 2], p, node)
    with pytest.raises(ShapeError):
        cache.cache_finished_req(row, [1, 2], 3, node)
    assert (alloc.available_size(), pool.available_size(), cache.total_size()) == (18, 3, 0)


def test_disabled_cache():
    alloc, pool, cache = make(disable=True)
    assert cache.disable
    assert cache.insert([1, 2], [5, 6]) == 0
    row, p, node = admit(cache, pool, alloc, [1, 2, 3])
    assert (p, node) == (0, 0)
    assert cache.cache_unfinished_req(row, [1, 2, 3], 0, 0) == (3, 0)
    assert alloc.available_size() == 17
    cache.cache_finished_req(row, [1, 2, 3], 0, 0)
    assert (alloc.available_size(), pool.available_size(), cache.total_size()) == (20, 4, 0)


def test_page_size_must_be_one():
    alloc = _rs.TokenToKVPoolAllocator(4)
    pool = _rs.ReqToTokenPool(1, 4)
    with pytest.raises(ShapeError):
        _rs.RadixCache(pool, alloc, page_size=16)


def test_reset_frees_everything():
    alloc, _, cache = make(num_slots=4)
    cache.insert([1, 2, 3], alloc.alloc(3))
    cache.reset()
    assert (cache.total_size(), cache.num_nodes(), alloc.available_size()) == (0, 1, 4)
    assert cache.req_to_token_pool is not None
    assert cache.token_to_kv_pool_allocator.available_size() == 4


def test_prepare_extend_and_decode_exact_arrays():
    alloc, pool, _ = make()
    r0, r1 = pool.alloc(), pool.alloc()
    pool.write(r1, 0, [17, 18])
    out = _rs.prepare_extend(pool, alloc, np.array([r0, r1]), np.array([0, 2]), [3, 2])
    assert len(out) == 4 and all(a.dtype == np.int64 for a in out)
    out_cache_loc, positions, kv_indptr, kv_indices = (a.tolist() for a in out)
    assert out_cache_loc == [1, 2, 3, 4, 5]
    assert positions == [0, 1, 2, 2, 3]
    assert kv_indptr == [0, 3, 7]
    assert kv_indices == [1, 2, 3, 17, 18, 4, 5]
    out = _rs.prepare_decode(pool, alloc, [r1, r0], np.array([4, 3], dtype=np.int32))
    assert [a.tolist() for a in out] == [[6, 7], [4, 3], [0, 5, 9],
                                         [17, 18, 4, 5, 6, 1, 2, 3, 7]]
    assert alloc.available_size() == 13
    assert _rs.prepare_extend(pool, alloc, [r0], [0], [14]) is None
    assert alloc.available_size() == 13
    with pytest.raises(ShapeError):
        _rs.prepare_extend(pool, alloc, [r0], [0, 1], [1])
    with pytest.raises(ShapeError):
        _rs.prepare_decode(pool, alloc, [r0, r0], [4, 4])
    with pytest.raises(UnknownRequestError):
        _rs.prepare_decode(pool, alloc, [3], [0])
    with pytest.raises(ValueError):
        _rs.prepare_decode(pool, alloc, [-1], [0])
    assert alloc.available_size() == 13
