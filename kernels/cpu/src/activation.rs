//! SwiGLU's gate (Shazeer, "GLU Variants Improve Transformer", 2020): silu(gate) * up, with
//! silu(g) = g / (1 + e^-g), from a fused [gate | up] row.

use crate::exp::exp;
use crate::parallel::{for_row_chunks, threads_for};
use crate::simd::avx2_dispatch;

/// out[t, i] = silu(x[t, i]) * x[t, d + i] for x [num_tokens, 2 d], out [num_tokens, d].
/// Panics on inconsistent lengths.
pub fn silu_and_mul(x: &[f32], out: &mut [f32], d: usize, num_threads: usize) {
    assert!(
        d > 0 && x.len() == 2 * out.len() && out.len().is_multiple_of(d),
        "silu_and_mul: bad lengths"
    );
    for_row_chunks(out, d, threads_for(x.len(), num_threads), |first, chunk| {
        silu_and_mul_rows(&x[2 * first * d..2 * first * d + 2 * chunk.len()], chunk, d);
    });
}

avx2_dispatch! {
    fn silu_and_mul_rows(x: &[f32], out: &mut [f32], d: usize) {
        for (o, row) in out.chunks_exact_mut(d).zip(x.chunks_exact(2 * d)) {
            let (gate, up) = row.split_at(d);
            for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                *o = g / (1.0 + exp(-g)) * u;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_f64_formula() {
        let d = 37;
        let x: Vec<f32> = (0..3 * 2 * d).map(|i| (i as f32 - 100.0) * 0.173).collect();
        let mut out = vec![0f32; 3 * d];
        silu_and_mul(&x, &mut out, d, 2);
        for t in 0..3 {
            for i in 0..d {
                let (g, u) = (x[t * 2 * d + i] as f64, x[t * 2 * d + d + i] as f64);
                let want = g / (1.0 + (-g).exp()) * u;
                let got = out[t * d + i] as f64;
                assert!(
                    (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                    "{got} vs {want}"
                );
            }
        }
    }
}
