//! Bidirectional attention over a ragged (variable-length) batch, for encoders: every token of
//! a sequence attends to every token of the same sequence, never to another's, with no KV pool.
//!
//! Layouts (row-major, float32), as FlashAttention's `flash_attn_varlen_func` takes them:
//!   qkv        [num_tokens, 3 * hidden]  each token's q | k | v projections, hidden =
//!                                        num_heads * head_dim (the fused QKV output as it is)
//!   cu_seqlens [batch + 1] int32         sequence b holds tokens cu_seqlens[b]..cu_seqlens[b + 1]
//!   out        [num_tokens, hidden]      softmax(q k^T * scaling) v per sequence and head
//!
//! Work is split into units of up to `QUERY_BLOCK` consecutive query rows of one sequence, all
//! heads; each unit writes a contiguous block of `out`, so the units of a thread's range form
//! one slice of it. A unit first packs the sequence's keys of every head transposed
//! (`head_dim x L` per head, padded to 16 columns), its values (`L x head_dim`, padded to 16)
//! and its own queries (scaled), into scratch rows that stay in L2 (a sequence longer than
//! QUERY_BLOCK is packed once per unit); then, head by head, it takes `QUERY_GROUP` query rows
//! at a time: their scores against 16 keys at once in registers, an exact max-subtracted
//! softmax, and the value sum with the group's accumulators in registers. Nothing is padded to
//! the batch's longest sequence. The torch reference (`pyserve_kernels/reference.py`) attends
//! one sequence at a time; without this kernel, pyserve's BERT gathers similar-length
//! sequences into padded blocks for `scaled_dot_product_attention` (`pyserve/models/bert.py`).
//!
//! The loops are written once and compiled twice: with AVX2 + FMA (chosen at run time when the
//! CPU has them; 16-float arrays become two 8-float registers and `mul_add` one FMA) and for any
//! CPU, where the same sums are a multiply and an add.

use std::fmt;
use std::sync::Mutex;

use crate::exp::exp_with;
use crate::parallel::{balanced_bounds, run_tasks};

/// Query rows of one sequence in a unit of work.
const QUERY_BLOCK: usize = 64;
/// Query rows whose scores and value sums share the registers of one pass over the keys.
const QUERY_GROUP: usize = 4;
/// Keys scored at once (and value columns summed at once): one AVX-512 or two AVX2 registers.
const LANES: usize = 16;
/// Below this many score multiply-adds in a call, one thread does everything.
const MIN_WORK_PER_THREAD: usize = 1 << 20;

/// Why a call was refused; nothing is written to `out` then.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VarlenAttentionError {
    /// A buffer's length does not match the sizes, or a size is 0.
    Shape(String),
    /// cu_seqlens does not rise from 0 to the number of tokens.
    Index(String),
}

impl fmt::Display for VarlenAttentionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Shape(m) | Self::Index(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for VarlenAttentionError {}

/// Computes `out` from `qkv` (see the module doc): for each sequence b and head h,
/// out[t, h] = softmax_j(q[t, h] . k[j, h] * scaling) v[j, h] over j in sequence b.
///
/// An empty sequence (cu_seqlens[b] == cu_seqlens[b + 1]) is allowed and writes nothing.
/// Errors: `Shape` when qkv is not [num_tokens, 3 * num_heads * head_dim], out not
/// [num_tokens, num_heads * head_dim], or num_heads or head_dim is 0; `Index` when cu_seqlens
/// is empty, does not start at 0, falls, or does not end at num_tokens. Runs on up to
/// num_threads threads (see `parallel`), all done before it returns.
pub fn varlen_attention(
    qkv: &[f32],
    cu_seqlens: &[i32],
    out: &mut [f32],
    num_heads: usize,
    head_dim: usize,
    scaling: f32,
    num_threads: usize,
) -> Result<(), VarlenAttentionError> {
    let hidden = num_heads.checked_mul(head_dim).unwrap_or(0);
    if hidden == 0 {
        return Err(VarlenAttentionError::Shape(format!(
            "num_heads {num_heads} and head_dim {head_dim} must be positive"
        )));
    }
    if !out.len().is_multiple_of(hidden) || qkv.len() != 3 * out.len() {
        return Err(VarlenAttentionError::Shape(format!(
            "qkv has {} and out {} floats: expected [tokens, {}] and [tokens, {hidden}]",
            qkv.len(),
            out.len(),
            3 * hidden
        )));
    }
    let num_tokens = out.len() / hidden;
    if cu_seqlens.first() != Some(&0)
        || cu_seqlens.windows(2).any(|w| w[1] < w[0])
        || *cu_seqlens.last().unwrap() as i64 != num_tokens as i64
    {
        return Err(VarlenAttentionError::Index(format!(
            "cu_seqlens must rise from 0 to the number of tokens, {num_tokens}"
        )));
    }
    // units: (sequence start, sequence length, first query row, query rows), in token order
    let mut units = Vec::new();
    let mut work = 0usize;
    for w in cu_seqlens.windows(2) {
        let (start, len) = (w[0] as usize, (w[1] - w[0]) as usize);
        for first in (0..len).step_by(QUERY_BLOCK) {
            let rows = QUERY_BLOCK.min(len - first);
            units.push(Unit {
                start,
                len,
                first,
                rows,
            });
            work += rows * len;
        }
    }
    let ctx = Ctx {
        qkv,
        num_heads,
        head_dim,
        scaling,
    };
    let threads = num_threads
        .max(1)
        .min(work * hidden / MIN_WORK_PER_THREAD + 1);
    if threads <= 1 {
        ctx.run(&units, out);
        return Ok(());
    }
    // contiguous unit ranges of about work / threads each
    let bounds = balanced_bounds(units.iter().map(|u| u.rows * u.len), work, threads);
    let mut chunks = Vec::with_capacity(bounds.len());
    let mut rest = &mut *out;
    for w in bounds.windows(2) {
        let rows: usize = units[w[0]..w[1]].iter().map(|u| u.rows).sum();
        let (chunk, tail) = std::mem::take(&mut rest).split_at_mut(rows * hidden);
        rest = tail;
        chunks.push(Mutex::new((&units[w[0]..w[1]], chunk)));
    }
    run_tasks(chunks.len(), &|i| {
        let mut chunk = chunks[i].lock().unwrap();
        let (units, ref mut out) = *chunk;
        ctx.run(units, out);
    });
    Ok(())
}

#[derive(Clone, Copy)]
struct Unit {
    start: usize,
    len: usize,
    first: usize,
    rows: usize,
}

struct Ctx<'a> {
    qkv: &'a [f32],
    num_heads: usize,
    head_dim: usize,
    scaling: f32,
}

/// Scratch rows of one thread, sized for the longest sequence it meets.
#[derive(Default)]
struct Scratch {
    keys_t: Vec<f32>,
    values: Vec<f32>,
    queries: Vec<f32>,
    scores: Vec<f32>,
}

impl Ctx<'_> {
    /// Computes `units` (consecutive) into `out`, their query rows x hidden floats.
    fn run(&self, units: &[Unit], out: &mut [f32]) {
        let mut scratch = Scratch::default();
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has the features `units_fma` is compiled for.
            unsafe { self.units_fma(units, out, &mut scratch) };
            return;
        }
        self.units_body::<false>(units, out, &mut scratch);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn units_fma(&self, units: &[Unit], out: &mut [f32], scratch: &mut Scratch) {
        self.units_body::<true>(units, out, scratch);
    }

    #[inline(always)]
    fn units_body<const FMA: bool>(&self, units: &[Unit], out: &mut [f32], s: &mut Scratch) {
        let hidden = self.num_heads * self.head_dim;
        let mut rest = out;
        for unit in units {
            let (block, tail) = std::mem::take(&mut rest).split_at_mut(unit.rows * hidden);
            rest = tail;
            self.unit::<FMA>(unit, block, s);
        }
    }

    /// One unit: packs the sequence's keys (transposed, one head's columns at a time) and
    /// values and the unit's queries of every head, then attends each head's query rows
    /// QUERY_GROUP at a time, writing their columns of `block`.
    #[inline(always)]
    fn unit<const FMA: bool>(&self, unit: &Unit, block: &mut [f32], s: &mut Scratch) {
        let d = self.head_dim;
        let heads = self.num_heads;
        let hidden = heads * d;
        let row = 3 * hidden;
        let len = unit.len;
        let lp = len.div_ceil(LANES) * LANES; // key columns, padded
        let dp = d.div_ceil(LANES) * LANES; // value columns, padded
        let qp = unit.rows.div_ceil(QUERY_GROUP) * QUERY_GROUP; // query rows, padded
        s.keys_t.clear();
        s.keys_t.resize(heads * d * lp, 0.0); // [head][c][key]
        s.values.clear();
        s.values.resize(heads * len * dp, 0.0); // [head][key][c]
        s.queries.clear();
        s.queries.resize(heads * qp * d, 0.0); // [head][query][c], scaled
        let keys = &self.qkv[unit.start * row + hidden..];
        for (h, keys_t) in s.keys_t.chunks_exact_mut(d * lp).enumerate() {
            // written in order, read down a column: one head's key rows (d floats each) stay
            // in L1 for its d columns
            for (c, column) in keys_t.chunks_exact_mut(lp).enumerate() {
                for (j, dst) in column[..len].iter_mut().enumerate() {
                    *dst = keys[j * row + h * d + c];
                }
            }
        }
        for j in 0..len {
            let base = (unit.start + j) * row + 2 * hidden;
            let v = &self.qkv[base..base + hidden];
            for h in 0..heads {
                let at = (h * len + j) * dp;
                s.values[at..at + d].copy_from_slice(&v[h * d..(h + 1) * d]);
            }
        }
        for i in 0..unit.rows {
            let base = (unit.start + unit.first + i) * row;
            for h in 0..heads {
                let q = &mut s.queries[(h * qp + i) * d..(h * qp + i + 1) * d];
                for (dst, &x) in q
                    .iter_mut()
                    .zip(&self.qkv[base + h * d..base + (h + 1) * d])
                {
                    *dst = x * self.scaling;
                }
            }
        }
        s.scores.clear();
        s.scores.resize(QUERY_GROUP * lp, 0.0);
        for h in 0..heads {
            let keys_t = &s.keys_t[h * d * lp..(h + 1) * d * lp];
            let values = &s.values[h * len * dp..(h + 1) * len * dp];
            for g0 in (0..unit.rows).step_by(QUERY_GROUP) {
                let n = QUERY_GROUP.min(unit.rows - g0);
                let queries = &s.queries[(h * qp + g0) * d..(h * qp + g0 + QUERY_GROUP) * d];
                scores::<FMA>(queries, keys_t, &mut s.scores, d, lp);
                let mut inv = [0f32; QUERY_GROUP];
                for (g, inv) in inv.iter_mut().enumerate().take(n) {
                    *inv = softmax_unnormalized::<FMA>(&mut s.scores[g * lp..g * lp + len]);
                }
                for c0 in (0..dp).step_by(LANES) {
                    let acc = value_sum::<FMA>(&s.scores, values, len, lp, dp, c0);
                    let width = LANES.min(d - c0);
                    for g in 0..n {
                        let at = (g0 + g) * hidden + h * d + c0;
                        for (dst, &x) in block[at..at + width].iter_mut().zip(&acc[g]) {
                            *dst = x * inv[g];
                        }
                    }
                }
            }
        }
    }
}

#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// scores[g][j] = queries[g] . keys[j] for the QUERY_GROUP query rows (`d` floats each) and
/// the `lp` key columns of keys_t (`d` rows of `lp`, lp a multiple of LANES).
#[inline(always)]
fn scores<const FMA: bool>(
    queries: &[f32],
    keys_t: &[f32],
    scores: &mut [f32],
    d: usize,
    lp: usize,
) {
    assert!(
        queries.len() >= QUERY_GROUP * d
            && keys_t.len() >= d * lp
            && scores.len() >= QUERY_GROUP * lp
    );
    assert!(lp.is_multiple_of(LANES));
    for j0 in (0..lp).step_by(LANES) {
        let mut acc = [[0f32; LANES]; QUERY_GROUP];
        for c in 0..d {
            // SAFETY: c * lp + j0 + LANES <= d * lp and g * d + c < QUERY_GROUP * d (asserted)
            let k: &[f32; LANES] =
                unsafe { &*(keys_t.as_ptr().add(c * lp + j0) as *const [f32; LANES]) };
            for (g, acc) in acc.iter_mut().enumerate() {
                let q = unsafe { *queries.get_unchecked(g * d + c) };
                for l in 0..LANES {
                    acc[l] = madd::<FMA>(q, k[l], acc[l]);
                }
            }
        }
        for (g, a) in acc.iter().enumerate() {
            scores[g * lp + j0..g * lp + j0 + LANES].copy_from_slice(a);
        }
    }
}

/// Replaces x with exp(x - max(x)) and returns 1 / their sum.
#[inline(always)]
fn softmax_unnormalized<const FMA: bool>(x: &mut [f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let mut max = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    for c in chunks {
        for l in 0..LANES {
            lanes[l] = lanes[l].max(c[l]);
        }
    }
    max = lanes.iter().fold(max, |m, &v| m.max(v));
    let mut sums = [0f32; LANES];
    let mut chunks = x.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            c[l] = exp_with::<FMA>(c[l] - max);
            sums[l] += c[l];
        }
    }
    let mut sum = 0f32;
    for v in chunks.into_remainder() {
        *v = exp_with::<FMA>(*v - max);
        sum += *v;
    }
    1.0 / (sum + sums.iter().sum::<f32>())
}

/// acc[g][l] = sum over the `len` keys j of p[g][j] * values[j][c0 + l] (scores rows hold the
/// unnormalized probabilities; `lp` floats per row, `dp` per value row, c0 + LANES <= dp).
#[inline(always)]
fn value_sum<const FMA: bool>(
    p: &[f32],
    values: &[f32],
    len: usize,
    lp: usize,
    dp: usize,
    c0: usize,
) -> [[f32; LANES]; QUERY_GROUP] {
    assert!(
        len <= lp && p.len() >= QUERY_GROUP * lp && values.len() >= len * dp && c0 + LANES <= dp
    );
    let mut acc = [[0f32; LANES]; QUERY_GROUP];
    for j in 0..len {
        // SAFETY: j * dp + c0 + LANES <= len * dp and g * lp + j < QUERY_GROUP * lp (asserted)
        let v: &[f32; LANES] =
            unsafe { &*(values.as_ptr().add(j * dp + c0) as *const [f32; LANES]) };
        for (g, acc) in acc.iter_mut().enumerate() {
            let pg = unsafe { *p.get_unchecked(g * lp + j) };
            for l in 0..LANES {
                acc[l] = madd::<FMA>(pg, v[l], acc[l]);
            }
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plain float64 attention per sequence and head, the kernel's reference.
    fn reference(qkv: &[f32], cu: &[i32], heads: usize, d: usize, scaling: f32) -> Vec<f32> {
        let hidden = heads * d;
        let tokens = qkv.len() / (3 * hidden);
        let mut out = vec![0f32; tokens * hidden];
        for w in cu.windows(2) {
            let (a, b) = (w[0] as usize, w[1] as usize);
            for h in 0..heads {
                for i in a..b {
                    let q = &qkv[i * 3 * hidden + h * d..][..d];
                    let s: Vec<f64> = (a..b)
                        .map(|j| {
                            let k = &qkv[j * 3 * hidden + hidden + h * d..][..d];
                            q.iter()
                                .zip(k)
                                .map(|(x, y)| *x as f64 * *y as f64)
                                .sum::<f64>()
                                * scaling as f64
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for c in 0..d {
                        let v: f64 = (a..b)
                            .map(|j| e[j - a] * qkv[j * 3 * hidden + 2 * hidden + h * d + c] as f64)
                            .sum();
                        out[i * hidden + h * d + c] = (v / z) as f32;
                    }
                }
            }
        }
        out
    }

    fn seeded(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            })
            .collect()
    }

    fn check(lens: &[i32], heads: usize, d: usize, threads: usize) {
        let mut cu = vec![0i32];
        for l in lens {
            cu.push(cu.last().unwrap() + l);
        }
        let tokens = *cu.last().unwrap() as usize;
        let qkv = seeded(tokens * 3 * heads * d, (tokens * heads * d) as u64);
        let scaling = 1.0 / (d as f32).sqrt();
        let want = reference(&qkv, &cu, heads, d, scaling);
        let mut got = vec![f32::NAN; tokens * heads * d];
        varlen_attention(&qkv, &cu, &mut got, heads, d, scaling, threads).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 2e-6 * (1.0 + w.abs()),
                "at {i}: {g} vs {w} (lens {lens:?}, d {d})"
            );
        }
    }

    #[test]
    fn matches_float64_attention_on_ragged_batches() {
        check(&[1], 1, 16, 1);
        check(&[5, 1, 17, 64, 65, 130], 3, 32, 1);
        check(&[7, 0, 33], 2, 24, 1); // head_dim not a multiple of 16; an empty sequence
        check(&[200, 3, 129], 4, 64, 4); // several threads, query blocks split
        check(&[9, 12], 2, 8, 2);
    }

    #[test]
    fn threads_give_the_same_bits() {
        let lens = [40, 300, 7, 90];
        let cu: Vec<i32> = std::iter::once(0)
            .chain(lens.iter().scan(0, |s, l| {
                *s += l;
                Some(*s)
            }))
            .collect();
        let tokens = *cu.last().unwrap() as usize;
        let qkv = seeded(tokens * 3 * 2 * 32, 7);
        let mut one = vec![0f32; tokens * 64];
        let mut four = vec![0f32; tokens * 64];
        varlen_attention(&qkv, &cu, &mut one, 2, 32, 0.17, 1).unwrap();
        varlen_attention(&qkv, &cu, &mut four, 2, 32, 0.17, 4).unwrap();
        assert_eq!(one, four);
    }

    #[test]
    fn rejects_bad_sizes_and_offsets_writing_nothing() {
        let qkv = vec![0f32; 4 * 3 * 8];
        let mut out = vec![1f32; 4 * 8];
        let bad_offsets: [&[i32]; 4] = [&[], &[1, 4], &[0, 3, 2, 4], &[0, 3]];
        for cu in bad_offsets {
            assert!(matches!(
                varlen_attention(&qkv, cu, &mut out, 1, 8, 1.0, 1),
                Err(VarlenAttentionError::Index(_))
            ));
        }
        assert!(matches!(
            varlen_attention(&qkv, &[0, 4], &mut out, 3, 8, 1.0, 1),
            Err(VarlenAttentionError::Shape(_))
        ));
        assert!(matches!(
            varlen_attention(&qkv, &[0, 4], &mut out, 0, 8, 1.0, 1),
            Err(VarlenAttentionError::Shape(_))
        ));
        assert!(out.iter().all(|&x| x == 1.0));
    }
}
