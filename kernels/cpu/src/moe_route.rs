//! Top-k routing of a mixture of experts: from a token's router logits to its k experts and
//! their weights, as the HF implementations of Mixtral, OLMoE and Qwen-MoE compute them:
//!
//! ```text
//! p = softmax(logits)            (float32, over all E experts)
//! ids = the k largest p, descending, ties to the lower expert id (torch.topk's order)
//! weights = p[ids], divided by their sum when the family renormalises
//! ```
//!
//! One function for the Python layer and the native decoder layer alike, so both route a token
//! the same way to the bit (torch's softmax rounds its exponentials differently, by about one
//! ulp). Each token is routed alone, so its routing does not depend on its batch.

use crate::moe::MoeError;

/// Routes `logits` [T, E] (T·E floats): writes `weights` [T, k] float32 and `ids` [T, k] (expert
/// ids, descending probability). NaN logits make NaN weights but k distinct ids still.
pub fn route(
    logits: &[f32],
    num_experts: usize,
    top_k: usize,
    renormalize: bool,
    weights: &mut [f32],
    ids: &mut [i32],
) -> Result<(), MoeError> {
    if num_experts == 0
        || top_k == 0
        || top_k > num_experts
        || !logits.len().is_multiple_of(num_experts)
        || weights.len() != logits.len() / num_experts * top_k
        || ids.len() != weights.len()
    {
        return Err(MoeError::Shape(format!(
            "route: {} logits over {num_experts} experts with top {top_k} do not fit {} weights and {} ids",
            logits.len(),
            weights.len(),
            ids.len()
        )));
    }
    let mut probs = vec![0f32; num_experts];
    let mut taken = vec![false; num_experts];
    let rows = logits.chunks_exact(num_experts).zip(
        weights
            .chunks_exact_mut(top_k)
            .zip(ids.chunks_exact_mut(top_k)),
    );
    for (row, (w, id)) in rows {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for (p, &l) in probs.iter_mut().zip(row) {
            *p = (l - max).exp();
            sum += *p;
        }
        for p in probs.iter_mut() {
            *p /= sum;
        }
        taken.fill(false);
        for (wj, idj) in w.iter_mut().zip(id.iter_mut()) {
            let mut best = taken.iter().position(|&t| !t).unwrap_or(0);
            for e in best + 1..num_experts {
                if !taken[e] && probs[e] > probs[best] {
                    best = e;
                }
            }
            taken[best] = true;
            *wj = probs[best];
            *idj = best as i32;
        }
        if renormalize {
            let total: f32 = w.iter().sum();
            for wj in w.iter_mut() {
                *wj /= total;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::route;

    #[test]
    fn softmax_top_k_in_descending_order_with_ties_to_the_lower_id() {
        let logits = [0.0f32, 2.0, 1.0, 2.0, -1.0, 0.5, 0.5, 3.0];
        let (mut w, mut ids) = ([0f32; 4], [0i32; 4]);
        route(&logits, 4, 2, false, &mut w, &mut ids).unwrap();
        assert_eq!(ids, [1, 3, 3, 1]);
        let e = |x: f32| x.exp();
        let s0 = e(-2.0) + 1.0 + e(-1.0) + 1.0;
        assert_eq!(w[0], w[1]);
        assert!((w[0] - 1.0 / s0).abs() < 1e-7);
        let s1 = e(-4.0) + e(-2.5) + e(-2.5) + 1.0;
        assert!((w[2] - 1.0 / s1).abs() < 1e-7 && (w[3] - e(-2.5) / s1).abs() < 1e-7);
        route(&logits, 4, 2, true, &mut w, &mut ids).unwrap();
        assert_eq!(w[..2], [0.5, 0.5]);
        assert!((w[2] + w[3] - 1.0).abs() < 1e-7 && (w[2] / w[3] - e(2.5)).abs() < 1e-4);
    }

    #[test]
    fn nan_logits_still_give_distinct_ids_and_bad_sizes_are_refused() {
        let logits = [f32::NAN; 4];
        let (mut w, mut ids) = ([0f32; 3], [0i32; 3]);
        route(&logits, 4, 3, true, &mut w, &mut ids).unwrap();
        assert_eq!(ids, [0, 1, 2]);
        assert!(route(&logits, 4, 5, true, &mut [0f32; 5], &mut [0i32; 5]).is_err());
        assert!(route(&logits, 3, 1, true, &mut [0f32; 1], &mut [0i32; 1]).is_err());
    }
}
