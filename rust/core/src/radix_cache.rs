//! The radix prefix cache: a radix tree from token-id sequences to the KV slots holding them.
//!
//! Nodes live in an arena (`Vec` of nodes plus a free list of ids); node 0 is the root, whose
//! key is empty. Each non-root node holds a non-empty run of token ids (`key`) and the KV slots
//! of those tokens (`value`, same length). A node's children are keyed by their first token.
//!
//! A node with `lock_ref > 0` is on the prefix path of at least one running request: its slots
//! count towards `protected_size` and it is never evicted. Unlocked nodes count towards
//! `evictable_size`; unlocked leaves are evicted least recently used first. Access "time" is a
//! monotonic counter bumped once per `match_prefix` / `insert`, not wall-clock time.
//!
//! Node ids stay valid until the node is evicted or the cache is reset; a locked node is never
//! evicted. Splitting a node keeps the id of the deeper half, so ids held by requests (which
//! lock their node and every ancestor) stay valid across splits.
//!
//! The algorithm follows SGLang's `RadixCache` (python/sglang/srt/mem_cache/radix_cache.py).
//! The per-request lifecycle (`cache_finished_req`, ...) is in `radix_cache/lifecycle.rs` and
//! the consistency check in `radix_cache/integrity.rs`.

mod integrity;
mod lifecycle;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::allocator::TokenToKVPoolAllocator;
use crate::error::{CoreError, CoreResult};

/// Node id of the root. The root holds no tokens and is never locked, evicted or freed.
pub const ROOT: usize = 0;

#[derive(Debug, Clone, Default)]
pub(crate) struct Node {
    pub(crate) key: Vec<i32>,
    pub(crate) value: Vec<i64>,
    pub(crate) parent: usize,
    pub(crate) children: HashMap<i32, usize>,
    pub(crate) lock_ref: usize,
    pub(crate) last_access: u64,
    pub(crate) live: bool,
}

/// Result of [`RadixCache::match_prefix`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatchResult {
    /// KV slots of the longest cached prefix of the key, one per matched token.
    pub indices: Vec<i64>,
    /// Node where the match ends (its key ends exactly at the end of the match); [`ROOT`] if
    /// nothing matched. Lock it with [`RadixCache::inc_lock_ref`] to keep the prefix cached.
    pub last_node: usize,
}

/// Radix tree over token ids whose values are KV slots; see the module docs.
#[derive(Debug, Clone)]
pub struct RadixCache {
    pub(crate) nodes: Vec<Node>,
    pub(crate) free_nodes: Vec<usize>,
    page_size: usize,
    disable: bool,
    clock: u64,
    pub(crate) evictable_size: usize,
    pub(crate) protected_size: usize,
}

fn common_prefix_len(a: &[i32], b: &[i32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl RadixCache {
    /// Creates an empty cache. With `disable = true` nothing is ever cached: `match_prefix`
    /// returns an empty match at the root and `insert` stores nothing.
    ///
    /// Errors: [`CoreError::ShapeMismatch`] if `page_size != 1` (paged keys are not
    /// implemented yet).
    pub fn new(page_size: usize, disable: bool) -> CoreResult<Self> {
        if page_size != 1 {
            return Err(CoreError::ShapeMismatch(format!(
                "page_size must be 1 for now, got {page_size}"
            )));
        }
        let root = Node {
            live: true,
            ..Node::default()
        };
        Ok(Self {
            nodes: vec![root],
            free_nodes: Vec::new(),
            page_size,
            disable,
            clock: 0,
            evictable_size: 0,
            protected_size: 0,
        })
    }

    /// Tokens per page (always 1).
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Whether the cache was created disabled.
    pub fn disabled(&self) -> bool {
        self.disable
    }

    /// Tokens (= KV slots) held by unlocked nodes; these can be freed by [`Self::evict`].
    pub fn evictable_size(&self) -> usize {
        self.evictable_size
    }

    /// Tokens held by locked nodes (on the prefix path of a running request).
    pub fn protected_size(&self) -> usize {
        self.protected_size
    }

    /// All tokens held by the tree: `evictable_size() + protected_size()`.
    pub fn total_size(&self) -> usize {
        self.evictable_size + self.protected_size
    }

    /// Number of live nodes, root included.
    pub fn num_nodes(&self) -> usize {
        self.nodes.len() - self.free_nodes.len()
    }

    /// Lock count of `node`. Errors: [`CoreError::UnknownNode`] if it is not a live node.
    pub fn lock_ref(&self, node: usize) -> CoreResult<usize> {
        self.check_node(node)?;
        Ok(self.nodes[node].lock_ref)
    }

    pub(crate) fn check_node(&self, node: usize) -> CoreResult<()> {
        if node < self.nodes.len() && self.nodes[node].live {
            Ok(())
        } else {
            Err(CoreError::UnknownNode(node))
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.nodes[ROOT].last_access = self.clock;
        self.clock
    }

    fn new_node(&mut self, node: Node) -> usize {
        match self.free_nodes.pop() {
            Some(id) => {
                self.nodes[id] = node;
                id
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        }
    }

    /// Splits `child` after its first `at` tokens (0 < at < len): a new node takes the first
    /// `at` tokens and becomes `child`'s parent. Sizes do not change. Returns the new node.
    fn split(&mut self, child: usize, at: usize) -> usize {
        let parent = self.nodes[child].parent;
        let c = &mut self.nodes[child];
        let key: Vec<i32> = c.key.drain(..at).collect();
        let value: Vec<i64> = c.value.drain(..at).collect();
        let (lock_ref, last_access, child_first) = (c.lock_ref, c.last_access, c.key[0]);
        let first = key[0];
        let id = self.new_node(Node {
            key,
            value,
            parent,
            children: HashMap::from([(child_first, child)]),
            lock_ref,
            last_access,
            live: true,
        });
        self.nodes[child].parent = id;
        self.nodes[parent].children.insert(first, id);
        id
    }

    /// Walks down from the root along `key`, splitting the last node if `key` ends (or
    /// diverges) inside it, and stamps every node on the path with `now`. Returns the matched
    /// length and the deepest node reached.
    fn descend(&mut self, key: &[i32], now: u64, mut on_node: impl FnMut(&Node)) -> (usize, usize) {
        let (mut node, mut pos) = (ROOT, 0);
        while pos < key.len() {
            let Some(&child) = self.nodes[node].children.get(&key[pos]) else {
                break;
            };
            let plen = common_prefix_len(&self.nodes[child].key, &key[pos..]);
            let child = if plen < self.nodes[child].key.len() {
                self.split(child, plen)
            } else {
                child
            };
            self.nodes[child].last_access = now;
            on_node(&self.nodes[child]);
            pos += plen;
            node = child;
        }
        (pos, node)
    }

    /// Finds the longest cached prefix of `key`.
    ///
    /// Mutates: splits the node in which the match ends, so that `last_node` ends exactly at
    /// the match; updates the access time of every node on the path. Disabled: empty, root.
    pub fn match_prefix(&mut self, key: &[i32]) -> MatchResult {
        let now = self.tick();
        let mut indices = Vec::new();
        if self.disable {
            return MatchResult {
                indices,
                last_node: ROOT,
            };
        }
        let (_, last_node) = self.descend(key, now, |n| indices.extend_from_slice(&n.value));
        MatchResult { indices, last_node }
    }

    /// Inserts `key` with KV slots `value` (one per token). Returns how many leading tokens of
    /// `key` were already cached: the tree keeps its own slots for those, so `value[..n]` are
    /// duplicates the caller must free if it owns them (except those it matched itself).
    /// The new tail becomes an unlocked (evictable) leaf. Disabled: stores nothing, returns 0.
    ///
    /// Errors: [`CoreError::ShapeMismatch`] if `key.len() != value.len()` (nothing changed).
    pub fn insert(&mut self, key: &[i32], value: &[i64]) -> CoreResult<usize> {
        if key.len() != value.len() {
            return Err(CoreError::ShapeMismatch(format!(
                "insert: key has {} tokens but value has {} slots",
                key.len(),
                value.len()
            )));
        }
        let now = self.tick();
        if self.disable {
            return Ok(0);
        }
        let (pos, node) = self.descend(key, now, |_| {});
        if pos < key.len() {
            let id = self.new_node(Node {
                key: key[pos..].to_vec(),
                value: value[pos..].to_vec(),
                parent: node,
                children: HashMap::new(),
                lock_ref: 0,
                last_access: now,
                live: true,
            });
            self.nodes[node].children.insert(key[pos], id);
            self.evictable_size += key.len() - pos;
        }
        Ok(pos)
    }

    /// Evicts least-recently-used unlocked leaves until at least `num_tokens` slots are freed
    /// or nothing is evictable; a parent left as an unlocked leaf becomes a candidate too.
    /// Returns the number of slots freed (may exceed `num_tokens` by part of a node).
    ///
    /// Mutates: removes nodes, frees their slots into `alloc`.
    /// Errors: whatever `alloc.free` reports (a slot of the tree already free: a broken
    /// invariant); nodes evicted before the error stay evicted.
    pub fn evict(
        &mut self,
        num_tokens: usize,
        alloc: &mut TokenToKVPoolAllocator,
    ) -> CoreResult<usize> {
        let mut heap: BinaryHeap<Reverse<(u64, usize)>> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(id, n)| *id != ROOT && n.live && n.children.is_empty() && n.lock_ref == 0)
            .map(|(id, n)| Reverse((n.last_access, id)))
            .collect();
        let mut freed = 0;
        while freed < num_tokens {
            let Some(Reverse((_, id))) = heap.pop() else {
                break;
            };
            alloc.free(&self.nodes[id].value)?;
            let parent = self.remove_leaf(id);
            freed += self.nodes[id].value.len();
            self.nodes[id].value.clear();
            let p = &self.nodes[parent];
            if parent != ROOT && p.children.is_empty() && p.lock_ref == 0 {
                heap.push(Reverse((p.last_access, parent)));
            }
        }
        Ok(freed)
    }

    /// Unlinks unlocked leaf `id` from its parent and puts the id on the free list; its value
    /// is left in place for the caller. Returns the parent.
    fn remove_leaf(&mut self, id: usize) -> usize {
        let n = &mut self.nodes[id];
        n.live = false;
        let (parent, first, len) = (n.parent, n.key[0], n.value.len());
        n.key.clear();
        self.evictable_size -= len;
        self.nodes[parent].children.remove(&first);
        self.free_nodes.push(id);
        parent
    }

    /// Locks `node` and all its ancestors (one more running request uses this prefix). Nodes
    /// whose count goes 0 -> 1 move their tokens from evictable to protected. Locking the root
    /// is a no-op.
    ///
    /// Errors: [`CoreError::UnknownNode`] if `node` is not live (nothing changed).
    pub fn inc_lock_ref(&mut self, node: usize) -> CoreResult<()> {
        self.check_node(node)?;
        let mut n = node;
        while n != ROOT {
            let nd = &mut self.nodes[n];
            if nd.lock_ref == 0 {
                self.evictable_size -= nd.value.len();
                self.protected_size += nd.value.len();
            }
            nd.lock_ref += 1;
            n = nd.parent;
        }
        Ok(())
    }

    /// Checks that [`Self::dec_lock_ref`] on `node` would succeed, without changing anything.
    pub fn check_unlock(&self, node: usize) -> CoreResult<()> {
        self.check_node(node)?;
        let mut n = node;
        while n != ROOT {
            if self.nodes[n].lock_ref == 0 {
                return Err(CoreError::LockUnderflow(n));
            }
            n = self.nodes[n].parent;
        }
        Ok(())
    }

    /// Undoes one [`Self::inc_lock_ref`] on `node`: nodes whose count goes 1 -> 0 move their
    /// tokens from protected to evictable. Unlocking the root is a no-op.
    ///
    /// Errors (nothing changed): [`CoreError::UnknownNode`], or [`CoreError::LockUnderflow`]
    /// if `node` or an ancestor is not locked.
    pub fn dec_lock_ref(&mut self, node: usize) -> CoreResult<()> {
        self.check_unlock(node)?;
        let mut n = node;
        while n != ROOT {
            let nd = &mut self.nodes[n];
            nd.lock_ref -= 1;
            if nd.lock_ref == 0 {
                self.protected_size -= nd.value.len();
                self.evictable_size += nd.value.len();
            }
            n = nd.parent;
        }
        Ok(())
    }

    /// Empties the tree, freeing every slot it holds into `alloc`. Locks held by requests are
    /// dropped too, so call it only when no request is running.
    ///
    /// Errors: whatever `alloc.free` reports; the tree is then left unchanged.
    pub fn reset(&mut self, alloc: &mut TokenToKVPoolAllocator) -> CoreResult<()> {
        let slots: Vec<i64> = self
            .nodes
            .iter()
            .filter(|n| n.live)
            .flat_map(|n| n.value.iter().copied())
            .collect();
        alloc.free(&slots)?;
        let fresh = Self::new(self.page_size, self.disable)?;
        *self = Self {
            clock: self.clock,
            ..fresh
        };
        Ok(())
    }
}
