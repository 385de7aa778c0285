"""The baseline of bench_radix_cache.py: KV bookkeeping in plain Python, written for clarity.

A radix tree of token ids -> KV slots (page size 1) with LRU eviction of unlocked leaves, a
FIFO slot allocator and request rows, doing what pyserve's Rust `KVCache` does for the
scheduler: admit (match + lock + row), finish (insert, free duplicates, unlock, free row),
evict, and build a decode step's arrays. It follows the textbook structure (and SGLang's
Python `RadixCache`): dict children keyed by first token, token-by-token key comparison,
eviction by collecting the unlocked leaves into a heap. Nothing here is deliberately slow;
it is also not optimised beyond plain idiomatic Python.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

import numpy as np


class Node:
    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access")

    def __init__(self, key: list[int], value: list[int], parent: Node | None, now: int) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.lock_ref = 0
        self.last_access = now


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PyKVCache:
    """Slots 1..size, `num_rows` request rows, a radix cache; requests keyed by an int id."""

    def __init__(self, size: int, num_rows: int) -> None:
        self.free_slots: deque[int] = deque(range(1, size + 1))
        self.rows: list[list[int]] = [[] for _ in range(num_rows)]
        self.free_rows = deque(range(num_rows))
        self.root = Node([], [], None, 0)
        self.clock = itertools.count(1)
        self.evictable_size = 0
        self.reqs: dict[int, tuple[int, int, Node]] = {}  # req_id -> (row, prefix_len, node)
        self.next_req_id = 0

    # ---- tree ----------------------------------------------------------------------------------
    def _split(self, child: Node, at: int) -> Node:
        new = Node(child.key[:at], child.value[:at], child.parent, child.last_access)
        new.lock_ref = child.lock_ref
        new.children = {child.key[at]: child}
        child.parent.children[child.key[0]] = new
        child.key, child.value, child.parent = child.key[at:], child.value[at:], new
        return new

    def match_prefix(self, key: list[int]) -> tuple[list[int], Node]:
        now = next(self.clock)
        node, pos, value = self.root, 0, []
        while pos < len(key) and key[pos] in node.children:
            child = node.children[key[pos]]
            n = common_prefix_len(child.key, key[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            value.extend(child.value)
            pos += n
            node = child
        return value, node

    def insert(self, key: list[int], value: list[int]) -> int:
        now = next(self.clock)
        node, pos = self.root, 0
        while pos < len(key) and key[pos] in node.children:
            child = node.children[key[pos]]
            n = common_prefix_len(child.key, key[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pos += n
            node = child
        if pos < len(key):
            leaf = Node(key[pos:], value[pos:], node, now)
            node.children[key[pos]] = leaf
            self.evictable_size += len(key) - pos
        return pos

    def _lock(self, node: Node, delta: int) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.value)
            node.lock_ref += delta
            if node.lock_ref == 0:
                self.evictable_size += len(node.value)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root and not node.children and node.lock_ref == 0:
                leaves.append((node.last_access, id(node), node))
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            _, _, node = heapq.heappop(leaves)
            self.free_slots.extend(node.value)
            freed += len(node.value)
            self.evictable_size -= len(node.value)
            parent = node.parent
            del parent.children[node.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed

    # ---- requests ------------------------------------------------------------------------------
    def add_req(self, key: list[int]) -> tuple[int, int]:
        prefix, node = self.match_prefix(key)
        row = self.free_rows.popleft()
        self.rows[row] = list(prefix)
        self._lock(node, +1)
        req_id = self.next_req_id
        self.next_req_id += 1
        self.reqs[req_id] = (row, len(prefix), node)
        return req_id, len(prefix)

    def extend(self, req_id: int, n: int) -> list[int]:
        if len(self.free_slots) < n:
            self.evict(n - len(self.free_slots))
        slots = [self.free_slots.popleft() for _ in range(n)]
        self.rows[self.reqs[req_id][0]].extend(slots)
        return slots

    def cache_finished_req(self, req_id: int, token_ids: list[int]) -> None:
        row, prefix_len, node = self.reqs.pop(req_id)
        slots = self.rows[row]
        cached = self.insert(token_ids, slots)
        self.free_slots.extend(slots[prefix_len:cached])
        self._lock(node, -1)
        self.free_rows.append(row)

    def prepare_decode(self, req_ids: list[int]) -> tuple[np.ndarray, ...]:
        """One new slot per request; (out_cache_loc, positions, kv_indptr, kv_indices) int32
        arrays (the dtype the Rust core builds them in)."""
        if len(self.free_slots) < len(req_ids):
            self.evict(len(req_ids) - len(self.free_slots))
        out_cache_loc, positions, kv_indptr, kv_indices = [], [], [0], []
        for req_id in req_ids:
            row = self.rows[self.reqs[req_id][0]]
            slot = self.free_slots.popleft()
            positions.append(len(row))
            row.append(slot)
            out_cache_loc.append(slot)
            kv_indices.extend(row)
            kv_indptr.append(len(kv_indices))
        return tuple(np.array(x, dtype=np.int32) for x in (out_cache_loc, positions, kv_indptr, kv_indices))
