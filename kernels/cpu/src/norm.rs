//! RMSNorm (Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019), as Llama uses it:
//! y = x / sqrt(mean(x^2) + eps) * weight, per row; and the fused residual form of SGLang and
//! vLLM: residual += x, then x = rmsnorm(residual), in one pass over the row.
//!
//! Rounding follows the torch reference (pyserve_kernels.reference.rms_norm): the mean of
//! squares is accumulated in float32 (in another order than torch's, about 1e-7 relative),
//! then each element is (x * r) * w with r = 1 / sqrt(mean + eps).

use crate::parallel::{for_row_chunks, for_row_chunks2, threads_for};
use crate::simd::{avx2_dispatch, lane_sum};

#[inline(always)]
fn normalize_row(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let r = 1.0 / (lane_sum(x, |v| v * v) / x.len() as f32 + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = (v * r) * w;
    }
}

/// out[row] = rmsnorm(x[row]) * weight for each row of `hidden = weight.len()` floats.
/// Panics unless x and out have the same length, a multiple of weight.len() (> 0).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32], num_threads: usize) {
    let hidden = weight.len();
    assert!(
        hidden > 0 && x.len() == out.len() && x.len().is_multiple_of(hidden),
        "rms_norm: bad lengths"
    );
    for_row_chunks(
        out,
        hidden,
        threads_for(x.len(), num_threads),
        |first, chunk| {
            rms_norm_rows(
                &x[first * hidden..first * hidden + chunk.len()],
                weight,
                eps,
                chunk,
            );
        },
    );
}

/// residual[row] += x[row]; x[row] = rmsnorm(residual[row]) * weight, in place.
/// Panics unless x and residual have the same length, a multiple of weight.len() (> 0).
pub fn fused_add_rms_norm(
    x: &mut [f32],
    residual: &mut [f32],
    weight: &[f32],
    eps: f32,
    num_threads: usize,
) {
    let hidden = weight.len();
    assert!(
        hidden > 0 && x.len() == residual.len() && x.len().is_multiple_of(hidden),
        "fused_add_rms_norm: bad lengths"
    );
    for_row_chunks2(
        x,
        residual,
        hidden,
        hidden,
        threads_for(x.len(), num_threads),
        |_, x, residual| {
            add_rms_norm_rows(x, residual, weight, eps);
        },
    );
}

avx2_dispatch! {
    fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
        let hidden = weight.len();
        for (xr, or) in x.chunks_exact(hidden).zip(out.chunks_exact_mut(hidden)) {
            normalize_row(xr, weight, eps, or);
        }
    }
}

avx2_dispatch! {
    fn add_rms_norm_rows(x: &mut [f32], residual: &mut [f32], weight: &[f32], eps: f32) {
        let hidden = weight.len();
        for (xr, rr) in x.chunks_exact_mut(hidden).zip(residual.chunks_exact_mut(hidden)) {
            for (r, &v) in rr.iter_mut().zip(xr.iter()) {
                *r += v;
            }
            normalize_row(rr, weight, eps, xr);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
        x.chunks(w.len())
            .flat_map(|row| {
                let ms =
                    row.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / row.len() as f64;
                let r = 1.0 / (ms + eps as f64).sqrt();
                row.iter()
                    .zip(w)
                    .map(move |(v, w)| (*v as f64 * r * *w as f64) as f32)
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32
                    / (1u32 << 24) as f32)
                    * 4.0
                    - 2.0
            })
            .collect()
    }

    #[test]
    fn matches_f64_reference() {
        for &(rows, hidden, threads) in &[(1, 7, 1), (5, 576, 2), (300, 576, 2), (3, 33, 4)] {
            let (x, w) = (data(rows * hidden, 1), data(hidden, 2));
            let mut out = vec![0f32; x.len()];
            rms_norm(&x, &w, 1e-5, &mut out, threads);
            for (a, b) in out.iter().zip(reference(&x, &w, 1e-5)) {
                assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{a} vs {b}");
            }
        }
    }

    #[test]
    fn fused_add_updates_residual_and_normalizes_the_sum() {
        for &(rows, hidden, threads) in &[(1, 8, 1), (300, 576, 2), (7, 64, 3)] {
            let (x0, r0, w) = (
                data(rows * hidden, 3),
                data(rows * hidden, 4),
                data(hidden, 5),
            );
            let (mut x, mut r) = (x0.clone(), r0.clone());
            fused_add_rms_norm(&mut x, &mut r, &w, 1e-6, threads);
            let sum: Vec<f32> = x0.iter().zip(&r0).map(|(a, b)| a + b).collect();
            assert_eq!(r, sum);
            let mut want = vec![0f32; sum.len()];
            rms_norm(&sum, &w, 1e-6, &mut want, 1);
            assert_eq!(x, want);
        }
    }
}
