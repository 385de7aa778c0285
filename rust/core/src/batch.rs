//! Per-step batch bookkeeping: allocate the KV slots of a batch, record them in the request
//! rows, and build the flat arrays the model runner needs. One call per batch.
//!
//! Both calls return `Ok(None)` when the allocator has too few free slots, leaving nothing
//! changed; the scheduler then evicts from the radix cache or retracts requests and retries.

use crate::allocator::TokenToKVPoolAllocator;
use crate::error::{CoreError, CoreResult};
use crate::req_to_token::ReqToTokenPool;

/// Flat int64 arrays describing one forward batch of `B` requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchArrays {
    /// `[num_new_tokens]` KV slot where each new token's K/V is written, request by request.
    pub out_cache_loc: Vec<i64>,
    /// `[num_new_tokens]` position (0-based index in its sequence) of each new token.
    pub positions: Vec<i64>,
    /// `[B + 1]` CSR offsets into `kv_indices`: request `i` attends to
    /// `kv_indices[kv_indptr[i]..kv_indptr[i + 1]]`.
    pub kv_indptr: Vec<i64>,
    /// KV slots of every token each request attends to (its cached prefix and its new
    /// tokens), requests concatenated in batch order.
    pub kv_indices: Vec<i64>,
}

/// Arrays of an extend (prefill) batch; see [`prepare_extend`].
pub type ExtendArrays = BatchArrays;
/// Arrays of a decode batch; see [`prepare_decode`].
pub type DecodeArrays = BatchArrays;

/// Checks that the rows are allocated and pairwise distinct, and that each `[0, end_i)` span
/// fits in a row.
fn check_rows(req_pool: &ReqToTokenPool, rows: &[usize], ends: &[usize]) -> CoreResult<()> {
    for (&r, &end) in rows.iter().zip(ends) {
        req_pool.check_span(r, 0, end)?;
    }
    let mut sorted = rows.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(CoreError::ShapeMismatch(format!(
            "req_pool_idx {} appears twice in one batch",
            w[0]
        )));
    }
    Ok(())
}

fn check_len(name: &str, got: usize, want: usize) -> CoreResult<()> {
    if got != want {
        return Err(CoreError::ShapeMismatch(format!(
            "{name} has {got} entries, req_pool_indices has {want}"
        )));
    }
    Ok(())
}

/// Builds an extend batch: request `i` (row `req_pool_indices[i]`) already has KV for
/// `prefix_lens[i]` tokens and adds `extend_lens[i]` new ones.
///
/// Allocates `sum(extend_lens)` slots from `alloc` (`Ok(None)` and no change if too few are
/// free) and writes request `i`'s slots into its row at `[prefix_i, prefix_i + extend_i)`.
/// Returns `out_cache_loc` (the allocated slots in batch order), `positions`
/// (`prefix_i..prefix_i + extend_i` per request), `kv_indptr` and `kv_indices`
/// (row `[0, prefix_i + extend_i)` per request).
///
/// Errors (checked first, nothing changed): [`CoreError::ShapeMismatch`] if the three inputs
/// differ in length or a row appears twice; [`CoreError::UnknownReqSlot`] for an unallocated
/// row; [`CoreError::OutOfRange`] if `prefix_i + extend_i > max_context_len`.
pub fn prepare_extend(
    req_pool: &mut ReqToTokenPool,
    alloc: &mut TokenToKVPoolAllocator,
    req_pool_indices: &[usize],
    prefix_lens: &[usize],
    extend_lens: &[usize],
) -> CoreResult<Option<ExtendArrays>> {
    let b = req_pool_indices.len();
    check_len("prefix_lens", prefix_lens.len(), b)?;
    check_len("extend_lens", extend_lens.len(), b)?;
    let ends: Vec<usize> = prefix_lens
        .iter()
        .zip(extend_lens)
        .map(|(p, e)| p + e)
        .collect();
    check_rows(req_pool, req_pool_indices, &ends)?;
    let Some(out_cache_loc) = alloc.alloc(extend_lens.iter().sum()) else {
        return Ok(None);
    };
    let mut positions = Vec::with_capacity(out_cache_loc.len());
    let mut kv_indptr = Vec::with_capacity(b + 1);
    let mut kv_indices = Vec::with_capacity(ends.iter().sum());
    kv_indptr.push(0);
    let mut offset = 0;
    for i in 0..b {
        let (row, prefix, end) = (req_pool_indices[i], prefix_lens[i], ends[i]);
        let new_slots = &out_cache_loc[offset..offset + extend_lens[i]];
        req_pool.write(row, prefix, new_slots)?;
        offset += extend_lens[i];
        positions.extend(prefix as i64..end as i64);
        kv_indices.extend_from_slice(req_pool.read(row, 0, end)?);
        kv_indptr.push(kv_indices.len() as i64);
    }
    Ok(Some(BatchArrays {
        out_cache_loc,
        positions,
        kv_indptr,
        kv_indices,
    }))
}

/// Builds a decode batch: request `i` has KV stored for `seq_lens[i]` tokens and decodes one
/// more.
///
/// Allocates one slot per request (`Ok(None)` and no change if too few are free) and writes
/// it into the row at column `seq_lens[i]`. Returns `out_cache_loc` (`[B]`), `positions`
/// (`seq_lens`), `kv_indptr` and `kv_indices` (row `[0, seq_len_i + 1)` per request).
///
/// Errors: as [`prepare_extend`] (`seq_len_i + 1 > max_context_len` is out of range).
pub fn prepare_decode(
    req_pool: &mut ReqToTokenPool,
    alloc: &mut TokenToKVPoolAllocator,
    req_pool_indices: &[usize],
    seq_lens: &[usize],
) -> CoreResult<Option<DecodeArrays>> {
    let b = req_pool_indices.len();
    check_len("seq_lens", seq_lens.len(), b)?;
    let ends: Vec<usize> = seq_lens.iter().map(|s| s + 1).collect();
    check_rows(req_pool, req_pool_indices, &ends)?;
    let Some(out_cache_loc) = alloc.alloc(b) else {
        return Ok(None);
    };
    let mut kv_indptr = Vec::with_capacity(b + 1);
    let mut kv_indices = Vec::with_capacity(ends.iter().sum());
    kv_indptr.push(0);
    for i in 0..b {
        let row = req_pool_indices[i];
        req_pool.write(row, seq_lens[i], &out_cache_loc[i..i + 1])?;
        kv_indices.extend_from_slice(req_pool.read(row, 0, ends[i])?);
        kv_indptr.push(kv_indices.len() as i64);
    }
    Ok(Some(BatchArrays {
        out_cache_loc,
        positions: seq_lens.iter().map(|&s| s as i64).collect(),
        kv_indptr,
        kv_indices,
    }))
}
