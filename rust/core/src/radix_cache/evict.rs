//! LRU eviction of unlocked leaves without walking the tree.
//!
//! A binary min-heap holds `(last_access, stamp, node)` entries. Each push gives the node a
//! fresh stamp, so a node has at most one valid entry: the one whose stamp equals the node's
//! `heap_stamp`. Entries are pushed whenever a node becomes (or stays, with a new access
//! time) an unlocked leaf: a new leaf on insert, the last node of a match, a node unlocked to
//! 0, a parent whose last child was evicted. Entries that went stale (the node was locked,
//! gained a child, was accessed again or evicted) are skipped when popped. `evict(n)` thus
//! costs O((k + s) log h) for k evicted nodes and s stale entries; the heap is rebuilt from
//! the live leaves when stale entries outnumber live nodes, so s is amortised O(k).

use std::cmp::Reverse;

use super::{RadixCache, ROOT};
use crate::allocator::TokenToKVPoolAllocator;
use crate::error::CoreResult;

impl RadixCache {
    fn is_evictable_leaf(&self, id: usize) -> bool {
        let n = &self.nodes[id];
        id != ROOT && n.live && n.children.is_empty() && n.lock_ref == 0
    }

    /// Gives `id` a fresh heap entry if it is an unlocked leaf (no-op otherwise).
    pub(crate) fn push_if_evictable(&mut self, id: usize) {
        if !self.is_evictable_leaf(id) {
            return;
        }
        self.next_stamp += 1;
        let n = &mut self.nodes[id];
        n.heap_stamp = self.next_stamp;
        self.lru.push(Reverse((n.last_access, self.next_stamp, id)));
        if self.lru.len() > 2 * self.nodes.len() + 64 {
            self.rebuild_lru();
        }
    }

    /// Replaces the heap by one entry per current unlocked leaf (O(n)).
    fn rebuild_lru(&mut self) {
        self.lru.clear();
        for id in 0..self.nodes.len() {
            if self.is_evictable_leaf(id) {
                self.next_stamp += 1;
                let n = &mut self.nodes[id];
                n.heap_stamp = self.next_stamp;
                self.lru.push(Reverse((n.last_access, self.next_stamp, id)));
            }
        }
    }

    /// Whether a popped entry is the node's current one and the node is still evictable.
    pub(crate) fn entry_is_valid(&self, stamp: u64, id: usize) -> bool {
        id < self.nodes.len() && self.nodes[id].heap_stamp == stamp && self.is_evictable_leaf(id)
    }

    /// Evicts least-recently-used unlocked leaves until at least `num_tokens` slots are freed
    /// or nothing is evictable; a parent left as an unlocked leaf becomes a candidate too.
    /// Returns the number of slots (tokens) freed: whole nodes, so possibly more than asked.
    ///
    /// Mutates: removes nodes, frees their pages into `alloc`.
    /// Errors: whatever `alloc.free` reports (a page of the tree already free: a broken
    /// invariant); nodes evicted before the error stay evicted.
    pub fn evict(
        &mut self,
        num_tokens: usize,
        alloc: &mut TokenToKVPoolAllocator,
    ) -> CoreResult<usize> {
        let mut freed = 0;
        while freed < num_tokens {
            let Some(Reverse((_, stamp, id))) = self.lru.pop() else {
                break;
            };
            if !self.entry_is_valid(stamp, id) {
                continue;
            }
            alloc.free(&self.nodes[id].value)?;
            freed += self.nodes[id].value.len();
            let parent = self.remove_leaf(id);
            self.push_if_evictable(parent);
        }
        Ok(freed)
    }

    /// Unlinks unlocked leaf `id` from its parent and puts the id on the free list. Returns
    /// the parent.
    fn remove_leaf(&mut self, id: usize) -> usize {
        let ps = self.page_size();
        let n = &mut self.nodes[id];
        n.live = false;
        n.heap_stamp = 0;
        let parent = n.parent;
        let first: Box<[i32]> = n.key[..ps].into();
        self.evictable_size -= n.value.len();
        n.key = Vec::new();
        n.value = Vec::new();
        self.nodes[parent].children.remove(&first);
        self.free_nodes.push(id);
        parent
    }
}
