//! The activations side of the quantized products: float32 rows rounded to int8 per block of 32
//! with one scale per block (`mod.rs` gives the arithmetic and its error bound), and a row of
//! them as the kernels read it.

use super::x86;
use crate::parallel;

/// Activations quantized per block of 32: `m` rows of `k` (a multiple of 32) int8 values, one
/// scale `d` and one scaled sum `s = d * Σq` per block.
pub struct QuantActivations {
    pub k: usize,
    pub q: Vec<i8>,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
}

impl QuantActivations {
    /// Quantizes `x` ([m, k] float32, k a multiple of 32) on up to `num_threads` threads.
    /// Panics otherwise.
    pub fn new(x: &[f32], k: usize, num_threads: usize) -> QuantActivations {
        assert!(
            k.is_multiple_of(32) && x.len().is_multiple_of(k),
            "k must be a multiple of 32"
        );
        let blocks = x.len() / 32;
        let mut act = QuantActivations {
            k,
            q: vec![0; x.len()],
            d: vec![0.0; blocks],
            s: vec![0.0; blocks],
        };
        if blocks == 0 {
            return act;
        }
        // a prefill's activations are worth threads (1024 rows of 1536: 7 ms on one)
        let threads = parallel::threads_for(x.len(), num_threads);
        let per = blocks.div_ceil(threads);
        let chunks: Vec<_> = x
            .chunks(32 * per)
            .zip(act.q.chunks_mut(32 * per))
            .zip(act.d.chunks_mut(per).zip(act.s.chunks_mut(per)))
            .map(std::sync::Mutex::new)
            .collect();
        parallel::run_tasks_on(chunks.len(), threads, &|i| {
            let mut chunk = chunks[i].lock().unwrap();
            let ((x, q), (d, s)) = &mut *chunk;
            quantize_blocks(x, q, d, s);
        });
        drop(chunks);
        act
    }

    pub(crate) fn rows(&self) -> usize {
        self.q.len() / self.k
    }

    /// Row r: its k codes and its k / 32 scales and scaled sums.
    pub(crate) fn row(&self, r: usize) -> ActRow<'_> {
        let (k, kb) = (self.k, self.k / 32);
        ActRow {
            q: &self.q[r * k..(r + 1) * k],
            d: &self.d[r * kb..(r + 1) * kb],
            s: &self.s[r * kb..(r + 1) * kb],
        }
    }
}

/// Each block of 32 of `x` to int8 `q` with its scale `d` (max|x| / 127) and `s` = d * sum(q):
/// `x86::quantize_blocks_avx2` where the CPU has AVX2 (the same bits for finite x), else
/// `quantize_blocks_portable`.
pub(crate) fn quantize_blocks(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has the features the function is compiled for.
        return unsafe { x86::quantize_blocks_avx2(x, q, d, s) };
    }
    quantize_blocks_portable(x, q, d, s)
}

/// `quantize_blocks` in portable Rust, the reference of the SIMD version.
pub(crate) fn quantize_blocks_portable(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    for (b, (xb, qb)) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)).enumerate() {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in qb.iter_mut().zip(xb) {
            // |v * inv| <= 127, except where inv overflowed (a subnormal block): the
            // saturating cast then keeps each value's sign, and the clamp keeps -128 out
            // (the sign trick of the signed weight formats cannot negate it)
            *q = ((v * inv).round_ties_even() as i8).max(-127);
            sum += *q as i32;
        }
        d[b] = scale;
        s[b] = scale * sum as f32;
    }
}

/// One quantized activation row: `q` [k], `d` and `s` [k / 32].
#[derive(Clone, Copy)]
pub(crate) struct ActRow<'a> {
    pub q: &'a [i8],
    pub d: &'a [f32],
    pub s: &'a [f32],
}
