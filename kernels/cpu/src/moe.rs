//! A mixture-of-experts feed-forward after routing, in one call: each token's top-k experts
//! (SwiGLU MLPs held stacked) run on it and their outputs are summed with the routing weights.
//!
//! ```text
//! out[t] = Σ_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, j]
//! ```
//!
//! Sparsely-gated experts: Shazeer et al. 2017; top-k SwiGLU experts as in Mixtral, OLMoE and
//! Qwen-MoE. The step's (token, expert) assignments are grouped by expert with a counting sort
//! (token order kept), so only the experts some token reached run, each as two products over
//! just its tokens; all the used experts' products share one parallel region per projection,
//! cut by (expert, weight rows). A decode step of B tokens thus reads at most B·k experts'
//! weights, the cost of its active parameters.
//!
//! Weights are float32 or GGUF blocks (`crate::quant`, activations rounded to int8 per block
//! of 32 as in the dense quantized products). Each output element is computed by the same
//! arithmetic in the same order whatever the batch, the token's place in it and the thread
//! count: a token's expert outputs are added in ascending expert order, so results are the
//! same bits at any batch size.

use std::ops::Range;

use crate::activation;
use crate::parallel;
use crate::quant::{self, Isa, OutColumns, Product, QuantError, QuantMatrix};
use crate::simd::avx2_dispatch;

/// The stacked experts this call holds (a tensor- or expert-parallel rank's share):
/// `gate_up` [E, 2I, H] (each expert's I gate rows, then its I up rows), `down` [E, H, I].
#[derive(Clone, Copy)]
pub enum ExpertWeights<'a> {
    F32 {
        gate_up: &'a [f32],
        down: &'a [f32],
    },
    /// `gate_up` of E·2I rows of H weights, `down` of E·H rows of I weights.
    Quant {
        gate_up: QuantMatrix<'a>,
        down: QuantMatrix<'a>,
    },
}

/// Sizes of a call. Expert ids are global: this call holds experts
/// `expert_start..expert_start + num_experts` of the model's `total_experts`, and assignments
/// to the others are left to the ranks that hold them.
#[derive(Clone, Copy, Debug)]
pub struct MoeShape {
    pub hidden: usize,
    pub inter: usize,
    pub num_experts: usize,
    pub expert_start: usize,
    pub total_experts: usize,
    pub top_k: usize,
}

/// Why the experts could not run; nothing is written then.
#[derive(Debug)]
pub enum MoeError {
    Shape(String),
    /// An expert id outside 0..total_experts.
    ExpertId(i32),
    Quant(QuantError),
}

impl std::fmt::Display for MoeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MoeError::Shape(m) => f.write_str(m),
            MoeError::ExpertId(e) => write!(f, "expert id {e} is outside the model's experts"),
            MoeError::Quant(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for MoeError {}

impl MoeShape {
    fn check(
        &self,
        w: &ExpertWeights<'_>,
        x: usize,
        ids: usize,
        weights: usize,
        out: usize,
    ) -> Result<(), MoeError> {
        let (h, i, e) = (self.hidden, self.inter, self.num_experts);
        let bad = |m: String| Err(MoeError::Shape(m));
        if h == 0 || i == 0 || self.top_k == 0 || self.expert_start + e > self.total_experts {
            return bad(format!("moe: bad sizes {self:?}"));
        }
        if !x.is_multiple_of(h) || out != x || ids != x / h * self.top_k || weights != ids {
            return bad(format!(
                "moe: x has {x} elements, out {out}, ids {ids}, weights {weights}: not [T, {h}], [T, {h}], [T, {}] twice",
                self.top_k
            ));
        }
        let (gu, dn, gk, dk) = match w {
            ExpertWeights::F32 { gate_up, down } => {
                (gate_up.len(), down.len(), h * 2 * i * e, h * i * e)
            }
            ExpertWeights::Quant { gate_up, down } => {
                if gate_up.k() != h || down.k() != i {
                    return bad(format!(
                        "moe: quantized rows of {} and {} weights, expected {h} (gate_up) and {i} (down)",
                        gate_up.k(),
                        down.k()
                    ));
                }
                if (gate_up.interleaved || down.interleaved)
                    && !(i.is_multiple_of(4) && h.is_multiple_of(8))
                {
                    return bad(format!(
                        "moe: interleaved experts need 2I and H in whole groups of 8 rows, got I {i}, H {h}"
                    ));
                }
                (gate_up.rows(), down.rows(), 2 * i * e, h * e)
            }
        };
        if gu != gk || dn != dk {
            return bad(format!(
                "moe: gate_up has {gu} and down {dn} (elements or rows), expected {gk} and {dk}"
            ));
        }
        Ok(())
    }
}

/// The assignments this call runs, grouped by expert: `offsets` [E + 1] into `token` and
/// `weight` (each expert's assignments in token order), and per token the positions of its
/// assignments, ascending (so in ascending expert order), `usize::MAX` for one held elsewhere.
struct Groups {
    offsets: Vec<usize>,
    token: Vec<usize>,
    weight: Vec<f32>,
    position: Vec<usize>,
}

fn group(ids: &[i32], weights: &[f32], s: &MoeShape) -> Result<Groups, MoeError> {
    let mut counts = vec![0usize; s.num_experts + 1];
    let local = |id: i32| -> Result<Option<usize>, MoeError> {
        if id < 0 || id as usize >= s.total_experts {
            return Err(MoeError::ExpertId(id));
        }
        let id = id as usize;
        Ok((s.expert_start..s.expert_start + s.num_experts)
            .contains(&id)
            .then(|| id - s.expert_start))
    };
    for &id in ids {
        if let Some(e) = local(id)? {
            counts[e + 1] += 1;
        }
    }
    for e in 0..s.num_experts {
        counts[e + 1] += counts[e];
    }
    let offsets = counts.clone();
    let mut next = counts;
    let a = offsets[s.num_experts];
    let mut g = Groups {
        offsets,
        token: vec![0; a],
        weight: vec![0.0; a],
        position: vec![usize::MAX; ids.len()],
    };
    for (slot, (&id, &w)) in ids.iter().zip(weights).enumerate() {
        if let Some(e) = local(id)? {
            let p = next[e];
            next[e] += 1;
            g.token[p] = slot / s.top_k;
            g.weight[p] = w;
            g.position[slot] = p;
        }
    }
    for row in g.position.chunks_exact_mut(s.top_k) {
        row.sort_unstable();
    }
    Ok(g)
}

/// out [T, H] = the routed experts' weighted sum for x [T, H] float32, ids [T, k] (global
/// expert ids) and weights [T, k] float32 (the routing weights, applied as given). Tokens whose
/// every assignment is held elsewhere get zeros. Threads: up to `num_threads`; `isa` is used by
/// the quantized products.
#[allow(clippy::too_many_arguments)]
pub fn fused_experts(
    x: &[f32],
    ids: &[i32],
    weights: &[f32],
    experts: ExpertWeights<'_>,
    shape: MoeShape,
    out: &mut [f32],
    num_threads: usize,
    isa: Isa,
) -> Result<(), MoeError> {
    shape.check(&experts, x.len(), ids.len(), weights.len(), out.len())?;
    if matches!(experts, ExpertWeights::Quant { .. }) && !quant::available_isas().contains(&isa) {
        return Err(MoeError::Quant(QuantError::Isa(isa)));
    }
    let g = group(ids, weights, &shape)?;
    let (h, i) = (shape.hidden, shape.inter);
    let a = g.token.len();
    let mut xs = vec![0f32; a * h];
    for (row, &t) in xs.chunks_exact_mut(h).zip(&g.token) {
        row.copy_from_slice(&x[t * h..(t + 1) * h]);
    }
    let mut gate_up_out = vec![0f32; a * 2 * i];
    let mut act = vec![0f32; a * i];
    let mut ys = vec![0f32; a * h];
    if a > 0 {
        let (gate_up, down) = match experts {
            ExpertWeights::F32 { gate_up, down } => (Weights::F32(gate_up), Weights::F32(down)),
            ExpertWeights::Quant { gate_up, down } => {
                (Weights::Quant(gate_up), Weights::Quant(down))
            }
        };
        grouped_product(
            &xs,
            h,
            gate_up,
            2 * i,
            &g.offsets,
            &mut gate_up_out,
            num_threads,
            isa,
        );
        activation::silu_and_mul(&gate_up_out, &mut act, i, num_threads);
        grouped_product(&act, i, down, h, &g.offsets, &mut ys, num_threads, isa);
    }
    let threads = parallel::threads_for(out.len(), num_threads);
    parallel::for_row_chunks(out, h, threads, |first, chunk| {
        for (t, row) in chunk.chunks_exact_mut(h).enumerate() {
            let t = first + t;
            row.fill(0.0);
            for &p in &g.position[t * shape.top_k..(t + 1) * shape.top_k] {
                if p != usize::MAX {
                    add_scaled(row, &ys[p * h..(p + 1) * h], g.weight[p]);
                }
            }
        }
    });
    Ok(())
}

/// The router's logits: out [T, E] = x [T, H] @ gate [E, H]^T in float32, each the same bits
/// at any batch size (the expert products' dot kernel), on up to `num_threads` threads.
pub fn router_logits(
    x: &[f32],
    gate: &[f32],
    hidden: usize,
    out: &mut [f32],
    num_threads: usize,
) -> Result<(), MoeError> {
    if hidden == 0
        || !x.len().is_multiple_of(hidden)
        || !gate.len().is_multiple_of(hidden)
        || out.len() != x.len() / hidden * (gate.len() / hidden)
    {
        return Err(MoeError::Shape(format!(
            "router: x of {} and gate of {} floats are not [T, {hidden}] and [E, {hidden}] for out of {}",
            x.len(),
            gate.len(),
            out.len()
        )));
    }
    let e = gate.len() / hidden;
    if e == 0 || x.is_empty() {
        return Ok(());
    }
    let threads = parallel::threads_for(x.len() / hidden * gate.len(), num_threads);
    let per = e.div_ceil(threads * 4).next_multiple_of(4).min(e);
    let out = OutColumns::new(out);
    parallel::run_tasks_on(e.div_ceil(per), threads, &|t| {
        f32_rows(x, gate, hidden, t * per..((t + 1) * per).min(e), out, e)
    });
    Ok(())
}

avx2_dispatch! {
    fn add_scaled(acc: &mut [f32], y: &[f32], w: f32) {
        for (a, &v) in acc.iter_mut().zip(y) {
            *a += w * v;
        }
    }
}

/// One projection of every expert, stacked: E matrices of `n` rows of `k`.
#[derive(Clone, Copy)]
enum Weights<'a> {
    F32(&'a [f32]),
    Quant(QuantMatrix<'a>),
}

/// out rows offsets[e]..offsets[e + 1] ([·, n]) = x's same rows ([·, k]) @ W_e^T for every
/// expert e with rows, all experts' products in one parallel region of (expert, weight-row
/// range) tasks.
#[allow(clippy::too_many_arguments)]
fn grouped_product(
    x: &[f32],
    k: usize,
    w: Weights<'_>,
    n: usize,
    offsets: &[usize],
    out: &mut [f32],
    num_threads: usize,
    isa: Isa,
) {
    let used: Vec<usize> = (0..offsets.len() - 1)
        .filter(|&e| offsets[e + 1] > offsets[e])
        .collect();
    let rows = |e: usize| offsets[e]..offsets[e + 1];
    // each used expert's output block, written by its tasks through OutColumns
    let mut outs = Vec::with_capacity(used.len());
    let mut rest = &mut out[..];
    let mut at = 0;
    for &e in &used {
        let r = rows(e);
        let (_, tail) = rest.split_at_mut((r.start - at) * n);
        let (mine, tail) = tail.split_at_mut(r.len() * n);
        outs.push(OutColumns::new(mine));
        rest = tail;
        at = r.end;
    }
    let products: Vec<Option<Product<'_>>> = used
        .iter()
        .map(|&e| match w {
            Weights::Quant(m) => {
                let data = &m.data[e * n * m.row_bytes..(e + 1) * n * m.row_bytes];
                let m = QuantMatrix { data, ..m };
                Some(Product::new(
                    &x[rows(e).start * k..rows(e).end * k],
                    m,
                    num_threads,
                    isa,
                ))
            }
            Weights::F32(_) => None,
        })
        .collect();
    let assigned = offsets[offsets.len() - 1];
    let work = match w {
        Weights::F32(_) => assigned * n * k,
        Weights::Quant(_) => assigned * n * k / 4,
    };
    let threads = parallel::threads_for(work, num_threads);
    // weight rows per task: a multiple of 8, about 4 tasks per thread over all used experts
    let per = (used.len() * n)
        .div_ceil(threads * 4)
        .next_multiple_of(8)
        .min(n);
    let per_expert = n.div_ceil(per);
    parallel::run_tasks_on(used.len() * per_expert, threads, &|task| {
        let (u, chunk) = (task / per_expert, task % per_expert);
        let cols = chunk * per..((chunk + 1) * per).min(n);
        match (w, &products[u]) {
            (Weights::Quant(_), Some(p)) => p.run_rows(cols, outs[u]),
            (Weights::F32(all), _) => {
                let e = used[u];
                let xe = &x[rows(e).start * k..rows(e).end * k];
                f32_rows(xe, &all[e * n * k..(e + 1) * n * k], k, cols, outs[u], n);
            }
            (Weights::Quant(_), None) => unreachable!("a quantized expert has its product"),
        }
    });
}

/// out[:, cols] of out [m, n] = x [m, k] @ w[cols]^T for float32 w [n, k]: weight rows in
/// groups of four against each activation row, every dot product accumulated in the same 16
/// lanes and reduced in the same order (so the bits do not depend on the grouping).
fn f32_rows(x: &[f32], w: &[f32], k: usize, cols: Range<usize>, out: OutColumns, n: usize) {
    let m = x.len() / k;
    let mut col = cols.start;
    while col < cols.end {
        let c = (cols.end - col).min(4);
        // a short last group repeats its last row; the extra results are dropped
        let rows: [&[f32]; 4] = std::array::from_fn(|j| {
            let r = col + j.min(c - 1);
            &w[r * k..(r + 1) * k]
        });
        for r in 0..m {
            let res = dot4(&x[r * k..(r + 1) * k], rows);
            for (j, v) in res.iter().enumerate().take(c) {
                // SAFETY: r < m and col + j < n index out [m, n]; these columns are this task's
                unsafe { out.set(r * n + col + j, *v) };
            }
        }
        col += c;
    }
}

/// The dot products of x [k] with four rows (each at least k long): AVX2 + FMA where the CPU
/// has them, else portable Rust. Either path accumulates each product in 16 lanes and reduces
/// them in one fixed order, so a product's bits do not depend on which rows share the call.
fn dot4(x: &[f32], rows: [&[f32]; 4]) -> [f32; 4] {
    assert!(
        rows.iter().all(|r| r.len() >= x.len()),
        "dot4: a row shorter than x"
    );
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has the features; every row holds x.len() floats (asserted).
        return unsafe { dot4_avx2(x, rows) };
    }
    dot4_portable(x, rows)
}

fn dot4_portable(x: &[f32], rows: [&[f32]; 4]) -> [f32; 4] {
    let full = x.len() / 16 * 16;
    std::array::from_fn(|c| {
        let mut acc = [0f32; 16];
        for (xc, wc) in x[..full].chunks_exact(16).zip(rows[c].chunks_exact(16)) {
            for l in 0..16 {
                acc[l] = xc[l].mul_add(wc[l], acc[l]);
            }
        }
        finish(&acc, &x[full..], &rows[c][full..x.len()])
    })
}

/// A product's 16 lanes reduced (pairs 8 apart, then `reduce_lanes`'s fixed tree), plus the
/// last k % 16 terms in order.
#[inline(always)]
fn finish(acc: &[f32; 16], x_tail: &[f32], w_tail: &[f32]) -> f32 {
    let s8: [f32; 8] = std::array::from_fn(|l| acc[l] + acc[l + 8]);
    let mut s = crate::quant::reduce_lanes(&s8);
    for (&xv, &wv) in x_tail.iter().zip(w_tail) {
        s += xv * wv;
    }
    s
}

/// # Safety
/// The CPU must have AVX2 and FMA, and every row at least x.len() floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot4_avx2(x: &[f32], rows: [&[f32]; 4]) -> [f32; 4] {
    use std::arch::x86_64::*;
    let full = x.len() / 16 * 16;
    let mut acc = [_mm256_setzero_ps(); 8]; // row c: lanes 0-7 in acc[2c], 8-15 in acc[2c + 1]
    let mut j = 0;
    while j < full {
        let x0 = _mm256_loadu_ps(x.as_ptr().add(j));
        let x1 = _mm256_loadu_ps(x.as_ptr().add(j + 8));
        for c in 0..4 {
            let p = rows[c].as_ptr().add(j);
            acc[2 * c] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(p), acc[2 * c]);
            acc[2 * c + 1] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(p.add(8)), acc[2 * c + 1]);
        }
        j += 16;
    }
    std::array::from_fn(|c| {
        let mut lanes = [0f32; 16];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc[2 * c]);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[2 * c + 1]);
        finish(&lanes, &x[full..], &rows[c][full..x.len()])
    })
}

#[cfg(test)]
mod tests;
