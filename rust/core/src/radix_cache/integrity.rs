//! Consistency check of the radix tree, for tests and debug builds of the scheduler.

use std::collections::HashSet;

use super::{RadixCache, ROOT};
use crate::error::{CoreError, CoreResult};

fn broken(msg: String) -> CoreError {
    CoreError::Invariant(msg)
}

impl RadixCache {
    /// Recomputes everything the tree caches about itself and compares.
    ///
    /// Checks: every live node is reachable from the root exactly once and dead ids are on the
    /// free list; parent/child links agree; each non-root key is non-empty, as long as its
    /// value, and filed under its first token; no KV slot appears twice or is below 1; a
    /// node's `lock_ref` is at least the sum of its children's (every lock passing through a
    /// child also counts on the parent); `evictable_size` / `protected_size` equal the sums
    /// over unlocked / locked nodes. Mutates nothing.
    ///
    /// Errors: [`CoreError::Invariant`] naming the first violation found.
    pub fn check_integrity(&self) -> CoreResult<()> {
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
            for (&first, &c) in &node.children {
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
                if child.key.is_empty() || child.key[0] != first {
                    return Err(broken(format!("node {c} filed under wrong token {first}")));
                }
                if child.key.len() != child.value.len() {
                    return Err(broken(format!("node {c} key/value lengths differ")));
                }
                for &s in &child.value {
                    if s < 1 || !seen_slots.insert(s) {
                        return Err(broken(format!("slot {s} invalid or held twice")));
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
        if evictable != self.evictable_size || protected != self.protected_size {
            return Err(broken(format!(
                "sizes evictable {}/{evictable} protected {}/{protected} (stored/recomputed)",
                self.evictable_size, self.protected_size
            )));
        }
        Ok(())
    }
}
