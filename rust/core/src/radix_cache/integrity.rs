//! Consistency check of the radix tree, for tests and debug builds of the scheduler.

use std::cmp::Reverse;
use std::collections::{HashMap, HashSet};

use super::{RadixCache, ROOT};
use crate::error::{CoreError, CoreResult};

fn broken(msg: String) -> CoreError {
    CoreError::Invariant(msg)
}

impl RadixCache {
    /// Recomputes everything the tree caches about itself and compares.
    ///
    /// Checks: every live node is reachable from the root exactly once and dead ids are on the
    /// free list; parent/child links agree; each non-root key is a non-empty whole number of
    /// pages, as long as its value, and filed under its first page; each value is a run of
    /// whole pages (`p * page_size + 0, 1, ...`); no KV slot appears twice or lies in the
    /// reserved page 0; the LRU heap holds exactly one entry per node marked `in_heap`, for
    /// live nodes only, none later than its node's access time, and every unlocked leaf is
    /// marked; a
    /// node's `lock_ref` is at least the sum of its children's (every lock passing through a
    /// child also counts on the parent); `evictable_size` / `protected_size` equal the sums
    /// over unlocked / locked nodes. Mutates nothing.
    ///
    /// Errors: [`CoreError::Invariant`] naming the first violation found.
    pub fn check_integrity(&self) -> CoreResult<()> {
        let ps = self.page_size();
        let root = &self.nodes[ROOT];
        if !root.live || !root.key.is_empty() || !root.value.is_empty() || root.lock_ref != 0 {
            return Err(broken("root must be live, empty and unlocked".into()));
        }
        let (mut evictable, mut protected) = (0usize, 0usize);
        let mut seen_nodes = HashSet::from([ROOT]);
        let mut seen_slots = HashSet::new();
        let mut stack = vec![ROOT];
        while let Some(id) = stack.pop() {
            let node = &self.nodes[id];
            let mut child_locks = 0;
            for (first, &c) in &node.children {
                let child = self
                    .nodes
                    .get(c)
                    .filter(|n| n.live)
                    .ok_or_else(|| broken(format!("node {id} has dead child {c}")))?;
                if !seen_nodes.insert(c) {
                    return Err(broken(format!("node {c} reachable twice")));
                }
                if child.parent != id {
                    return Err(broken(format!("node {c} parent {} != {id}", child.parent)));
                }
                if child.key.is_empty()
                    || child.key.len() % ps != 0
                    || child.key[..ps] != **first
                    || child.first != *first
                {
                    return Err(broken(format!(
                        "node {c} empty, not whole pages or misfiled"
                    )));
                }
                if child.key.len() != child.value.len() || !child.value.is_well_formed() {
                    return Err(broken(format!("node {c} key/value lengths differ")));
                }
                let slots: Vec<i64> = child.value.iter().map(i64::from).collect();
                for (i, &s) in slots.iter().enumerate() {
                    let page_start = slots[i - i % ps];
                    let whole = page_start % ps as i64 == 0 && s == page_start + (i % ps) as i64;
                    if s < ps as i64 || !whole || !seen_slots.insert(s) {
                        return Err(broken(format!(
                            "node {c}: slot {s} invalid, not paged or held twice"
                        )));
                    }
                }
                if child.lock_ref > 0 {
                    protected += child.value.len();
                } else {
                    evictable += child.value.len();
                }
                child_locks += child.lock_ref;
                stack.push(c);
            }
            if id != ROOT && node.lock_ref < child_locks {
                return Err(broken(format!(
                    "node {id} lock_ref {} < children's {child_locks}",
                    node.lock_ref
                )));
            }
        }
        let live = self.nodes.iter().filter(|n| n.live).count();
        if live != seen_nodes.len() || live + self.free_nodes.len() != self.nodes.len() {
            return Err(broken(format!(
                "{live} live nodes, {} reachable, {} free ids, arena {}",
                seen_nodes.len(),
                self.free_nodes.len(),
                self.nodes.len()
            )));
        }
        if self.free_nodes.iter().any(|&f| self.nodes[f].live) {
            return Err(broken("a live node is on the free list".into()));
        }
        let mut entries: HashMap<usize, u64> = HashMap::new();
        for &Reverse((time, id)) in self.lru.iter() {
            let n = self.nodes.get(id).filter(|n| n.live && n.in_heap);
            if n.is_none_or(|n| time > n.last_access) || entries.insert(id, time).is_some() {
                return Err(broken(format!(
                    "LRU heap entry ({time}, {id}): dead node, not marked, later than its \
                     access time, or a second entry"
                )));
            }
        }
        for (id, n) in self.nodes.iter().enumerate() {
            if n.in_heap != entries.contains_key(&id) {
                return Err(broken(format!(
                    "node {id} in_heap flag disagrees with the heap"
                )));
            }
            if self.is_evictable_leaf(id) && !n.in_heap {
                return Err(broken(format!("unlocked leaf {id} has no LRU heap entry")));
            }
        }
        if evictable != self.evictable_size || protected != self.protected_size {
            return Err(broken(format!(
                "sizes evictable {}/{evictable} protected {}/{protected} (stored/recomputed)",
                self.evictable_size, self.protected_size
            )));
        }
        Ok(())
    }
}
