//! `KVCache`: all KV bookkeeping of one scheduler behind one object, and the request
//! lifecycle on it.
//!
//! It owns the page allocator, the request rows and the radix cache, and tracks every
//! admitted request by a `req_id` it hands out (increasing, never reused). For each request it
//! knows the row (`req_pool_idx`), the cached prefix the request locked (`prefix_len` tokens
//! ending at tree node `last_node`, always whole pages) and `kv_len`, the tokens whose KV is
//! stored. Row columns `[0, prefix_len)` hold tree slots; columns `[prefix_len, kv_len)` hold
//! the request's own pages, the last one possibly partly filled. The own slots are also kept
//! as runs (`own`, per row, appended as they are allocated), which the tree takes over when
//! the request is cached and the allocator takes back when it is dropped: neither reads the
//! row again.
//!
//! The delicate sequences (insert, free the duplicate pages the tree already held, re-match
//! and re-lock, free the row) each happen inside ONE call here, never orchestrated from
//! Python (DESIGN.md section 4). Finishing or aborting a request twice is a no-op returning
//! `false`: ids are never reused, so an id below the next one that is not live is known to be
//! released already. The per-step calls are in `batch.rs`, the global check in
//! `kv_cache/integrity.rs`.

mod integrity;

use std::collections::HashMap;

use crate::allocator::TokenToKVPoolAllocator;
use crate::error::{CoreError, CoreResult};
use crate::fxhash::FxBuildHasher;
use crate::radix_cache::{MatchResult, RadixCache, ROOT};
use crate::req_to_token::ReqToTokenPool;
use crate::slot_runs::SlotRuns;

/// What `KVCache` knows about one admitted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReqState {
    /// The request's row in the request pool.
    pub req_pool_idx: usize,
    /// Tokens of the locked cached prefix (tree slots at the start of the row); whole pages.
    pub prefix_len: usize,
    /// Tree node where the locked prefix ends ([`ROOT`] for none).
    pub last_node: usize,
    /// Tokens whose KV is stored (row columns `[0, kv_len)` are valid slots).
    pub kv_len: usize,
}

/// Returned by [`KVCache::add_req`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmittedReq {
    /// Handle of the request for every later call.
    pub req_id: u64,
    /// The request's row.
    pub req_pool_idx: usize,
    /// Tokens of the key found in the cache (a multiple of `page_size`); their KV is reused.
    pub prefix_len: usize,
}

/// KV pages, request rows, radix cache and the admitted requests; see the module docs.
#[derive(Debug, Clone)]
pub struct KVCache {
    /// The radix prefix cache.
    pub tree: RadixCache,
    /// The KV page allocator.
    pub alloc: TokenToKVPoolAllocator,
    /// The request rows.
    pub req_pool: ReqToTokenPool,
    pub(crate) reqs: HashMap<u64, ReqState, FxBuildHasher>,
    pub(crate) next_req_id: u64,
    /// Per row: the own slots (columns `[prefix_len, kv_len)`) of the request holding it.
    pub(crate) own: Vec<SlotRuns>,
}

impl KVCache {
    /// A cache of `size` KV slots (tokens) in pages of `page_size`, `num_rows` request rows of
    /// `max_context_len` tokens each, prefix caching off if `disable`.
    ///
    /// Errors: [`CoreError::ShapeMismatch`] if `page_size == 0`, `size % page_size != 0`, a
    /// slot would not fit in `i32`, or the `num_rows x max_context_len` table cannot be
    /// allocated.
    pub fn new(
        size: usize,
        page_size: usize,
        num_rows: usize,
        max_context_len: usize,
        disable: bool,
    ) -> CoreResult<Self> {
        Ok(Self {
            tree: RadixCache::new(page_size, disable)?,
            alloc: TokenToKVPoolAllocator::new(size, page_size)?,
            req_pool: ReqToTokenPool::new(num_rows, max_context_len)?,
            reqs: HashMap::default(),
            next_req_id: 0,
            own: vec![SlotRuns::new(); num_rows],
        })
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.alloc.page_size()
    }

    /// Free slots plus slots eviction can reclaim (tokens).
    pub fn available_size(&self) -> usize {
        self.alloc.available_size() + self.tree.evictable_size()
    }

    /// Number of admitted (live) requests.
    pub fn num_reqs(&self) -> usize {
        self.reqs.len()
    }

    /// State of live request `req_id`. Errors: [`CoreError::UnknownReq`].
    pub fn req(&self, req_id: u64) -> CoreResult<ReqState> {
        self.reqs
            .get(&req_id)
            .copied()
            .ok_or(CoreError::UnknownReq(req_id))
    }

    /// Row columns `[0, kv_len)` of live request `req_id`: the KV slot of each stored token.
    pub fn req_slots(&self, req_id: u64) -> CoreResult<&[i32]> {
        let r = self.req(req_id)?;
        self.req_pool.read(r.req_pool_idx, 0, r.kv_len)
    }

    /// Cached page-aligned prefix length of each key, changing nothing (the `lpm` policy).
    pub fn match_lens(&self, keys: &[&[i32]]) -> Vec<usize> {
        keys.iter().map(|k| self.tree.match_node(k).1).collect()
    }

    /// See [`RadixCache::match_unlocked`].
    pub fn match_unlocked(&self, key: &[i32]) -> (usize, usize) {
        self.tree.match_unlocked(key)
    }

    /// The `dfs-weight` admission order of requests with these keys (indices into `keys`;
    /// see [`RadixCache::dfs_weight_order`]). Changes nothing.
    pub fn dfs_weight_order(&self, keys: &[&[i32]]) -> Vec<usize> {
        self.tree.dfs_weight_order(keys)
    }

    /// Longest cached page-aligned prefix of `key` (see [`RadixCache::match_prefix`]).
    pub fn match_prefix(&mut self, key: &[i32]) -> MatchResult {
        self.tree.match_prefix(key)
    }

    /// Evicts LRU unlocked leaves until `num_tokens` slots are freed (see
    /// [`RadixCache::evict`]); returns the slots freed.
    pub fn evict(&mut self, num_tokens: usize) -> CoreResult<usize> {
        self.tree.evict(num_tokens, &mut self.alloc)
    }

    /// Admits a request: matches `key` (the tokens whose cached KV it may reuse; the caller
    /// leaves out at least the last prompt token, whose logits it needs), takes a row, writes
    /// the prefix's slots into it and locks the prefix. `Ok(None)`, with nothing changed,
    /// when no row is free.
    ///
    /// Errors (nothing changed): [`CoreError::OutOfRange`] if `key` is longer than a row.
    pub fn add_req(&mut self, key: &[i32]) -> CoreResult<Option<AdmittedReq>> {
        let max = self.req_pool.max_context_len();
        if key.len() > max {
            return Err(CoreError::OutOfRange {
                what: "key length",
                value: key.len() as i64,
                low: 0,
                high: max as i64 + 1,
            });
        }
        if self.req_pool.available_size() == 0 {
            return Ok(None);
        }
        let m = self.tree.match_prefix(key);
        let row = self.req_pool.alloc().expect("a row is free");
        self.req_pool.write(row, 0, &m.indices)?;
        self.own[row] = SlotRuns::new();
        self.tree.inc_lock_ref(m.last_node)?;
        let req_id = self.next_req_id;
        self.next_req_id += 1;
        let prefix_len = m.indices.len();
        self.reqs.insert(
            req_id,
            ReqState {
                req_pool_idx: row,
                prefix_len,
                last_node: m.last_node,
                kv_len: prefix_len,
            },
        );
        Ok(Some(AdmittedReq {
            req_id,
            req_pool_idx: row,
            prefix_len,
        }))
    }

    /// The live state of `req_id`, `Ok(None)` if it was released already, or
    /// [`CoreError::UnknownReq`] if it was never admitted.
    fn live_or_released(&self, req_id: u64) -> CoreResult<Option<ReqState>> {
        match self.reqs.get(&req_id) {
            Some(r) => Ok(Some(*r)),
            None if req_id < self.next_req_id => Ok(None),
            None => Err(CoreError::UnknownReq(req_id)),
        }
    }

    /// Checks that `token_ids` are exactly the request's stored tokens and that its lock can
    /// be released.
    fn check_tokens(&self, r: &ReqState, token_ids: &[i32]) -> CoreResult<()> {
        if token_ids.len() != r.kv_len {
            return Err(CoreError::ShapeMismatch(format!(
                "{} token ids given for a request with KV for {} tokens",
                token_ids.len(),
                r.kv_len
            )));
        }
        self.tree.check_unlock(r.last_node)?;
        self.req_pool.check_span(r.req_pool_idx, 0, r.kv_len)
    }

    /// Inserts the whole pages of the request's tokens and frees the request's own pages the
    /// tree already held (`[prefix_len, already_cached)`); the own pages after the last whole
    /// page are freed if `free_tail`, else kept as the request's own. Returns the number of
    /// tokens now held by the tree.
    ///
    /// The insert starts at the request's locked `last_node`, whose path is its first
    /// `prefix_len` tokens: those are neither read nor compared again. The slots come from
    /// the request's own runs, not from its row.
    fn insert_own(
        &mut self,
        r: &ReqState,
        token_ids: &[i32],
        free_tail: bool,
    ) -> CoreResult<usize> {
        let aligned = r.kv_len - r.kv_len % self.page_size();
        let mut tail = std::mem::take(&mut self.own[r.req_pool_idx]);
        let whole = tail.split_front(aligned - r.prefix_len);
        let (_, duplicates) =
            self.tree
                .insert_below(r.last_node, &token_ids[r.prefix_len..aligned], whole)?;
        self.alloc.free_slot_runs(&duplicates)?;
        if free_tail {
            self.alloc.free_slot_runs(&tail)?;
        } else {
            self.own[r.req_pool_idx] = tail;
        }
        Ok(aligned)
    }

    /// A chunk of a running request's prefill ended: caches its whole pages so far and keeps
    /// it running on them. `token_ids` must be exactly its `kv_len` stored tokens; the first
    /// `prefix_len` of them are the prefix it locked and are not read again.
    ///
    /// Inserts the whole pages below the locked node, frees the request's duplicate pages,
    /// matches the new pages below the locked node again and writes the tree's slots into row
    /// `[prefix_len, aligned)`, locks the new last node, then unlocks the old one; a partial
    /// last page stays the request's own. Returns the new `prefix_len`.
    /// Disabled cache: changes nothing and returns the current `prefix_len` (0).
    ///
    /// Errors (checked before any change): [`CoreError::UnknownReq`] if `req_id` is not live;
    /// [`CoreError::ShapeMismatch`] if `token_ids.len() != kv_len`.
    pub fn cache_unfinished_req(&mut self, req_id: u64, token_ids: &[i32]) -> CoreResult<usize> {
        let r = self.req(req_id)?;
        self.check_tokens(&r, token_ids)?;
        if self.tree.disabled() {
            return Ok(r.prefix_len);
        }
        let aligned = self.insert_own(&r, token_ids, false)?;
        let m = self
            .tree
            .match_below(r.last_node, &token_ids[r.prefix_len..aligned])?;
        if m.indices.len() != aligned - r.prefix_len {
            return Err(CoreError::Invariant(format!(
                "re-match after insert found {} of {} tokens",
                m.indices.len(),
                aligned - r.prefix_len
            )));
        }
        self.req_pool
            .write(r.req_pool_idx, r.prefix_len, &m.indices)?;
        // Lock the new path before unlocking the old one so the shared part never drops to 0.
        self.tree.inc_lock_ref(m.last_node)?;
        self.tree.dec_lock_ref(r.last_node)?;
        let state = self.reqs.get_mut(&req_id).expect("live");
        state.prefix_len = aligned;
        state.last_node = m.last_node;
        Ok(aligned)
    }

    /// A request finished: caches the whole pages of its tokens and releases it. `token_ids`
    /// must be exactly its `kv_len` stored tokens; the first `prefix_len` of them are the
    /// prefix it matched at admission and are not read again.
    ///
    /// Inserts the whole pages; frees the request's own pages the tree already held and its
    /// partial last page; unlocks its prefix; frees its row. Disabled cache: frees all its
    /// pages and the row. Returns `true`, or `false` with nothing changed if the request was
    /// already released (finish and abort are idempotent).
    ///
    /// Errors (checked before any change): [`CoreError::UnknownReq`] if `req_id` was never
    /// admitted; [`CoreError::ShapeMismatch`] if `token_ids.len() != kv_len`.
    pub fn cache_finished_req(&mut self, req_id: u64, token_ids: &[i32]) -> CoreResult<bool> {
        let Some(r) = self.live_or_released(req_id)? else {
            return Ok(false);
        };
        self.check_tokens(&r, token_ids)?;
        if self.tree.disabled() {
            let own = std::mem::take(&mut self.own[r.req_pool_idx]);
            self.alloc.free_slot_runs(&own)?;
        } else {
            self.insert_own(&r, token_ids, true)?;
        }
        self.release(req_id, &r)?;
        Ok(true)
    }

    /// A request is dropped without caching (abort, retraction, error): frees its own pages,
    /// unlocks its prefix, frees its row. Returns `true`, or `false` with nothing changed if
    /// it was already released.
    ///
    /// Errors: [`CoreError::UnknownReq`] if `req_id` was never admitted.
    pub fn free_req(&mut self, req_id: u64) -> CoreResult<bool> {
        let Some(r) = self.live_or_released(req_id)? else {
            return Ok(false);
        };
        let own = std::mem::take(&mut self.own[r.req_pool_idx]);
        self.alloc.free_slot_runs(&own)?;
        self.release(req_id, &r)?;
        Ok(true)
    }

    fn release(&mut self, req_id: u64, r: &ReqState) -> CoreResult<()> {
        if r.last_node != ROOT {
            self.tree.dec_lock_ref(r.last_node)?;
        }
        self.req_pool.free(r.req_pool_idx)?;
        self.reqs.remove(&req_id);
        Ok(())
    }

    /// Empties the radix cache, freeing its pages. Errors: [`CoreError::Invariant`] while
    /// requests are admitted (their prefixes are locked).
    pub fn reset(&mut self) -> CoreResult<()> {
        if !self.reqs.is_empty() {
            return Err(CoreError::Invariant(format!(
                "reset with {} requests admitted",
                self.reqs.len()
            )));
        }
        self.tree.reset(&mut self.alloc)
    }
}
