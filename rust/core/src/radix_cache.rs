//! The radix prefix cache: a radix tree from token-id sequences to the KV slots holding them.
//!
//! Nodes live in an arena (`Vec` of nodes plus a free list of ids); node 0 is the root, whose
//! key is empty. Each non-root node holds a non-empty run of whole pages of token ids (`key`,
//! a multiple of `page_size` long) and the KV slots of those tokens (`value`, same length,
//! whole allocator pages). A node's children are keyed by their first page of tokens, so
//! every match and every insert is page-aligned: a partial last page is never cached.
//!
//! A node with `lock_ref > 0` is on the prefix path of at least one running request: its slots
//! count towards `protected_size` and it is never evicted. Unlocked nodes count towards
//! `evictable_size`. Unlocked leaves are evicted least recently used first through a heap
//! (`radix_cache/evict.rs`). Access "time" is a monotonic counter, not wall-clock time, with
//! SGLang's order: every node an operation (`match_prefix`, `insert`) walks, from the root
//! down, gets that operation's time; every node it creates (a new leaf, the upper half of a
//! split) a later time of its own, in creation order, still before the next operation's.
//!
//! Node ids stay valid until the node is evicted or the cache is reset; a locked node is never
//! evicted. Splitting a node keeps the id of the deeper half, so ids held by requests (which
//! lock their node and every ancestor) stay valid across splits.
//!
//! The algorithm follows SGLang's `RadixCache` (python/sglang/srt/mem_cache/radix_cache.py);
//! the per-request lifecycle is in `kv_cache.rs`, the consistency check in
//! `radix_cache/integrity.rs`.

mod evict;
mod integrity;
mod schedule;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::allocator::TokenToKVPoolAllocator;
use crate::error::{CoreError, CoreResult};
use crate::fxhash::FxBuildHasher;
use crate::slot_runs::SlotRuns;
use smallvec::SmallVec;

/// Node id of the root. The root holds no tokens and is never locked, evicted or freed.
pub const ROOT: usize = 0;

/// The first page of a node's key, which files it among its parent's children. Pages of up
/// to 4 tokens (page size 1 is the default) are stored inline: looking up or removing a child
/// then reads no second heap buffer.
pub(crate) type PageKey = SmallVec<[i32; 4]>;

/// Children of a node, keyed by their first page of token ids.
pub(crate) type Children = HashMap<PageKey, usize, FxBuildHasher>;

#[derive(Debug, Clone, Default)]
pub(crate) struct Node {
    pub(crate) key: Vec<i32>,
    /// `key[..page_size]`, the key under which the parent files this node (kept inline so
    /// unlinking a node does not read its key buffer).
    pub(crate) first: PageKey,
    /// KV slots, one per token of `key`, as runs of consecutive slots: a cached prompt is
    /// usually one run, so matching, evicting and splitting cost per run, not per token.
    pub(crate) value: SlotRuns,
    pub(crate) parent: usize,
    pub(crate) children: Children,
    pub(crate) lock_ref: usize,
    pub(crate) last_access: u64,
    pub(crate) live: bool,
    /// Whether the LRU heap holds an entry for this node (never more than one).
    pub(crate) in_heap: bool,
}

/// Result of [`RadixCache::match_prefix`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatchResult {
    /// KV slots of the longest cached page-aligned prefix of the key, one per matched token.
    pub indices: Vec<i64>,
    /// Node where the match ends (its key ends exactly at the end of the match); [`ROOT`] if
    /// nothing matched. Lock it with [`RadixCache::inc_lock_ref`] to keep the prefix cached.
    pub last_node: usize,
}

/// LRU heap entry: (access time when pushed, node id), oldest first.
pub(crate) type HeapEntry = Reverse<(u64, usize)>;

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
    pub(crate) lru: BinaryHeap<HeapEntry>,
}

/// Length of the common prefix of `a` and `b`, rounded down to whole pages.
///
/// Compares 64-token chunks as slices first (a vectorised `bcmp`) and only scans the first
/// differing chunk token by token: a plain `take_while` loop is scalar and dominated inserts
/// and matches that walk over long cached prefixes (system prompts, chat histories).
fn common_prefix_len(a: &[i32], b: &[i32], page_size: usize) -> usize {
    const CHUNK: usize = 64;
    let len = a.len().min(b.len());
    let (a, b) = (&a[..len], &b[..len]);
    let mut n = 0;
    while n + CHUNK <= len && a[n..n + CHUNK] == b[n..n + CHUNK] {
        n += CHUNK;
    }
    n += a[n..]
        .iter()
        .zip(&b[n..])
        .take_while(|(x, y)| x == y)
        .count();
    if page_size == 1 {
        n
    } else {
        n - n % page_size
    }
}

impl RadixCache {
    /// Creates an empty cache whose keys are cut in pages of `page_size` tokens. With
    /// `disable = true` nothing is ever cached: `match_prefix` returns an empty match at the
    /// root and `insert` stores nothing.
    ///
    /// Errors: [`CoreError::ShapeMismatch`] if `page_size == 0`.
    pub fn new(page_size: usize, disable: bool) -> CoreResult<Self> {
        if page_size == 0 {
            return Err(CoreError::ShapeMismatch("page_size must be >= 1".into()));
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
            lru: BinaryHeap::new(),
        })
    }

    /// Tokens per page.
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

    /// The access time of a new operation (stamped on the root, where every walk starts).
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.nodes[ROOT].last_access = self.clock;
        self.clock
    }

    /// The time of a node the current operation creates: after every node it walked and
    /// every node it created before (SGLang stamps a new node with its creation time).
    fn created(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Stamps `node` and its ancestors with `now` (a walk from the root down to `node`).
    fn touch_path(&mut self, node: usize, now: u64) {
        let mut n = node;
        while n != ROOT {
            self.nodes[n].last_access = now;
            n = self.nodes[n].parent;
        }
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

    /// Splits `child` after its first `at` tokens (a whole number of pages, 0 < at < len): a
    /// new node takes the first `at` tokens and becomes `child`'s parent. Sizes do not change.
    /// Returns the new node.
    fn split(&mut self, child: usize, at: usize) -> usize {
        let ps = self.page_size;
        let parent = self.nodes[child].parent;
        let c = &mut self.nodes[child];
        let key: Vec<i32> = c.key.drain(..at).collect();
        let value = c.value.split_front(at);
        let (lock_ref, last_access) = (c.lock_ref, c.last_access);
        let child_first = PageKey::from_slice(&c.key[..ps]);
        c.first = child_first.clone();
        let first = PageKey::from_slice(&key[..ps]);
        let mut children = Children::default();
        children.insert(child_first, child);
        let id = self.new_node(Node {
            key,
            first: first.clone(),
            value,
            parent,
            children,
            lock_ref,
            last_access,
            live: true,
            in_heap: false,
        });
        self.nodes[child].parent = id;
        self.nodes[parent].children.insert(first, id);
        id
    }

    /// Walks down from `start` along the whole pages of `key` (the tokens after `start`'s
    /// path), splitting the last node if `key` ends (or diverges) inside it, and stamps every
    /// node on the way with `now`. Returns the matched length and the deepest node reached.
    fn descend(
        &mut self,
        start: usize,
        key: &[i32],
        now: u64,
        mut on_node: impl FnMut(&Node),
    ) -> (usize, usize) {
        let ps = self.page_size;
        let (mut node, mut pos) = (start, 0);
        while pos + ps <= key.len() {
            let Some(&child) = self.nodes[node].children.get(&key[pos..pos + ps]) else {
                break;
            };
            let plen = common_prefix_len(&self.nodes[child].key, &key[pos..], ps);
            // SGLang's order: the node walked into is used now, even when the walk ends
            // inside it; the upper half a split creates is newer than everything walked
            self.nodes[child].last_access = now;
            let child = if plen < self.nodes[child].key.len() {
                let upper = self.split(child, plen);
                self.nodes[upper].last_access = self.created();
                upper
            } else {
                child
            };
            on_node(&self.nodes[child]);
            pos += plen;
            node = child;
        }
        (pos, node)
    }

    /// Finds the longest cached page-aligned prefix of `key`.
    ///
    /// Mutates: splits the node in which the match ends, so that `last_node` ends exactly at
    /// the match; updates the access time of every node on the path. Disabled: empty, root.
    pub fn match_prefix(&mut self, key: &[i32]) -> MatchResult {
        self.match_below(ROOT, key)
            .expect("the root is always live")
    }

    /// [`Self::match_prefix`] of a key that continues the path of live node `node`: matches
    /// `key` below `node` and returns the slots of the matched part of `key` only (the path
    /// down to `node` is neither read nor returned). Disabled: empty, `node`.
    ///
    /// Errors (nothing changed): [`CoreError::UnknownNode`] if `node` is not live.
    pub fn match_below(&mut self, node: usize, key: &[i32]) -> CoreResult<MatchResult> {
        self.check_node(node)?;
        let now = self.tick();
        let mut indices = Vec::new();
        if self.disable {
            return Ok(MatchResult {
                indices,
                last_node: node,
            });
        }
        self.touch_path(node, now); // as a match from the root would
        let (_, last_node) = self.descend(node, key, now, |n| n.value.extend_into(&mut indices));
        self.push_if_evictable(last_node);
        Ok(MatchResult { indices, last_node })
    }

    /// Inserts the whole pages of `key` (the first `len - len % page_size` tokens) with KV
    /// slots `value` (one per token of `key`). Returns how many leading tokens of `key` were
    /// already cached (a multiple of `page_size`): the tree keeps its own slots for those, so
    /// `value[..n]` are duplicates the caller must free if it owns them (except those it
    /// matched itself). The new tail becomes an unlocked (evictable) leaf and its slots belong
    /// to the tree. Disabled: stores nothing, returns 0.
    ///
    /// Errors (nothing changed): [`CoreError::ShapeMismatch`] if `key.len() != value.len()`,
    /// [`CoreError::OutOfRange`] for a slot outside `1..2^31`.
    pub fn insert(&mut self, key: &[i32], value: &[i64]) -> CoreResult<usize> {
        if key.len() != value.len() {
            return Err(CoreError::ShapeMismatch(format!(
                "insert: key has {} tokens but value has {} slots",
                key.len(),
                value.len()
            )));
        }
        if let Some(&s) = value.iter().find(|&&s| s < 1 || s > i64::from(i32::MAX)) {
            return Err(CoreError::OutOfRange {
                what: "kv slot",
                value: s,
                low: 1,
                high: i64::from(i32::MAX) + 1,
            });
        }
        let end = key.len() - key.len() % self.page_size;
        let runs = SlotRuns::from_slots(&value[..end]);
        Ok(self.insert_below(ROOT, &key[..end], runs)?.0)
    }

    /// Inserts `key`, a whole number of pages that continues the path of live node `node`,
    /// with KV slots `value` (one per token). `node`'s path is known without reading its
    /// tokens again: a running request has it locked. The nodes from the root to `node` get
    /// the access time too, as if the whole key had been inserted.
    ///
    /// Returns `(n, not_taken)`: the first `n` tokens of `key` (a multiple of `page_size`)
    /// were already cached and the tree keeps its own slots for them, so it takes only
    /// `value[n..]` (as a new unlocked leaf) and gives back `value[..n]`. Disabled: takes
    /// nothing, returns `(0, value)`.
    ///
    /// Errors (nothing changed): [`CoreError::UnknownNode`] if `node` is not live,
    /// [`CoreError::ShapeMismatch`] if `key.len() != value.len()` or `key` is not whole pages.
    pub fn insert_below(
        &mut self,
        node: usize,
        key: &[i32],
        mut value: SlotRuns,
    ) -> CoreResult<(usize, SlotRuns)> {
        self.check_node(node)?;
        let ps = self.page_size;
        if key.len() != value.len() || !key.len().is_multiple_of(ps) {
            return Err(CoreError::ShapeMismatch(format!(
                "insert: key has {} tokens (page size {ps}) but value has {} slots",
                key.len(),
                value.len()
            )));
        }
        let now = self.tick();
        if self.disable {
            return Ok((0, value));
        }
        self.touch_path(node, now);
        let (pos, node) = self.descend(node, key, now, |_| {});
        let not_taken = value.split_front(pos);
        if pos < key.len() {
            let first = PageKey::from_slice(&key[pos..pos + ps]);
            let created = self.created();
            let id = self.new_node(Node {
                key: key[pos..].to_vec(),
                first: first.clone(),
                value,
                parent: node,
                children: Children::default(),
                lock_ref: 0,
                last_access: created,
                live: true,
                in_heap: false,
            });
            self.nodes[node].children.insert(first, id);
            self.evictable_size += key.len() - pos;
            self.push_if_evictable(id);
        } else {
            self.push_if_evictable(node);
        }
        Ok((pos, not_taken))
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
    /// tokens from protected to evictable (and unlocked leaves become eviction candidates).
    /// Unlocking the root is a no-op.
    ///
    /// Errors (nothing changed): [`CoreError::UnknownNode`], or [`CoreError::LockUnderflow`]
    /// if `node` or an ancestor is not locked.
    pub fn dec_lock_ref(&mut self, node: usize) -> CoreResult<()> {
        self.check_unlock(node)?;
        let mut n = node;
        while n != ROOT {
            let nd = &mut self.nodes[n];
            nd.lock_ref -= 1;
            let parent = nd.parent;
            if nd.lock_ref == 0 {
                self.protected_size -= nd.value.len();
                self.evictable_size += nd.value.len();
                self.push_if_evictable(n);
            }
            n = parent;
        }
        Ok(())
    }

    /// Empties the tree, freeing every slot it holds into `alloc`. Locks held by requests are
    /// dropped too, so call it only when no request is running.
    ///
    /// Errors: whatever `alloc.free_slot_runs` reports; the tree is then left unchanged.
    pub fn reset(&mut self, alloc: &mut TokenToKVPoolAllocator) -> CoreResult<()> {
        let mut slots = SlotRuns::new();
        for n in self.nodes.iter().filter(|n| n.live) {
            slots.append(&n.value);
        }
        alloc.free_slot_runs(&slots)?;
        let fresh = Self::new(self.page_size, self.disable)?;
        *self = Self {
            clock: self.clock,
            ..fresh
        };
        Ok(())
    }

    /// Visits the nodes on the path from `node` up to (not including) the root.
    pub(crate) fn path_to_root(&self, node: usize) -> impl Iterator<Item = usize> + '_ {
        let mut n = node;
        std::iter::from_fn(move || {
            if n == ROOT {
                return None;
            }
            let cur = n;
            n = self.nodes[n].parent;
            Some(cur)
        })
    }
}
