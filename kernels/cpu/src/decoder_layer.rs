//! One pre-norm Llama decoder layer of a decode step, on quantized projections, composed of the
//! kernels of this crate in the order the Python layer calls them (pyserve/models/llama.py), so
//! its results are the same bits:
//!
//! ```text
//! first layer: residual = hidden; x = rms_norm(hidden)
//! otherwise:   x, residual = rms_norm(hidden + residual), hidden + residual
//! qkv = x @ Wqkv^T; rotary on the q and k heads; store k, v at out_cache_loc
//! a = decode_attention(q, pool); h = a @ Wo^T
//! h, residual = rms_norm(h + residual), h + residual
//! hidden = silu_and_mul(h @ Wgate_up^T) @ Wdown^T
//! ```
//!
//! Variants the Python layers have too: q and k RMS-normed before rotary, per head (Qwen3) or
//! across all heads (OLMoE); and a mixture of experts in place of the MLP (router logits,
//! `moe_route::route`, then `moe::fused_experts` over the stacked quantized experts).
//!
//! Why: a decode step of a small model is many small products; from Python each layer made ten
//! calls through torch-to-numpy views and checks, about 150 us of a 30-layer SmolLM2-135M
//! step's ~12 ms on the 2-core test machine. One call per layer leaves the arithmetic alone.

use crate::decode_attention::{decode_attention, DecodeAttentionError, DecodeAttentionShape};
use crate::moe::{self, ExpertWeights, MoeError, MoeShape};
use crate::quant::{self, Isa, QuantError, QuantMatrix};
use crate::{activation, moe_route, norm, rotary, store_kv};

/// RMSNorm weights of q and k, applied (with the layer's eps) after the qkv product and
/// before rotary.
#[derive(Clone, Copy)]
pub enum QkNorm<'a> {
    None,
    /// Each head's head_dim values normed alone: weights [head_dim] (Qwen3).
    PerHead {
        q: &'a [f32],
        k: &'a [f32],
    },
    /// A token's whole q (k) normed at once: weights [num_heads head_dim] and
    /// [num_kv_heads head_dim] (OLMoE).
    Full {
        q: &'a [f32],
        k: &'a [f32],
    },
}

/// A mixture of experts in place of the MLP: `gate_up` then holds E experts' stacked rows
/// [E 2 intermediate, hidden] and `down` [E hidden, intermediate].
#[derive(Clone, Copy)]
pub struct MoeRouting<'a> {
    /// The router [E, hidden] float32.
    pub router: &'a [f32],
    pub top_k: usize,
    /// Divide the k weights by their sum (`moe_route::route`).
    pub renormalize: bool,
}

/// A layer's weights: projections as quantized matrices ([out_features, in_features] rows) and
/// the two RMSNorm weights [hidden].
pub struct LayerWeights<'a> {
    pub input_norm: &'a [f32],
    pub post_norm: &'a [f32],
    pub eps: f32,
    /// [(num_heads + 2 num_kv_heads) head_dim, hidden]: q, k, v rows stacked.
    pub qkv: QuantMatrix<'a>,
    /// [hidden, num_heads head_dim].
    pub o: QuantMatrix<'a>,
    /// [2 intermediate, hidden]: gate rows, then up rows.
    pub gate_up: QuantMatrix<'a>,
    /// [hidden, intermediate].
    pub down: QuantMatrix<'a>,
    pub qk_norm: QkNorm<'a>,
    /// Some: `gate_up` and `down` are stacked experts (see `MoeRouting`).
    pub moe: Option<MoeRouting<'a>>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// What a decode step gives every layer: per request its new token's rotary angles and KV slot,
/// and the CSR slot lists of `decode_attention`.
pub struct DecodeStep<'a> {
    /// [batch, head_dim] each.
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    /// [batch]: the slot each new token's K and V go to.
    pub out_cache_loc: &'a [i32],
    pub kv_indptr: &'a [i32],
    pub kv_indices: &'a [i32],
    pub scaling: f32,
    pub sliding_window: Option<usize>,
    pub num_threads: usize,
    pub isa: Isa,
}

/// Why a layer could not run; `hidden`, `residual` and the pool may be partly written then.
#[derive(Debug)]
pub enum LayerError {
    Shape(String),
    Quant(QuantError),
    Attention(DecodeAttentionError),
    Moe(MoeError),
    /// A slot of out_cache_loc outside the pool.
    Slot(i32),
}

impl std::fmt::Display for LayerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LayerError::Shape(m) => f.write_str(m),
            LayerError::Quant(e) => write!(f, "{e}"),
            LayerError::Attention(e) => write!(f, "{e}"),
            LayerError::Moe(e) => write!(f, "{e}"),
            LayerError::Slot(s) => write!(f, "out_cache_loc holds slot {s}, outside the pool"),
        }
    }
}

impl std::error::Error for LayerError {}

impl LayerWeights<'_> {
    /// Checks that the matrices and norms fit one another. Returns the hidden size.
    pub fn check(&self) -> Result<usize, LayerError> {
        let hidden = self.input_norm.len();
        let q = self.num_heads * self.head_dim;
        let kv = self.num_kv_heads * self.head_dim;
        let inter = self.down.k();
        let experts = match self.moe {
            Some(m) if m.router.len().is_multiple_of(hidden) && m.router.len() >= hidden => {
                m.router.len() / hidden
            }
            Some(m) => {
                return Err(LayerError::Shape(format!(
                    "router of {} floats is not [E, {hidden}]",
                    m.router.len()
                )))
            }
            None => 1,
        };
        if let Some(m) = self.moe {
            if m.top_k == 0 || m.top_k > experts {
                return Err(LayerError::Shape(format!(
                    "top_k {} must be in 1..={experts}",
                    m.top_k
                )));
            }
        }
        let norms_fit = match self.qk_norm {
            QkNorm::None => true,
            QkNorm::PerHead { q: wq, k: wk } => {
                wq.len() == self.head_dim && wk.len() == self.head_dim
            }
            QkNorm::Full { q: wq, k: wk } => wq.len() == q && wk.len() == kv,
        };
        if !norms_fit {
            return Err(LayerError::Shape(
                "q/k norm weights do not fit the heads".into(),
            ));
        }
        let want = [
            ("qkv", self.qkv.rows(), self.qkv.k(), q + 2 * kv, hidden),
            ("o", self.o.rows(), self.o.k(), hidden, q),
            (
                "gate_up",
                self.gate_up.rows(),
                self.gate_up.k(),
                experts * 2 * inter,
                hidden,
            ),
            (
                "down",
                self.down.rows(),
                self.down.k(),
                experts * hidden,
                inter,
            ),
        ];
        for (name, rows, k, want_rows, want_k) in want {
            if rows != want_rows || k != want_k {
                return Err(LayerError::Shape(format!(
                    "{name} is [{rows}, {k}], expected [{want_rows}, {want_k}]"
                )));
            }
        }
        if self.post_norm.len() != hidden
            || !self.head_dim.is_multiple_of(2)
            || self.num_kv_heads == 0
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
        {
            return Err(LayerError::Shape(format!(
                "norm weights of {hidden} and {}, or {} heads over {} KV heads of {}, do not fit",
                self.post_norm.len(),
                self.num_heads,
                self.num_kv_heads,
                self.head_dim
            )));
        }
        Ok(hidden)
    }
}

/// Runs the layer (module doc) for `batch` requests: `hidden`, `residual` [batch, hidden] are
/// updated in place to (the MLP's output, the residual stream before it), as the Python layer
/// returns them; `first`: `residual` is only written (the input is the embedding). The
/// new tokens' K and V rows are written into `k_buffer` / `v_buffer` ([num_slots, num_kv_heads,
/// head_dim], this layer's pool) before attention reads them. A mixture's layer adds one to
/// `expert_counts[c][e]`, for every count row c, per token routed to expert e (the rows are
/// [E] each: the expert load record); other layers leave them alone.
#[allow(clippy::too_many_arguments)]
pub fn decode_layer(
    w: &LayerWeights<'_>,
    step: &DecodeStep<'_>,
    hidden: &mut [f32],
    residual: &mut [f32],
    first: bool,
    k_buffer: &mut [f32],
    v_buffer: &mut [f32],
    expert_counts: &mut [&mut [i64]],
) -> Result<(), LayerError> {
    let h = w.check()?;
    let (nh, nkv, hd) = (w.num_heads, w.num_kv_heads, w.head_dim);
    let batch = hidden.len() / h;
    if hidden.len() != batch * h || residual.len() != hidden.len() {
        return Err(LayerError::Shape(format!(
            "hidden has {} and residual {} floats, not rows of {h}",
            hidden.len(),
            residual.len()
        )));
    }
    if step.cos.len() != batch * hd
        || step.sin.len() != step.cos.len()
        || step.out_cache_loc.len() != batch
    {
        return Err(LayerError::Shape(format!(
            "cos/sin must be [{batch}, {hd}] and out_cache_loc [{batch}]"
        )));
    }
    let row_kv = nkv * hd;
    if row_kv == 0 || k_buffer.len() != v_buffer.len() || !k_buffer.len().is_multiple_of(row_kv) {
        return Err(LayerError::Shape(
            "k_buffer and v_buffer must be equal whole slots".into(),
        ));
    }
    if let Some(m) = w.moe {
        let experts = m.router.len() / h;
        if let Some(c) = expert_counts.iter().find(|c| c.len() != experts) {
            return Err(LayerError::Shape(format!(
                "an expert count row has {} entries for {experts} experts",
                c.len()
            )));
        }
    }
    let threads = step.num_threads;
    let isa = step.isa;

    let mut x = vec![0f32; batch * h];
    if first {
        residual.copy_from_slice(hidden);
        norm::rms_norm(hidden, w.input_norm, w.eps, &mut x, threads);
    } else {
        norm::fused_add_rms_norm(hidden, residual, w.input_norm, w.eps, threads);
        x.copy_from_slice(hidden);
    }

    let qkv_len = (nh + 2 * nkv) * hd;
    let mut qkv = vec![0f32; batch * qkv_len];
    quant::matmul(&x, w.qkv, &mut qkv, threads, isa).map_err(LayerError::Quant)?;
    norm_qk(&mut qkv, qkv_len, w, threads);
    rotary::rotary_embedding(&mut qkv, qkv_len, nh + nkv, hd, step.cos, step.sin, threads);
    let (q_len, k_at) = (nh * hd, nh * hd);
    store_kv::store_kv(
        k_buffer,
        v_buffer,
        row_kv,
        step.out_cache_loc,
        |t| &qkv[t * qkv_len + k_at..t * qkv_len + k_at + row_kv],
        |t| &qkv[t * qkv_len + k_at + row_kv..(t + 1) * qkv_len],
    )
    .map_err(LayerError::Slot)?;
    let mut q = vec![0f32; batch * q_len];
    for (dst, src) in q.chunks_exact_mut(q_len).zip(qkv.chunks_exact(qkv_len)) {
        dst.copy_from_slice(&src[..q_len]);
    }
    let mut attn = vec![0f32; batch * q_len];
    let shape = DecodeAttentionShape {
        batch,
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
        num_slots: k_buffer.len() / row_kv,
    };
    decode_attention(
        &q,
        k_buffer,
        v_buffer,
        step.kv_indptr,
        step.kv_indices,
        &mut attn,
        shape,
        step.scaling,
        step.sliding_window,
        threads,
    )
    .map_err(LayerError::Attention)?;
    quant::matmul(&attn, w.o, hidden, threads, isa).map_err(LayerError::Quant)?;

    norm::fused_add_rms_norm(hidden, residual, w.post_norm, w.eps, threads);
    if let Some(m) = w.moe {
        return experts(hidden, h, w, m, threads, isa, expert_counts);
    }
    let inter = w.down.k();
    let mut gate_up = vec![0f32; batch * 2 * inter];
    quant::matmul(hidden, w.gate_up, &mut gate_up, threads, isa).map_err(LayerError::Quant)?;
    let mut act = vec![0f32; batch * inter];
    activation::silu_and_mul(&gate_up, &mut act, inter, threads);
    quant::matmul(&act, w.down, hidden, threads, isa).map_err(LayerError::Quant)?;
    Ok(())
}

/// The q/k norms of `w.qk_norm`, in place on the `batch` rows of `qkv` (each `row_len`: q
/// heads, k heads, v heads), by the same `norm::rms_norm` the Python layer calls.
fn norm_qk(qkv: &mut [f32], row_len: usize, w: &LayerWeights<'_>, threads: usize) {
    let (nh, nkv, hd) = (w.num_heads, w.num_kv_heads, w.head_dim);
    let (wq, wk) = match w.qk_norm {
        QkNorm::None => return,
        QkNorm::PerHead { q, k } | QkNorm::Full { q, k } => (q, k),
    };
    let mut tmp = vec![0f32; (nh + nkv) * hd];
    for row in qkv.chunks_exact_mut(row_len) {
        let (q, rest) = row.split_at_mut(nh * hd);
        let k = &mut rest[..nkv * hd];
        let (tq, tk) = tmp.split_at_mut(nh * hd);
        tq.copy_from_slice(q);
        tk.copy_from_slice(k);
        norm::rms_norm(tq, wq, w.eps, q, threads);
        norm::rms_norm(tk, wk, w.eps, k, threads);
    }
}

/// A mixture's feed-forward for `hidden` [batch, h] (normed), replaced by its output.
fn experts(
    hidden: &mut [f32],
    h: usize,
    w: &LayerWeights<'_>,
    m: MoeRouting<'_>,
    threads: usize,
    isa: Isa,
    expert_counts: &mut [&mut [i64]],
) -> Result<(), LayerError> {
    let batch = hidden.len() / h;
    let num_experts = m.router.len() / h;
    let mut logits = vec![0f32; batch * num_experts];
    moe::router_logits(hidden, m.router, h, &mut logits, threads).map_err(LayerError::Moe)?;
    let mut weights = vec![0f32; batch * m.top_k];
    let mut ids = vec![0i32; batch * m.top_k];
    moe_route::route(
        &logits,
        num_experts,
        m.top_k,
        m.renormalize,
        &mut weights,
        &mut ids,
    )
    .map_err(LayerError::Moe)?;
    for counts in expert_counts.iter_mut() {
        // (their lengths checked before any write)
        for &e in &ids {
            counts[e as usize] += 1;
        }
    }
    let shape = MoeShape {
        hidden: h,
        inter: w.down.k(),
        num_experts,
        expert_start: 0,
        total_experts: num_experts,
        top_k: m.top_k,
    };
    let x = hidden.to_vec();
    let weights_of = ExpertWeights::Quant {
        gate_up: w.gate_up,
        down: w.down,
    };
    moe::fused_experts(&x, &ids, &weights, weights_of, shape, hidden, threads, isa)
        .map_err(LayerError::Moe)
}
