"""The native core `pyserve._rs` through its Python binding: exact slots, arrays and errors.

The logic itself is tested by `cargo test -p pyserve-core` (including the property-based
model test); these tests pin the binding: argument conversion (numpy arrays and lists), numpy
outputs (a batch's arrays int32, the others int64), None on shortfall, the exception
hierarchy, and `check_integrity()` after every operation (the `Checked` wrapper calls it after
each method).
"""

from __future__ import annotations

import numpy as np
import pytest

from pyserve import _rs
from pyserve.errors import (
    CoreError,
    DoubleFreeError,
    DuplicateRequestError,
    InvariantError,
    ShapeError,
    UnknownRequestError,
)
from pyserve.mem_cache.kv_cache import KVCache, usable_pool_tokens


class Checked:
    """Wraps a `_rs.KVCache`; runs check_integrity() after every method call."""

    def __init__(self, *args, **kwargs) -> None:
        self.core = _rs.KVCache(*args, **kwargs)

    def __getattr__(self, name):
        attr = getattr(self.core, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            finally:
                self.core.check_integrity()

        return call


def test_exception_hierarchy():
    for exc in (UnknownRequestError, DuplicateRequestError, DoubleFreeError, ShapeError, InvariantError):
        assert issubclass(exc, CoreError)
        assert exc.__module__ == "pyserve._rs"
    assert issubclass(CoreError, Exception)


def test_extend_and_decode_exact_arrays():
    c = Checked(20, 4, 32)
    assert (c.page_size, c.max_total_tokens, c.num_slot_rows) == (1, 20, 21)
    r0, row0, p0 = c.add_req([])
    r1, row1, _ = c.add_req(np.array([], dtype=np.int32))
    a = c.prepare_extend(np.array([r0, r1]), [3, 2])
    names = (
        "req_pool_indices",
        "prefix_lens",
        "extend_lens",
        "seq_lens",
        "out_cache_loc",
        "positions",
        "kv_indptr",
        "kv_indices",
    )
    assert [getattr(a, n).dtype for n in names] == [np.dtype(np.int32)] * len(names)
    assert [getattr(a, n).tolist() for n in names] == [
        [row0, row1],
        [0, 0],
        [3, 2],
        [3, 2],
        [1, 2, 3, 4, 5],
        [0, 1, 2, 0, 1],
        [0, 3, 5],
        [1, 2, 3, 4, 5],
    ]
    d = c.prepare_decode(np.array([r1, r0], dtype=np.int32))
    assert [getattr(d, n).tolist() for n in names] == [
        [row1, row0],
        [2, 3],
        [1, 1],
        [3, 4],
        [6, 7],
        [2, 3],
        [],
        [],
    ]  # decode: O(batch), no rows
    assert [getattr(d, n).dtype for n in names] == [np.dtype(np.int32)] * len(names)
    assert c.free_size() == 13
    assert c.prepare_extend([r0], [14]) is None
    assert c.free_size() == 13
    with pytest.raises(ShapeError):
        c.prepare_extend([r0], [1, 2])
    with pytest.raises(DuplicateRequestError):
        c.prepare_decode([r0, r0])
    with pytest.raises(UnknownRequestError):
        c.prepare_decode([99])
    with pytest.raises(ShapeError):
        c.prepare_decode([-1])
    with pytest.raises(ShapeError):
        c.prepare_decode(np.array([0.0]))
    assert c.req_info(r0)[2] == 4


def test_pages_partial_tail_and_decode_boundary():
    c = Checked(32, 4, 32, page_size=4)
    assert c.num_slot_rows == 36
    rid, _, _ = c.add_req([])
    assert c.prepare_extend([rid], [6]).out_cache_loc.tolist() == [4, 5, 6, 7, 8, 9]
    assert c.prepare_extend([rid], [3]).out_cache_loc.tolist() == [10, 11, 12]
    assert [c.prepare_decode([rid]).out_cache_loc.tolist() for _ in range(4)] == [[13], [14], [15], [16]]
    assert c.free_size() == 32 - 4 * 4


def test_finish_caches_whole_pages_and_prefix_is_page_aligned():
    c = Checked(64, 4, 64, page_size=16)
    prompt = list(range(100, 130))  # 30 tokens: one whole page of 16 is cached
    rid, _, prefix_len = c.add_req(prompt[:-1])
    assert prefix_len == 0
    c.prepare_extend([rid], [30])
    assert c.cache_finished_req(rid, prompt) is True
    assert c.cache_finished_req(rid, prompt) is False  # idempotent
    assert c.free_req(rid) is False
    assert (c.evictable_size(), c.protected_size(), c.free_size()) == (16, 0, 48)
    rid2, _, prefix_len = c.add_req(prompt[:-1])
    assert prefix_len == 16
    assert c.protected_size() == 16
    assert c.req_slots(rid2).tolist() == list(range(16, 32))
    assert c.free_req(rid2) is True
    with pytest.raises(UnknownRequestError):
        c.free_req(1000)
    assert c.match_prefix(prompt)[0].tolist() == list(range(16, 32))


def test_duplicates_freed_exactly_and_unfinished_relocks():
    c = Checked(20, 4, 16)
    rc, _, _ = c.add_req([8, 9])
    rd, _, _ = c.add_req([8, 9, 10])
    c.prepare_extend([rc, rd], [3, 4])
    assert c.req_slots(rd).tolist() == [4, 5, 6, 7]
    c.cache_finished_req(rc, [8, 9, 10])
    c.cache_finished_req(rd, np.array([8, 9, 10, 11]))
    assert c.free_size() == 16
    assert c.match_prefix([8, 9, 10, 11])[0].tolist() == [1, 2, 3, 7]
    re_, _, pe = c.add_req([8, 9, 10, 11])
    c.prepare_extend([re_], [1])
    assert c.cache_unfinished_req(re_, [8, 9, 10, 11, 12]) == 5
    assert c.req_info(re_)[:3] == (c.req_info(re_)[0], 5, 5)
    assert c.protected_size() == 5
    with pytest.raises(ShapeError):
        c.cache_unfinished_req(re_, [8])
    c.free_req(re_)
    assert (c.evictable_size(), c.protected_size(), c.num_reqs()) == (5, 0, 0)
    assert c.evict(100) == 5
    assert c.free_size() == 20
    c.reset()


def test_disabled_cache_and_facade_rounding():
    c = Checked(16, 2, 16, page_size=4, disable_radix_cache=True)
    rid, _, p = c.add_req([1, 2, 3, 4, 5])
    assert p == 0
    c.prepare_extend([rid], [5])
    assert c.cache_unfinished_req(rid, [1, 2, 3, 4, 5]) == 0
    c.cache_finished_req(rid, [1, 2, 3, 4, 5])
    assert (c.free_size(), c.evictable_size()) == (16, 0)
    with pytest.raises(ShapeError):
        _rs.KVCache(10, 1, 8, page_size=4)
    assert usable_pool_tokens(4100, 16) == 4096
    kv = KVCache(4100, 2, 64, page_size=16)
    assert (kv.max_total_tokens, kv.core.num_slot_rows) == (4096, 4112)
    with pytest.raises(ValueError):
        KVCache(10, 2, 64, page_size=16)


def test_rows_run_out():
    c = Checked(16, 1, 8)
    c.add_req([1])
    assert c.add_req([1]) is None
    with pytest.raises(ShapeError):
        c.add_req([0] * 9)
    with pytest.raises(InvariantError):
        c.reset()


def test_lifecycle_reads_only_the_tokens_after_the_locked_prefix():
    # The prefix a request locked is known by its tree node: finishing or caching a chunk
    # neither reads nor compares those tokens again, so the new pages always go below it.
    c = Checked(32, 4, 32)
    r, _, _ = c.add_req([])
    c.prepare_extend([r], [4])
    c.cache_finished_req(r, [1, 2, 3, 4])
    r2, _, prefix = c.add_req([1, 2, 3, 4, 5])
    assert prefix == 4
    c.prepare_extend([r2], [2])
    assert c.cache_unfinished_req(r2, [9, 9, 9, 9, 5, 6]) == 6
    assert (c.req_info(r2)[:3], c.req_slots(r2).tolist()) == ((1, 6, 6), [1, 2, 3, 4, 5, 6])
    assert c.match_prefix([1, 2, 3, 4, 5, 6])[0].tolist() == [1, 2, 3, 4, 5, 6]
    assert c.match_prefix([9, 9])[0].tolist() == []
    assert c.free_req(r2)
    assert (c.free_size(), c.evictable_size(), c.protected_size()) == (26, 6, 0)


def test_out_of_range_inputs_are_refused_not_wrapped():
    c = Checked(32, 4, 32)
    r, _, _ = c.add_req([])
    c.prepare_extend([r], [3])
    c.cache_finished_req(r, [-1, 2, 3])
    with pytest.raises(ShapeError, match="does not fit in int64"):
        c.match_prefix(np.array([2**64 - 1, 2, 3], dtype=np.uint64))
    with pytest.raises(ShapeError, match="overflows i32"):
        c.match_prefix(np.array([2**31, 2, 3], dtype=np.uint64))
    assert c.match_prefix(np.array([3, 2], dtype=np.uint64))[0].tolist() == []
    with pytest.raises(ShapeError, match="cannot be allocated"):
        _rs.KVCache(16, 2**40, 2**20)
    with pytest.raises(ShapeError, match="cannot be allocated"):
        _rs.KVCache(16, 2, 2**63)
    with pytest.raises(ShapeError, match="cannot be allocated"):  # 2^31 cells: past int32
        _rs.KVCache(16, 2**11, 2**20)


def test_match_lens_and_dfs_weight_order_read_the_tree_without_changing_it():
    import numpy as np
    import pytest

    from pyserve import _rs

    kv = _rs.KVCache(64, 4, 32)
    a = kv.add_req(np.array([5, 6, 7], dtype=np.int32))
    assert a is not None and kv.prepare_extend([a[0]], [3]) is not None
    kv.cache_finished_req(a[0], np.array([5, 6, 7], dtype=np.int32))
    nodes = kv.num_nodes()
    tokens = np.array([5, 6, 9, 1, 5, 6, 7, 8], dtype=np.int32)
    offsets = [0, 3, 4, 8]  # [5 6 9], [1], [5 6 7 8]
    assert kv.match_lens(tokens, offsets).tolist() == [2, 0, 3]
    # [5 6 9] and [1] fully match no node (the cached [5 6 7] is one node): they sit at the
    # root, whose keys come first in their order; then [5 6 7 8], at the [5 6 7] node
    assert kv.dfs_weight_order(tokens, offsets).tolist() == [0, 1, 2]
    assert kv.num_nodes() == nodes  # no split
    for bad in ([0, 3, 4], [1, 3, 8], [0, 5, 4, 8]):
        with pytest.raises(_rs.ShapeError, match="offsets must rise"):
            kv.match_lens(tokens, bad)
