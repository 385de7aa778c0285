//! pyo3 binding of `decoder_layer`: `QuantDecoderLayer`, a layer's weights held once, and its
//! `forward` for a decode step.

use numpy::{
    PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2,
    PyReadwriteArray3, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;

use crate::decode_attention::DecodeAttentionError;
use crate::decoder_layer::{decode_layer, DecodeStep, LayerError, LayerWeights};
use crate::python::{c_slice, c_slice_mut, check_disjoint, span};
use crate::python_quant::{quant_error, quant_matrix};
use crate::quant;

/// QuantDecoderLayer(input_norm, post_norm, eps, qkv, qkv_type, o, o_type, gate_up,
/// gate_up_type, down, down_type, num_heads, num_kv_heads, head_dim)
///
/// One Llama decoder layer on quantized projections (kernels/cpu/src/decoder_layer.rs): norms
/// [hidden] float32; each projection a [out_features, row_bytes] uint8 array of ggml type
/// `*_type` blocks (qkv: q, k, v rows stacked; gate_up: gate rows, then up rows). The arrays are
/// kept, not copied. Raises ValueError when they do not fit one another.
#[pyclass(frozen, module = "pyserve_kernels._cpu")]
pub struct QuantDecoderLayer {
    input_norm: Py<PyArray1<f32>>,
    post_norm: Py<PyArray1<f32>>,
    eps: f32,
    weights: [(Py<PyArray2<u8>>, u32); 4],
    heads: (usize, usize, usize),
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
        let w = LayerWeights {
            input_norm: c_slice("input_norm", &n1)?,
            post_norm: c_slice("post_norm", &n2)?,
            eps: self.eps,
            qkv: m(0)?,
            o: m(1)?,
            gate_up: m(2)?,
            down: m(3)?,
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
        LayerError::Slot(_) => PyIndexError::new_err(e.to_string()),
        _ => PyValueError::new_err(e.to_string()),
    }
}

#[pymethods]
impl QuantDecoderLayer {
    #[new]
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
    ) -> PyResult<Self> {
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
        };
        layer.with_weights(py, |w| w.check().map(|_| ()).map_err(layer_error))?;
        Ok(layer)
    }

    /// forward(hidden, residual, first, cos, sin, k_buffer, v_buffer, out_cache_loc, kv_indptr,
    /// kv_indices, scaling, sliding_window=None, num_threads=1)
    ///
    /// hidden, residual: [batch, hidden] float32, updated in place to (the layer's MLP output,
    /// the residual stream before it); first: the input is the embedding (residual is only
    /// written). cos, sin: [batch, head_dim]; k_buffer, v_buffer: this layer's pool
    /// [num_slots, num_kv_heads, head_dim], the new tokens' K and V written at out_cache_loc
    /// [batch] int32; kv_indptr, kv_indices: int32, as `decode_attention`. Raises ValueError
    /// (shapes, overlapping arrays) or IndexError (a slot outside the pool).
    #[pyo3(signature = (hidden, residual, first, cos, sin, k_buffer, v_buffer, out_cache_loc, kv_indptr, kv_indices, scaling, sliding_window=None, num_threads=1))]
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
        self.with_weights(py, |w| {
            check_disjoint(
                &[
                    ("hidden", span(hidden)),
                    ("residual", span(residual)),
                    ("k_buffer", span(kb)),
                    ("v_buffer", span(vb)),
                ],
                &[
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
                ],
            )?;
            py.detach(|| decode_layer(w, &step, hidden, residual, first, kb, vb))
                .map_err(layer_error)
        })
    }
}
