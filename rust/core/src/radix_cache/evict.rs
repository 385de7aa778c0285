//! LRU eviction of unlocked leaves without walking the tree.
//!
//! A binary min-heap holds `(access time, node)` entries, at most one per node (`in_heap`).
//! A node gets an entry when it becomes an unlocked leaf (a new leaf on insert, the last node
//! of a match, a node unlocked to 0, a parent whose last child was evicted) unless it already
//! has one. Entries are updated lazily, when popped: a node that was locked or gained a child
//! since loses its entry (it gets a new one when it is an unlocked leaf again); a node that
//! was accessed since is pushed back with its new time. An entry's time is thus never later
//! than its node's access time, so the first popped entry whose time equals its node's is
//! the least recently used unlocked leaf. The heap never holds more entries than nodes, and
//! `evict(n)` costs O((k + r) log h) for k evicted nodes and r entries refreshed or dropped,
//! each paid for by an earlier access, lock or insert.
//!
//! This is the lazy-update priority queue of textbook LRU caches; SGLang's `RadixCache`
//! instead collects the unlocked leaves into a fresh heap on each eviction.

use std::cmp::Reverse;

use super::{RadixCache, ROOT};
use crate::allocator::TokenToKVPoolAllocator;
use crate::error::CoreResult;
use crate::slot_runs::SlotRuns;

impl RadixCache {
    pub(crate) fn is_evictable_leaf(&self, id: usize) -> bool {
        let n = &self.nodes[id];
        id != ROOT && n.live && n.children.is_empty() && n.lock_ref == 0
    }

    /// Gives `id` a heap entry if it is an unlocked leaf without one (no-op otherwise).
    pub(crate) fn push_if_evictable(&mut self, id: usize) {
        if self.nodes[id].in_heap || !self.is_evictable_leaf(id) {
            return;
        }
        let n = &mut self.nodes[id];
        n.in_heap = true;
        self.lru.push(Reverse((n.last_access, id)));
    }

    /// Evicts least-recently-used unlocked leaves until at least `num_tokens` slots are freed
    /// or nothing is evictable; a parent left as an unlocked leaf becomes a candidate too.
    /// Returns the number of slots (tokens) freed: whole nodes, so possibly more than asked.
    ///
    /// Mutates: removes nodes, frees their pages into `alloc` (run by run).
    /// Errors: whatever `alloc.free_slot_runs` reports (a page of the tree already free: a
    /// broken invariant); nodes evicted before the error stay evicted.
    pub fn evict(
        &mut self,
        num_tokens: usize,
        alloc: &mut TokenToKVPoolAllocator,
    ) -> CoreResult<usize> {
        let mut freed = 0;
        while freed < num_tokens {
            let Some(Reverse((time, id))) = self.lru.pop() else {
                break;
            };
            self.nodes[id].in_heap = false;
            if !self.is_evictable_leaf(id) {
                continue; // locked or grew a child: pushed again once an unlocked leaf
            }
            let last_access = self.nodes[id].last_access;
            if last_access > time {
                self.nodes[id].in_heap = true; // accessed since the push: requeue
                self.lru.push(Reverse((last_access, id)));
                continue;
            }
            let (parent, value) = self.remove_leaf(id);
            freed += value.len();
            alloc.free_slot_runs(&value)?;
            self.push_if_evictable(parent);
        }
        Ok(freed)
    }

    /// Unlinks unlocked leaf `id` from its parent and puts the id on the free list. Returns
    /// the parent and the leaf's slots, which the caller must free.
    fn remove_leaf(&mut self, id: usize) -> (usize, SlotRuns) {
        let n = &mut self.nodes[id];
        n.live = false;
        let parent = n.parent;
        let first = std::mem::take(&mut n.first);
        n.key = Vec::new();
        let value = std::mem::take(&mut n.value);
        self.evictable_size -= value.len();
        self.nodes[parent].children.remove(&first);
        self.free_nodes.push(id);
        (parent, value)
    }
}
