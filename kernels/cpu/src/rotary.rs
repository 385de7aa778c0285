//! Rotary position embedding (Su et al., "RoFormer", 2021) in the rotate-half layout of
//! GPT-NeoX and HF Llama, applied in place: dimension i of a head pairs with i + head_dim / 2.
//!
//! Rounding equals the torch reference (pyserve_kernels.reference.apply_rotary_pos_emb):
//! each output is x * cos + (+-x_pair) * sin as two rounded products and one rounded sum, in
//! the same order, so the results are bit-identical.

use crate::parallel::{for_row_chunks, threads_for};
use crate::simd::avx2_dispatch;

/// Rotates, in place, the first `num_heads` heads (`head_dim` floats each, from column 0) of
/// every row of `x` ([num_tokens, row_len]) by that row's angles: `cos`, `sin`
/// [num_tokens, head_dim]. Columns past num_heads * head_dim are untouched (e.g. the V part
/// of a fused q|k|v row). Panics on inconsistent lengths or an odd head_dim.
pub fn rotary_embedding(
    x: &mut [f32],
    row_len: usize,
    num_heads: usize,
    head_dim: usize,
    cos: &[f32],
    sin: &[f32],
    num_threads: usize,
) {
    assert!(
        head_dim > 0 && head_dim.is_multiple_of(2),
        "rotary_embedding: head_dim {head_dim} must be even"
    );
    if x.is_empty() || num_heads == 0 {
        return;
    }
    assert!(
        row_len >= num_heads * head_dim && row_len > 0 && x.len().is_multiple_of(row_len),
        "rotary_embedding: bad row length"
    );
    let num_tokens = x.len() / row_len;
    assert!(
        cos.len() == num_tokens * head_dim && sin.len() == cos.len(),
        "rotary_embedding: cos/sin must be [num_tokens, head_dim]"
    );
    let work = num_tokens * num_heads * head_dim;
    for_row_chunks(
        x,
        row_len,
        threads_for(work, num_threads),
        |first, chunk| {
            let angles = first * head_dim..first * head_dim + chunk.len() / row_len * head_dim;
            rotate_rows(
                chunk,
                row_len,
                num_heads,
                head_dim,
                &cos[angles.clone()],
                &sin[angles],
            );
        },
    );
}

avx2_dispatch! {
    fn rotate_rows(x: &mut [f32], row_len: usize, num_heads: usize, head_dim: usize, cos: &[f32], sin: &[f32]) {
        let half = head_dim / 2;
        for ((row, c), s) in x.chunks_exact_mut(row_len).zip(cos.chunks_exact(head_dim)).zip(sin.chunks_exact(head_dim)) {
            let (c1, c2) = c.split_at(half);
            let (s1, s2) = s.split_at(half);
            for head in row[..num_heads * head_dim].chunks_exact_mut(head_dim) {
                let (a, b) = head.split_at_mut(half);
                for j in 0..half {
                    let (x1, x2) = (a[j], b[j]);
                    a[j] = x1 * c1[j] + (-x2) * s1[j];
                    b[j] = x2 * c2[j] + x1 * s2[j];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotates_pairs_and_leaves_other_columns() {
        // one token, two heads of 4 (rotated) + 2 extra columns; angle 90 degrees on pair 0
        // and 0 degrees on pair 1.
        let mut x = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0];
        let cos = [0.0, 1.0, 0.0, 1.0];
        let sin = [1.0, 0.0, 1.0, 0.0];
        rotary_embedding(&mut x, 10, 2, 4, &cos, &sin, 1);
        assert_eq!(x, vec![-3.0, 2.0, 1.0, 4.0, -7.0, 6.0, 5.0, 8.0, 9.0, 10.0]);
    }

    #[test]
    fn threads_do_not_change_results() {
        let (t, row_len, heads, d) = (3000, 40, 3, 8);
        let x0: Vec<f32> = (0..t * row_len)
            .map(|i| (i % 17) as f32 * 0.25 - 2.0)
            .collect();
        let cos: Vec<f32> = (0..t * d).map(|i| ((i % 11) as f32 * 0.3).cos()).collect();
        let sin: Vec<f32> = (0..t * d).map(|i| ((i % 11) as f32 * 0.3).sin()).collect();
        let (mut a, mut b) = (x0.clone(), x0.clone());
        rotary_embedding(&mut a, row_len, heads, d, &cos, &sin, 1);
        rotary_embedding(&mut b, row_len, heads, d, &cos, &sin, 3);
        assert_eq!(a, b);
        assert_eq!(a[row_len - 1], x0[row_len - 1]);
    }
}
