//! Per-step batch bookkeeping: allocate the KV pages of a batch (evicting from the radix cache
//! if the free pages do not suffice), record the slots in the request rows, and build the flat
//! arrays of the step's plan. One call per batch. A decode step costs O(batch): it returns
//! only the new slots and positions (the worker keeps each request's row on its device and
//! adds the new slot); an extend step also returns the whole rows of its requests, once.
//!
//! Pages: a request whose stored tokens end inside a page first fills the rest of that page;
//! a new page is taken only when a token lands on a page boundary (position % page_size == 0).
//! Both calls return `Ok(None)` when even after eviction too few pages are free, leaving the
//! requests unchanged (eviction, if any, stays done); the scheduler then retracts a request
//! and retries.

use crate::error::{CoreError, CoreResult};
use crate::kv_cache::KVCache;

/// Flat arrays describing one forward batch of `B` requests, all `i32`: the dtype the worker's
/// device tables and kernels index with, so the arrays reach the device unconverted. Every
/// value fits: KV slots stay below 2^31 (the allocator's bound), and rows, positions and
/// row-length totals below the request table's size (at most `i32::MAX` cells, see
/// [`crate::ReqToTokenPool::new`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BatchArrays {
    /// `[B]` row of each request in the request pool.
    pub req_pool_indices: Vec<i32>,
    /// `[B]` tokens whose KV was stored before this step (reused, not recomputed).
    pub prefix_lens: Vec<i32>,
    /// `[B]` new tokens of each request in this step (1 per request for decode).
    pub extend_lens: Vec<i32>,
    /// `[B]` tokens with KV after this step: `prefix_lens + extend_lens`.
    pub seq_lens: Vec<i32>,
    /// `[num_new_tokens]` KV slot where each new token's K/V is written, request by request.
    pub out_cache_loc: Vec<i32>,
    /// `[num_new_tokens]` position (0-based index in its sequence) of each new token.
    pub positions: Vec<i32>,
    /// Extend: `[B + 1]` CSR offsets into `kv_indices`: request `i`'s row is
    /// `kv_indices[kv_indptr[i]..kv_indptr[i + 1]]`. Decode: empty.
    pub kv_indptr: Vec<i32>,
    /// Extend: `[sum(seq_lens)]` the KV slots of every token of each request's row (its
    /// stored prefix and its new tokens), requests concatenated in batch order. Decode: empty
    /// (O(batch) per decode step).
    pub kv_indices: Vec<i32>,
}

impl BatchArrays {
    /// Empty arrays with room for `b` requests, `num_new` new tokens and `total` KV entries;
    /// `kv_indptr` starts with its leading 0.
    fn with_capacity(b: usize, num_new: usize, total: usize) -> Self {
        let mut kv_indptr = Vec::with_capacity(b + 1);
        kv_indptr.push(0);
        BatchArrays {
            req_pool_indices: Vec::with_capacity(b),
            prefix_lens: Vec::with_capacity(b),
            extend_lens: Vec::with_capacity(b),
            seq_lens: Vec::with_capacity(b),
            out_cache_loc: Vec::with_capacity(num_new),
            positions: Vec::with_capacity(num_new),
            kv_indptr,
            kv_indices: Vec::with_capacity(total),
        }
    }
}

impl KVCache {
    /// Validates a batch: ids live and distinct, lengths agree, rows wide enough. Returns
    /// each request's `(row, kv_len)`.
    fn check_batch(
        &self,
        req_ids: &[u64],
        extend_lens: &[usize],
    ) -> CoreResult<Vec<(usize, usize)>> {
        if req_ids.len() != extend_lens.len() {
            return Err(CoreError::ShapeMismatch(format!(
                "{} extend_lens for {} req_ids",
                extend_lens.len(),
                req_ids.len()
            )));
        }
        // Live requests own distinct rows, so a repeated row means a repeated id.
        let mut seen = vec![false; self.req_pool.size()];
        let mut out = Vec::with_capacity(req_ids.len());
        for (&id, &ext) in req_ids.iter().zip(extend_lens) {
            let r = self.req(id)?;
            if std::mem::replace(&mut seen[r.req_pool_idx], true) {
                return Err(CoreError::DuplicateReq(id));
            }
            self.req_pool
                .check_span(r.req_pool_idx, 0, r.kv_len + ext)?;
            out.push((r.req_pool_idx, r.kv_len));
        }
        Ok(out)
    }

    /// Makes `pages` pages free, evicting if needed; `false` if that is impossible.
    fn ensure_pages(&mut self, pages: usize) -> CoreResult<bool> {
        let free = self.alloc.available_pages();
        if free < pages {
            let ps = self.page_size();
            self.tree.evict((pages - free) * ps, &mut self.alloc)?;
        }
        Ok(self.alloc.available_pages() >= pages)
    }

    /// Builds an extend (prefill) batch: request `req_ids[i]` adds `extend_lens[i]` tokens
    /// after its `kv_len` stored ones.
    ///
    /// Takes `sum(ceil(end_i / page_size) - ceil(kv_len_i / page_size))` pages (evicting
    /// first if needed), writes each request's new slots into its row, advances its `kv_len`
    /// and returns all arrays of the batch. `Ok(None)` if the pages do not fit.
    ///
    /// Errors (checked first, nothing changed): [`CoreError::ShapeMismatch`] if the inputs
    /// differ in length; [`CoreError::DuplicateReq`] if an id repeats;
    /// [`CoreError::UnknownReq`] for an id not live; [`CoreError::OutOfRange`] if
    /// `kv_len + extend_len > max_context_len`.
    pub fn prepare_extend(
        &mut self,
        req_ids: &[u64],
        extend_lens: &[usize],
    ) -> CoreResult<Option<BatchArrays>> {
        let reqs = self.check_batch(req_ids, extend_lens)?;
        let ps = self.page_size();
        let need: usize = reqs
            .iter()
            .zip(extend_lens)
            .map(|(&(_, kv), &e)| (kv + e).div_ceil(ps) - kv.div_ceil(ps))
            .sum();
        if !self.ensure_pages(need)? {
            return Ok(None);
        }
        let pages = self.alloc.alloc_pages(need).expect("pages ensured");
        let mut next_page = pages.into_iter();
        let b = reqs.len();
        let num_new: usize = extend_lens.iter().sum();
        let total: usize = reqs
            .iter()
            .zip(extend_lens)
            .map(|(&(_, kv), &e)| kv + e)
            .sum();
        let mut a = BatchArrays::with_capacity(b, num_new, total);
        // Narrowing to i32 cannot wrap: see `BatchArrays`.
        let int = |x: usize| x as i32;
        for (i, &(row, kv)) in reqs.iter().enumerate() {
            let end = kv + extend_lens[i];
            let start = a.out_cache_loc.len();
            let mut slot = if kv % ps != 0 {
                self.req_pool.read(row, kv - 1, kv)?[0]
            } else {
                0
            };
            for pos in kv..end {
                slot = if pos % ps == 0 {
                    self.alloc.first_slot(next_page.next().expect("counted")) as i32
                } else {
                    slot + 1
                };
                a.out_cache_loc.push(slot);
                self.own[row].push(slot as u32);
            }
            self.req_pool.write(row, kv, &a.out_cache_loc[start..])?;
            a.positions.extend(int(kv)..int(end));
            a.kv_indices
                .extend_from_slice(self.req_pool.read(row, 0, end)?);
            a.kv_indptr.push(int(a.kv_indices.len()));
            a.req_pool_indices.push(int(row));
            a.prefix_lens.push(int(kv));
            a.extend_lens.push(int(extend_lens[i]));
            a.seq_lens.push(int(end));
            self.reqs.get_mut(&req_ids[i]).expect("checked").kv_len = end;
        }
        Ok(Some(a))
    }

    /// Builds a decode batch: every request in `req_ids` adds one token at position
    /// `kv_len`. A request takes a new page only when `kv_len % page_size == 0`; otherwise
    /// its token goes to the next slot of its last page. Returns the arrays (`extend_lens`
    /// all 1, `positions == prefix_lens`, `kv_indptr` and `kv_indices` empty: O(batch)), or
    /// `Ok(None)` if the pages do not fit even after eviction.
    ///
    /// Errors: as [`Self::prepare_extend`].
    pub fn prepare_decode(&mut self, req_ids: &[u64]) -> CoreResult<Option<BatchArrays>> {
        let ones = vec![1usize; req_ids.len()];
        let reqs = self.check_batch(req_ids, &ones)?;
        let ps = self.page_size();
        let need = reqs.iter().filter(|&&(_, kv)| kv % ps == 0).count();
        if !self.ensure_pages(need)? {
            return Ok(None);
        }
        let pages = self.alloc.alloc_pages(need).expect("pages ensured");
        let mut next_page = pages.into_iter();
        let b = reqs.len();
        let mut a = BatchArrays::with_capacity(b, b, 0);
        a.kv_indptr.clear();
        a.extend_lens = vec![1; b];
        let int = |x: usize| x as i32; // cannot wrap: see `BatchArrays`
        for (i, &(row, kv)) in reqs.iter().enumerate() {
            let slot = if kv % ps == 0 {
                self.alloc.first_slot(next_page.next().expect("counted")) as i32
            } else {
                self.req_pool.read(row, kv - 1, kv)?[0] + 1
            };
            self.req_pool.write(row, kv, &[slot])?;
            self.own[row].push(slot as u32);
            a.out_cache_loc.push(slot);
            a.positions.push(int(kv));
            a.req_pool_indices.push(int(row));
            a.prefix_lens.push(int(kv));
            a.seq_lens.push(int(kv + 1));
            self.reqs.get_mut(&req_ids[i]).expect("checked").kv_len = kv + 1;
        }
        Ok(Some(a))
    }
}
