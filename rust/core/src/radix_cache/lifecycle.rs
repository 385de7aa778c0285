//! Request lifecycle on the radix cache: what happens to a request's KV slots when it
//! finishes, when a chunk of its prefill ends, or when it is aborted. Each is ONE call so the
//! delicate sequence (insert, free the duplicate slots, re-lock, free the row) is never
//! orchestrated from Python (DESIGN.md section 4).
//!
//! Conventions for all three: `req_pool_idx` is the request's row; its columns
//! `[0, prefix_len)` hold the slots of the cached prefix the request matched and locked at
//! `last_node`; columns `[prefix_len, len)` hold slots the request allocated itself.

use super::{RadixCache, ROOT};
use crate::allocator::TokenToKVPoolAllocator;
use crate::error::{CoreError, CoreResult};
use crate::req_to_token::ReqToTokenPool;

impl RadixCache {
    /// Validates everything a lifecycle call needs before it mutates anything and returns a
    /// copy of row `[0, len)`.
    fn check_req(
        &self,
        req_pool: &ReqToTokenPool,
        req_pool_idx: usize,
        len: usize,
        prefix_len: usize,
        last_node: usize,
    ) -> CoreResult<Vec<i64>> {
        let slots = req_pool.read(req_pool_idx, 0, len)?.to_vec();
        if prefix_len > len {
            return Err(CoreError::OutOfRange {
                what: "prefix_len",
                value: prefix_len as i64,
                low: 0,
                high: len as i64 + 1,
            });
        }
        if let Some(&s) = slots.iter().find(|&&s| s < 1) {
            return Err(CoreError::Invariant(format!(
                "row {req_pool_idx} holds padding/invalid slot {s} within its first {len} columns"
            )));
        }
        self.check_unlock(last_node)?;
        Ok(slots)
    }

    /// A request finished: cache its tokens and release it.
    ///
    /// `token_ids` are exactly the tokens whose KV is in row `[0, token_ids.len())`. Inserts
    /// them with those slots; frees into `alloc` the row's slots in
    /// `[prefix_len, already_cached_len)` (the tree already held those tokens with its own
    /// slots); unlocks `last_node`; frees the row. Disabled cache: frees row
    /// `[prefix_len, len)` and the row.
    ///
    /// Errors (checked before any change): [`CoreError::UnknownReqSlot`] /
    /// [`CoreError::OutOfRange`] for a bad row, length or `prefix_len`;
    /// [`CoreError::UnknownNode`] / [`CoreError::LockUnderflow`] for `last_node`;
    /// [`CoreError::Invariant`] if the row holds slot 0 within `[0, len)`.
    pub fn cache_finished_req(
        &mut self,
        req_pool: &mut ReqToTokenPool,
        alloc: &mut TokenToKVPoolAllocator,
        req_pool_idx: usize,
        token_ids: &[i32],
        prefix_len: usize,
        last_node: usize,
    ) -> CoreResult<()> {
        let len = token_ids.len();
        let slots = self.check_req(req_pool, req_pool_idx, len, prefix_len, last_node)?;
        if self.disabled() {
            alloc.free(&slots[prefix_len..])?;
        } else {
            let cached = self.insert(token_ids, &slots)?;
            if cached > prefix_len {
                alloc.free(&slots[prefix_len..cached])?;
            }
            self.dec_lock_ref(last_node)?;
        }
        req_pool.free(req_pool_idx)
    }

    /// A chunk of a request's prefill ended (the request keeps running): cache what it has.
    ///
    /// Inserts `token_ids` with row `[0, len)`; frees the duplicate slots
    /// `[prefix_len, already_cached_len)`; re-matches `token_ids` and writes the tree's slots
    /// into row `[0, len)`; locks the new last node, then unlocks `last_node`. The row is kept.
    /// Returns `(new_prefix_len, new_last_node)`, with `new_prefix_len == token_ids.len()`.
    /// Disabled cache: changes nothing and returns `(token_ids.len(), last_node)`.
    ///
    /// Errors: as [`Self::cache_finished_req`], checked before any change.
    pub fn cache_unfinished_req(
        &mut self,
        req_pool: &mut ReqToTokenPool,
        alloc: &mut TokenToKVPoolAllocator,
        req_pool_idx: usize,
        token_ids: &[i32],
        prefix_len: usize,
        last_node: usize,
    ) -> CoreResult<(usize, usize)> {
        let len = token_ids.len();
        let slots = self.check_req(req_pool, req_pool_idx, len, prefix_len, last_node)?;
        if self.disabled() {
            return Ok((len, last_node));
        }
        let cached = self.insert(token_ids, &slots)?;
        if cached > prefix_len {
            alloc.free(&slots[prefix_len..cached])?;
        }
        let m = self.match_prefix(token_ids);
        if m.indices.len() != len {
            return Err(CoreError::Invariant(format!(
                "re-match after insert found {} of {len} tokens",
                m.indices.len()
            )));
        }
        req_pool.write(req_pool_idx, 0, &m.indices)?;
        // Lock the new path before unlocking the old one so the shared part never drops to 0.
        self.inc_lock_ref(m.last_node)?;
        self.dec_lock_ref(last_node)?;
        Ok((len, m.last_node))
    }

    /// A request is dropped without caching (abort, error): frees row `[prefix_len, kv_len)`
    /// into `alloc`, unlocks `last_node`, frees the row.
    ///
    /// Errors: as [`Self::cache_finished_req`], checked before any change.
    pub fn release_req(
        &mut self,
        req_pool: &mut ReqToTokenPool,
        alloc: &mut TokenToKVPoolAllocator,
        req_pool_idx: usize,
        kv_len: usize,
        prefix_len: usize,
        last_node: usize,
    ) -> CoreResult<()> {
        let slots = self.check_req(req_pool, req_pool_idx, kv_len, prefix_len, last_node)?;
        alloc.free(&slots[prefix_len..])?;
        if last_node != ROOT {
            self.dec_lock_ref(last_node)?;
        }
        req_pool.free(req_pool_idx)
    }
}
