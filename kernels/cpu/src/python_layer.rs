//! pyo3 binding of `decoder_layer`: `QuantDecoderLayer`, a layer's weights held once, and its
//! `forward` for a decode step.

use numpy::{
    PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray1,
    PyReadwriteArray2, PyReadwriteArray3, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;

use crate::decode_attention::DecodeAttentionError;
use crate::decoder_layer::{
    decode_layer, DecodeStep, LayerError, LayerWeights, MoeRouting, QkNorm,
};
use crate::moe::MoeError;
use crate::python::{c_slice, c_slice_mut, check_disjoint, span};
use crate::python_quant::{quant_error, quant_matrix};
use crate::quant;

/// QuantDecoderLayer(input_norm, post_norm, eps, qkv, qkv_type, o, o_type, gate_up,
/// gate_up_type, down, down_type, num_heads, num_kv_heads, head_dim, q_norm=None, k_norm=None,
/// qk_norm_per_head=False, router=None, top_k=0, renormalize=False)
///
/// One Llama decoder layer on quantized projections (kernels/cpu/src/decoder_layer.rs): norms
/// [hidden] float32; each projection a [out_features, row_bytes] uint8 array of ggml type
/// `*_type` blocks (qkv: q, k, v rows stacked; gate_up: gate rows, then up rows). q_norm,
/// k_norm: float32 RMSNorm weights of q and k, [head_dim] each with qk_norm_per_head, else
/// [num_heads head_dim] and [num_kv_heads head_dim]. router: [E, hidden] float32 makes the
/// feed-forward a mixture of `top_k` of E experts, gate_up and down then stacked ([E 2I] and
/// [E hidden] rows). The arrays are kept, not copied. Raises ValueError when they do not fit
/// one another.
#[pyclass(frozen, module = "pyserve_kernels._cpu")]
pub struct QuantDecoderLayer {
    input_norm: Py<PyArray1<f32>>,
    post_norm: Py<PyArray1<f32>>,
    eps: f32,
    weights: [(Py<PyArray2<u8>>, u32); 4],
    heads: (usize, usize, usize),
    qk_norm: Option<(Py<PyArray1<f32>>, Py<PyArray1<f32>>, bool)>,
    router: Option<(Py<PyArray2<f32>>, usize, bool)>,
}

impl QuantDecoderLayer {
    /// Borrows the arrays and runs `f` on the layer's weights.
    fn with_weights<R>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&LayerWeights<'_>) -> PyResult<R>,
    ) -> PyResult<R> {
        let (n1, n2) = (
            self.input_norm.bind(py).readonly(),
            self.post_norm.bind(py).readonly(),
        );
        let arrays: Vec<PyReadonlyArray2<'_, u8>> = self
            .weights
            .iter()
            .map(|(a, _)| a.bind(py).readonly())
            .collect();
        let m = |i: usize| quant_matrix(&arrays[i], self.weights[i].1);
        let norms = self
            .qk_norm
            .as_ref()
            .map(|(q, k, per_head)| (q.bind(py).readonly(), k.bind(py).readonly(), *per_head));
        let qk_norm = match &norms {
            None => QkNorm::None,
            Some((q, k, true)) => QkNorm::PerHead {
                q: c_slice("q_norm", q)?,
                k: c_slice("k_norm", k)?,
            },
            Some((q, k, false)) => QkNorm::Full {
                q: c_slice("q_norm", q)?,
                k: c_slice("k_norm", k)?,
            },
        };
        let router = self
            .router
            .as_ref()
            .map(|(r, top_k, renorm)| (r.bind(py).readonly(), *top_k, *renorm));
        let moe = match &router {
            None => None,
            Some((r, top_k, renormalize)) => Some(MoeRouting {
                router: c_slice("router", r)?,
                top_k: *top_k,
                renormalize: *renormalize,
            }),
        };
        let w = LayerWeights {
            input_norm: c_slice("input_norm", &n1)?,
            post_norm: c_slice("post_norm", &n2)?,
            eps: self.eps,
            qkv: m(0)?,
            o: m(1)?,
            gate_up: m(2)?,
            down: m(3)?,
            qk_norm,
            moe,
            num_heads: self.heads.0,
            num_kv_heads: self.heads.1,
            head_dim: self.heads.2,
        };
        f(&w)
    }
}

fn layer_error(e: LayerError) -> PyErr {
    match e {
        LayerError::Quant(q) => quant_error(q),
        LayerError::Attention(DecodeAttentionError::Index(m)) => PyIndexError::new_err(m),
        LayerError::Slot(_) | LayerError::Moe(MoeError::ExpertId(_)) => {
            PyIndexError::new_err(e.to_string())
        }
        _ => PyValueError::new_err(e.to_string()),
    }
}

#[pymethods]
impl QuantDecoderLayer {
    #[new]
    #[pyo3(signature = (input_norm, post_norm, eps, qkv, qkv_type, o, o_type, gate_up, gate_up_type, down, down_type, num_heads, num_kv_heads, head_dim, q_norm=None, k_norm=None, qk_norm_per_head=false, router=None, top_k=0, renormalize=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        input_norm: Py<PyArray1<f32>>,
        post_norm: Py<PyArray1<f32>>,
        eps: f32,
        qkv: Py<PyArray2<u8>>,
        qkv_type: u32,
        o: Py<PyArray2<u8>>,
        o_type: u32,
        gate_up: Py<PyArray2<u8>>,
        gate_up_type: u32,
        down: Py<PyArray2<u8>>,
        down_type: u32,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        q_norm: Option<Py<PyArray1<f32>>>,
        k_norm: Option<Py<PyArray1<f32>>>,
        qk_norm_per_head: bool,
        router: Option<Py<PyArray2<f32>>>,
        top_k: usize,
        renormalize: bool,
    ) -> PyResult<Self> {
        let qk_norm = match (q_norm, k_norm) {
            (Some(q), Some(k)) => Some((q, k, qk_norm_per_head)),
            (None, None) => None,
            _ => return Err(PyValueError::new_err("q_norm and k_norm come together")),
        };
        let layer = QuantDecoderLayer {
            input_norm,
            post_norm,
            eps,
            weights: [
                (qkv, qkv_type),
                (o, o_type),
                (gate_up, gate_up_type),
                (down, down_type),
            ],
            heads: (num_heads, num_kv_heads, head_dim),
            qk_norm,
            router: router.map(|r| (r, top_k, renormalize)),
        };
        layer.with_weights(py, |w| w.check().map(|_| ()).map_err(layer_error))?;
        Ok(layer)
    }

    /// forward(hidden, residual, first, cos, sin, k_buffer, v_buffer, out_cache_loc, kv_indptr,
    /// kv_indices, scaling, sliding_window=None, num_threads=1, expert_counts=())
    ///
    /// hidden, residual: [batch, hidden] float32, updated in place to (the layer's MLP output,
    /// the residual stream before it); first: the input is the embedding (residual is only
    /// written). cos, sin: [batch, head_dim]; k_buffer, v_buffer: this layer's pool
    /// [num_slots, num_kv_heads, head_dim], the new tokens' K and V written at out_cache_loc
    /// [batch] int32; kv_indptr, kv_indices: int32, as `decode_attention`. expert_counts: a
    /// mixture's layer adds each token's routing to every one of these int64 [E] arrays.
    /// Raises ValueError (shapes, overlapping arrays) or IndexError (a slot outside the pool).
    #[pyo3(signature = (hidden, residual, first, cos, sin, k_buffer, v_buffer, out_cache_loc, kv_indptr, kv_indices, scaling, sliding_window=None, num_threads=1, expert_counts=Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        mut hidden: PyReadwriteArray2<'_, f32>,
        mut residual: PyReadwriteArray2<'_, f32>,
        first: bool,
        cos: PyReadonlyArray2<'_, f32>,
        sin: PyReadonlyArray2<'_, f32>,
        mut k_buffer: PyReadwriteArray3<'_, f32>,
        mut v_buffer: PyReadwriteArray3<'_, f32>,
        out_cache_loc: PyReadonlyArray1<'_, i32>,
        kv_indptr: PyReadonlyArray1<'_, i32>,
        kv_indices: PyReadonlyArray1<'_, i32>,
        scaling: f32,
        sliding_window: Option<usize>,
        num_threads: usize,
        mut expert_counts: Vec<PyReadwriteArray1<'_, i64>>,
    ) -> PyResult<()> {
        if k_buffer.shape()[1..] != [self.heads.1, self.heads.2]
            || v_buffer.shape() != k_buffer.shape()
        {
            return Err(PyValueError::new_err(format!(
                "k_buffer {:?} and v_buffer {:?} must be [num_slots, {}, {}]",
                k_buffer.shape(),
                v_buffer.shape(),
                self.heads.1,
                self.heads.2
            )));
        }
        let (cos, sin) = (c_slice("cos", &cos)?, c_slice("sin", &sin)?);
        let step = DecodeStep {
            cos,
            sin,
            out_cache_loc: c_slice("out_cache_loc", &out_cache_loc)?,
            kv_indptr: c_slice("kv_indptr", &kv_indptr)?,
            kv_indices: c_slice("kv_indices", &kv_indices)?,
            scaling,
            sliding_window,
            num_threads,
            isa: quant::best_isa(),
        };
        let hidden = c_slice_mut("hidden", &mut hidden)?;
        let residual = c_slice_mut("residual", &mut residual)?;
        let kb = c_slice_mut("k_buffer", &mut k_buffer)?;
        let vb = c_slice_mut("v_buffer", &mut v_buffer)?;
        let mut counts = expert_counts
            .iter_mut()
            .map(|c| c_slice_mut("expert_counts", c))
            .collect::<PyResult<Vec<_>>>()?;
        self.with_weights(py, |w| {
            let mut read = vec![
                ("cos", span(step.cos)),
                ("sin", span(step.sin)),
                ("input_norm", span(w.input_norm)),
                ("post_norm", span(w.post_norm)),
                ("out_cache_loc", span(step.out_cache_loc)),
                ("kv_indptr", span(step.kv_indptr)),
                ("kv_indices", span(step.kv_indices)),
                ("qkv", span(w.qkv.data)),
                ("o", span(w.o.data)),
                ("gate_up", span(w.gate_up.data)),
                ("down", span(w.down.data)),
            ];
            if let QkNorm::PerHead { q, k } | QkNorm::Full { q, k } = w.qk_norm {
                read.extend([("q_norm", span(q)), ("k_norm", span(k))]);
            }
            if let Some(m) = w.moe {
                read.push(("router", span(m.router)));
            }
            let mut written = vec![
                ("hidden", span(hidden)),
                ("residual", span(residual)),
                ("k_buffer", span(kb)),
                ("v_buffer", span(vb)),
            ];
            written.extend(counts.iter().map(|c| ("expert_counts", span(c))));
            check_disjoint(&written, &read)?;
            py.detach(|| decode_layer(w, &step, hidden, residual, first, kb, vb, &mut counts))
                .map_err(layer_error)
        })
    }
}
