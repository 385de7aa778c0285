//! Paged decode attention: one new query token per request attends to the request's cached
//! keys and values, read in place from the KV pool through the request's slot list.
//!
//! Layouts (row-major, float32):
//!   q        [batch, num_heads, head_dim]          the new token's query heads
//!   k_buffer [num_slots, num_kv_heads, head_dim]   one layer's key pool
//!   v_buffer [num_slots, num_kv_heads, head_dim]   one layer's value pool
//!   kv_indptr [batch + 1], kv_indices [kv_indptr[batch]]: request b's keys are the slots
//!     kv_indices[kv_indptr[b] .. kv_indptr[b + 1]], in position order (CSR, as FlashInfer
//!     and SGLang lay out paged KV)
//!   out      [batch, num_heads, head_dim]
//! Grouped-query attention: query head h reads KV head h / (num_heads / num_kv_heads).
//!
//! Work is split into units: a request's KV heads (all of them when there are enough requests
//! to keep every thread busy, else one). A unit reads its K rows once to score all its query
//! heads, takes an exact softmax (max-subtracted), then sweeps its V rows per KV head with the
//! group's accumulators in registers (the rows are in cache by then: they were prefetched with
//! the K rows). Units are spread over `num_threads` threads in contiguous ranges of about equal
//! key counts (see `parallel`). Nothing is gathered or padded, so a step reads each cached K/V
//! row from memory once; the torch reference gathers every row into a padded copy first.

use std::fmt;
use std::sync::Mutex;

use crate::exp::exp;
use crate::parallel::{balanced_bounds, run_tasks};
use crate::simd::{lane_sum, Portable, RowOps};
#[cfg(target_arch = "x86_64")]
use crate::simd::{Avx2, Avx512};

/// Sizes of one decode-attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeAttentionShape {
    pub batch: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub num_slots: usize,
}

/// Why a call was refused; nothing is written to `out` then.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeAttentionError {
    /// A buffer's length does not match the shape, or the head counts are inconsistent.
    Shape(String),
    /// kv_indptr is not a non-decreasing range of kv_indices, or a slot is outside the pool.
    Index(String),
}

impl fmt::Display for DecodeAttentionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Shape(m) | Self::Index(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for DecodeAttentionError {}

/// Below this many (key, KV head) rows in a call, one thread does everything: handing work to
/// other threads costs more than it saves.
const MIN_ROWS_PER_THREAD: usize = 1024;

/// Computes softmax(q k^T * scaling) v for every request's new token (see the module doc).
///
/// sliding_window: None, or W: request b attends to its last W keys only.
/// A request with no keys gets zeros. Errors: `Shape` for lengths that do not match `shape`
/// or num_heads not a multiple of num_kv_heads; `Index` for a bad kv_indptr or a slot
/// outside `0..num_slots`. Runs on up to num_threads threads (see `parallel`), all done
/// before it returns.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention(
    q: &[f32],
    k_buffer: &[f32],
    v_buffer: &[f32],
    kv_indptr: &[i32],
    kv_indices: &[i32],
    out: &mut [f32],
    shape: DecodeAttentionShape,
    scaling: f32,
    sliding_window: Option<usize>,
    num_threads: usize,
) -> Result<(), DecodeAttentionError> {
    let ranges = validate(
        q,
        k_buffer,
        v_buffer,
        kv_indptr,
        kv_indices,
        out,
        shape,
        sliding_window,
    )?;
    if out.is_empty() {
        return Ok(()); // no query heads (or no requests): nothing to compute
    }
    let DecodeAttentionShape {
        num_heads,
        num_kv_heads,
        head_dim,
        ..
    } = shape;
    let group = num_heads / num_kv_heads;
    let total_rows: usize = ranges.iter().map(|r| r.len()).sum::<usize>() * num_kv_heads;
    let threads = num_threads.max(1).min(total_rows / MIN_ROWS_PER_THREAD + 1);
    let kv_heads_per_unit = if ranges.len() >= 4 * threads {
        num_kv_heads
    } else {
        1
    };
    let ctx = Ctx {
        q,
        k_buffer,
        v_buffer,
        kv_indices,
        ranges: &ranges,
        num_kv_heads,
        kv_heads_per_unit,
        group,
        head_dim,
        scaling,
    };
    let unit_len = ctx.unit_len();
    if threads <= 1 {
        ctx.run(0, out);
        return Ok(());
    }
    // Contiguous unit ranges of about total_rows / threads rows each.
    let num_units = ranges.len() * ctx.units_per_request();
    let bounds = balanced_bounds(
        (0..num_units).map(|u| ranges[u / ctx.units_per_request()].len() * kv_heads_per_unit),
        total_rows,
        threads,
    );
    let mut chunks = Vec::with_capacity(bounds.len());
    let mut rest = &mut *out;
    for w in bounds.windows(2) {
        let (chunk, tail) = std::mem::take(&mut rest).split_at_mut((w[1] - w[0]) * unit_len);
        rest = tail;
        chunks.push(Mutex::new((w[0], chunk)));
    }
    run_tasks(chunks.len(), &|i| {
        let mut chunk = chunks[i].lock().unwrap();
        let (first_unit, ref mut out) = *chunk;
        ctx.run(first_unit, out);
    });
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn validate(
    q: &[f32],
    k_buffer: &[f32],
    v_buffer: &[f32],
    kv_indptr: &[i32],
    kv_indices: &[i32],
    out: &[f32],
    shape: DecodeAttentionShape,
    sliding_window: Option<usize>,
) -> Result<Vec<std::ops::Range<usize>>, DecodeAttentionError> {
    let DecodeAttentionShape {
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        num_slots,
    } = shape;
    let shape_err = |m: String| Err(DecodeAttentionError::Shape(m));
    if num_kv_heads == 0 || head_dim == 0 || num_heads % num_kv_heads != 0 {
        return shape_err(format!("num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads} (or a size is 0)"));
    }
    let q_len = batch * num_heads * head_dim;
    let pool_len = num_slots * num_kv_heads * head_dim;
    if q.len() != q_len || out.len() != q_len {
        return shape_err(format!(
            "q has {} and out {} floats, expected {q_len}",
            q.len(),
            out.len()
        ));
    }
    if k_buffer.len() != pool_len || v_buffer.len() != pool_len {
        return shape_err(format!(
            "k_buffer has {} and v_buffer {} floats, expected {pool_len}",
            k_buffer.len(),
            v_buffer.len()
        ));
    }
    if kv_indptr.len() != batch + 1 {
        return shape_err(format!(
            "kv_indptr has {} entries, expected batch + 1 = {}",
            kv_indptr.len(),
            batch + 1
        ));
    }
    let index_err = |m: String| Err(DecodeAttentionError::Index(m));
    if kv_indptr[0] != 0
        || kv_indptr.windows(2).any(|w| w[1] < w[0])
        || kv_indptr[batch] as u64 > kv_indices.len() as u64
    {
        return index_err(format!(
            "kv_indptr must rise from 0 to at most {} (the number of kv_indices)",
            kv_indices.len()
        ));
    }
    if let Some(&bad) = kv_indices[..kv_indptr[batch] as usize]
        .iter()
        .find(|&&s| s < 0 || s as usize >= num_slots)
    {
        return index_err(format!(
            "KV slot {bad} is outside the pool of {num_slots} slots"
        ));
    }
    Ok(kv_indptr
        .windows(2)
        .map(|w| {
            let (start, end) = (w[0] as usize, w[1] as usize);
            match sliding_window {
                Some(window) => end - (end - start).min(window)..end,
                None => start..end,
            }
        })
        .collect())
}

/// Inputs shared by every unit of one call. A unit is one request's `kv_heads_per_unit`
/// consecutive KV heads (all of them when there are enough requests to keep every thread
/// busy, so each slot's K and V rows are read whole and in order; one otherwise).
struct Ctx<'a> {
    q: &'a [f32],
    k_buffer: &'a [f32],
    v_buffer: &'a [f32],
    kv_indices: &'a [i32],
    ranges: &'a [std::ops::Range<usize>],
    num_kv_heads: usize,
    kv_heads_per_unit: usize,
    group: usize,
    head_dim: usize,
    scaling: f32,
}

impl Ctx<'_> {
    fn units_per_request(&self) -> usize {
        self.num_kv_heads / self.kv_heads_per_unit
    }

    /// Floats of `out` one unit writes: its query heads x head_dim.
    fn unit_len(&self) -> usize {
        self.kv_heads_per_unit * self.group * self.head_dim
    }

    /// Computes units first_unit.. into `out` (unit_len() floats per unit), with AVX-512 or
    /// AVX2 + FMA when this CPU has them.
    fn run(&self, first_unit: usize, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU supports the features `run_avx512` is compiled for.
                unsafe { self.run_avx512(first_unit, out) };
                return;
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU supports the features `run_avx2` is compiled for.
                unsafe { self.run_avx2(first_unit, out) };
                return;
            }
        }
        self.run_units::<Portable>(first_unit, out);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn run_avx512(&self, first_unit: usize, out: &mut [f32]) {
        self.run_units::<Avx512>(first_unit, out);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self, first_unit: usize, out: &mut [f32]) {
        self.run_units::<Avx2>(first_unit, out);
    }

    #[inline(always)]
    fn run_units<R: RowOps>(&self, first_unit: usize, out: &mut [f32]) {
        let unit_len = self.unit_len();
        let mut scores: Vec<f32> = Vec::new();
        for (i, unit_out) in out.chunks_exact_mut(unit_len).enumerate() {
            let unit = first_unit + i;
            let (b, first_kv_head) = (
                unit / self.units_per_request(),
                unit % self.units_per_request() * self.kv_heads_per_unit,
            );
            let q_start = (b * self.num_kv_heads + first_kv_head) * self.group * self.head_dim;
            let slots = &self.kv_indices[self.ranges[b].clone()];
            self.attend::<R>(
                &self.q[q_start..q_start + unit_len],
                first_kv_head,
                slots,
                &mut scores,
                unit_out,
            );
        }
    }

    /// One unit: query heads `q_heads` [heads, head_dim] (those of KV heads first_kv_head..
    /// first_kv_head + kv_heads_per_unit) -> `out` [heads, head_dim].
    ///
    /// One sweep over the K rows scores every head (scores [heads, n]); a softmax per head;
    /// then per KV head, GROUP_CHUNK query heads and TILE columns at a time, a sweep over the
    /// V rows, so each loaded V segment feeds several heads from registers.
    #[inline(always)]
    fn attend<R: RowOps>(
        &self,
        q_heads: &[f32],
        first_kv_head: usize,
        slots: &[i32],
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        let (d, n, group) = (self.head_dim, slots.len(), self.group);
        let heads = self.kv_heads_per_unit * group;
        let row_len = self.kv_heads_per_unit * d;
        if n == 0 {
            out.fill(0.0);
            return;
        }
        let row = |slot: i32| (slot as usize * self.num_kv_heads + first_kv_head) * d;
        scores.clear();
        scores.resize(heads * n, 0.0);
        for (j, &slot) in slots.iter().enumerate() {
            if let Some(&ahead) = slots.get(j + PREFETCH_DISTANCE) {
                prefetch(&self.k_buffer[row(ahead)..row(ahead) + row_len]);
                prefetch(&self.v_buffer[row(ahead)..row(ahead) + row_len]);
            }
            let k_row = &self.k_buffer[row(slot)..row(slot) + row_len];
            for g in 0..self.kv_heads_per_unit {
                let k = &k_row[g * d..(g + 1) * d];
                let mut h = g * group;
                while h < (g + 1) * group {
                    let chunk = ((g + 1) * group - h).min(GROUP_CHUNK);
                    let q = &q_heads[h * d..(h + chunk) * d];
                    match chunk {
                        1 => store_scores(&R::dot_heads::<1>(q, k), scores, h, n, j, self.scaling),
                        2 => store_scores(&R::dot_heads::<2>(q, k), scores, h, n, j, self.scaling),
                        3 => store_scores(&R::dot_heads::<3>(q, k), scores, h, n, j, self.scaling),
                        _ => store_scores(&R::dot_heads::<4>(q, k), scores, h, n, j, self.scaling),
                    }
                    h += chunk;
                }
            }
        }
        // Softmax numerators in place, max-subtracted per head (exact softmax).
        let mut inv_sum_buf = [0f32; 64];
        let mut inv_sum_vec = Vec::new();
        let inv_sums: &mut [f32] = if heads <= 64 {
            &mut inv_sum_buf[..heads]
        } else {
            inv_sum_vec.resize(heads, 0.0);
            &mut inv_sum_vec
        };
        for (s, inv_sum) in scores.chunks_exact_mut(n).zip(inv_sums.iter_mut()) {
            let max = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            for x in s.iter_mut() {
                *x = exp(*x - max);
            }
            *inv_sum = 1.0 / lane_sum(s, |x| x);
        }
        for g in 0..self.kv_heads_per_unit {
            let mut h = g * group;
            while h < (g + 1) * group {
                let chunk = ((g + 1) * group - h).min(GROUP_CHUNK);
                let o = &mut out[h * d..(h + chunk) * d];
                match chunk {
                    1 => self.weigh_values::<R, 1>(first_kv_head, g, h, slots, scores, inv_sums, o),
                    2 => self.weigh_values::<R, 2>(first_kv_head, g, h, slots, scores, inv_sums, o),
                    3 => self.weigh_values::<R, 3>(first_kv_head, g, h, slots, scores, inv_sums, o),
                    _ => self.weigh_values::<R, 4>(first_kv_head, g, h, slots, scores, inv_sums, o),
                }
                h += chunk;
            }
        }
    }

    /// out [G, head_dim] = softmax-weighted sum of the V rows of KV head first_kv_head + g for
    /// the G query heads first_head.. (probabilities `p` [heads, n] unnormalized, `inv_sums`
    /// their reciprocal sums). The V rows were prefetched during the K pass.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn weigh_values<R: RowOps, const G: usize>(
        &self,
        first_kv_head: usize,
        g: usize,
        first_head: usize,
        slots: &[i32],
        p: &[f32],
        inv_sums: &[f32],
        out: &mut [f32],
    ) {
        let (d, n) = (self.head_dim, slots.len());
        let row = |slot: i32| slot as usize * self.num_kv_heads * d;
        let kv_offset = (first_kv_head + g) * d;
        let tile = R::TILE;
        let full_tiles = d / tile;
        for t in 0..full_tiles {
            let mut acc = [R::tile_zero(); G];
            for (j, &slot) in slots.iter().enumerate() {
                let start = row(slot) + kv_offset + t * tile;
                let v = &self.v_buffer[start..start + tile];
                let mut ph = [0f32; G];
                for h in 0..G {
                    ph[h] = p[(first_head + h) * n + j];
                }
                R::tile_axpy::<G>(&mut acc, &ph, v);
            }
            for h in 0..G {
                R::tile_store(
                    acc[h],
                    inv_sums[first_head + h],
                    &mut out[h * d + t * tile..h * d + (t + 1) * tile],
                );
            }
        }
        // Columns past the last full tile (head_dim not a multiple of TILE, or below it: all
        // of head_dim 8 or 32). One sweep over the V rows with a small accumulator per head,
        // each column summed in slot order as in the tiles (one pass per column was 5-10x
        // slower at head_dim 8).
        let c0 = full_tiles * tile;
        match d - c0 {
            0 => {}
            8 => self.weigh_tail::<G, 8>(c0, kv_offset, first_head, slots, p, inv_sums, out),
            _ => self.weigh_tail::<G, MAX_TILE>(c0, kv_offset, first_head, slots, p, inv_sums, out),
        }
    }

    /// The columns c0..head_dim of `weigh_values` (fewer than a tile), in one sweep over the
    /// V rows with W-wide accumulators (W: the tail width when known at compile time, so the
    /// sums vectorize; else MAX_TILE, using the first head_dim - c0).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn weigh_tail<const G: usize, const W: usize>(
        &self,
        c0: usize,
        kv_offset: usize,
        first_head: usize,
        slots: &[i32],
        p: &[f32],
        inv_sums: &[f32],
        out: &mut [f32],
    ) {
        let (d, n) = (self.head_dim, slots.len());
        let rem = d - c0;
        let mut acc = [[0f32; W]; G];
        for (j, &slot) in slots.iter().enumerate() {
            let start = slot as usize * self.num_kv_heads * d + kv_offset + c0;
            let v = &self.v_buffer[start..start + rem];
            for (h, acc_h) in acc.iter_mut().enumerate() {
                let ph = p[(first_head + h) * n + j];
                for (a, &x) in acc_h[..rem].iter_mut().zip(v) {
                    *a += ph * x;
                }
            }
        }
        for (h, acc_h) in acc.iter().enumerate() {
            let scale = inv_sums[first_head + h];
            for (o, &a) in out[h * d + c0..h * d + d].iter_mut().zip(&acc_h[..rem]) {
                *o = a * scale;
            }
        }
    }
}

/// scores[(h + i) * n + j] = dots[i] * scaling for the G heads h.. of key j.
#[inline(always)]
fn store_scores<const G: usize>(
    dots: &[f32; G],
    scores: &mut [f32],
    h: usize,
    n: usize,
    j: usize,
    scaling: f32,
) {
    for i in 0..G {
        scores[(h + i) * n + j] = dots[i] * scaling;
    }
}

/// The widest Tile of any RowOps (AVX-512's 64 columns): the remainder columns fit in it.
const MAX_TILE: usize = 64;

/// Query heads sharing a KV head that are computed together (register budget of AVX2's 16).
const GROUP_CHUNK: usize = 4;

/// Rows ahead whose K (or V) row is prefetched: slots are scattered over the pool, so the
/// hardware prefetcher cannot guess the next row; a few rows of lead hide the memory latency.
const PREFETCH_DISTANCE: usize = 8;

/// Asks the CPU to bring `x`'s cache lines into L2 (a hint; no effect on results). L2 rather
/// than L1: a core has more outstanding L2 misses in flight, and the rows are reused from L2.
#[inline(always)]
fn prefetch(x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for line in x.chunks(16) {
        // SAFETY: prefetching is a hint; the address is inside a live slice.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                line.as_ptr().cast(),
            );
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}
