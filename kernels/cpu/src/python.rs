//! pyo3 binding `pyserve_kernels._cpu`: numpy arrays in, results written into given arrays,
//! the GIL released while a kernel runs. Callers pass torch CPU tensors as `tensor.numpy()`
//! views (no copy); every array must be C-contiguous float32 (int64 / int32 for indices), and
//! an array a kernel writes must not overlap any other argument (torch views of one tensor
//! reach numpy as separate arrays, so numpy's own borrow tracking cannot see the overlap).
//! Shape, layout and overlap errors raise ValueError before anything is written.

use std::ops::Range;

use numpy::ndarray::{Axis, Dimension};
use numpy::{
    Element, PyReadonlyArray, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3,
    PyReadonlyArrayDyn, PyReadwriteArray, PyReadwriteArray2, PyReadwriteArray3,
    PyReadwriteArrayDyn, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;

use crate::decode_attention::{self as kernel, DecodeAttentionError, DecodeAttentionShape};
use crate::varlen_attention::{self as varlen, VarlenAttentionError};
use crate::{activation, norm, rotary, store_kv as kv_store};

fn not_c_contiguous(name: &str) -> PyErr {
    PyValueError::new_err(format!("{name} must be C-contiguous"))
}

/// The elements of a C-contiguous array (rust-numpy's `as_slice` also takes Fortran order,
/// which the kernels would misread).
pub(crate) fn c_slice<'a, T: Element, D: Dimension>(
    name: &str,
    a: &'a PyReadonlyArray<'_, T, D>,
) -> PyResult<&'a [T]> {
    if !a.is_c_contiguous() {
        return Err(not_c_contiguous(name));
    }
    a.as_slice().map_err(|_| not_c_contiguous(name))
}

pub(crate) fn c_slice_mut<'a, T: Element, D: Dimension>(
    name: &str,
    a: &'a mut PyReadwriteArray<'_, T, D>,
) -> PyResult<&'a mut [T]> {
    if !a.is_c_contiguous() {
        return Err(not_c_contiguous(name));
    }
    a.as_slice_mut().map_err(|_| not_c_contiguous(name))
}

/// Byte addresses a slice covers.
pub(crate) fn span<T>(s: &[T]) -> Range<usize> {
    let start = s.as_ptr() as usize;
    start..start + std::mem::size_of_val(s)
}

/// Byte addresses from the first to the last of several rows (the rows of a strided array).
pub(crate) fn rows_span<T>(rows: &[&[T]]) -> Range<usize> {
    let spans: Vec<Range<usize>> = rows
        .iter()
        .map(|r| span(r))
        .filter(|r| !r.is_empty())
        .collect();
    spans.iter().map(|r| r.start).min().unwrap_or(0)..spans.iter().map(|r| r.end).max().unwrap_or(0)
}

/// ValueError unless each written range is disjoint from every other argument's range.
pub(crate) fn check_disjoint(
    written: &[(&str, Range<usize>)],
    read: &[(&str, Range<usize>)],
) -> PyResult<()> {
    for (i, (w_name, w)) in written.iter().enumerate() {
        let others = written
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, x)| x)
            .chain(read);
        for (name, r) in others {
            if !w.is_empty() && !r.is_empty() && w.start < r.end && r.start < w.end {
                return Err(PyValueError::new_err(format!(
                    "{w_name} overlaps {name} in memory; pass separate tensors"
                )));
            }
        }
    }
    Ok(())
}

/// decode_attention(q, k_buffer, v_buffer, kv_indptr, kv_indices, out, scaling,
/// sliding_window=None, num_threads=1)
///
/// q, out: [batch, num_heads, head_dim] float32; k_buffer, v_buffer: [num_slots, num_kv_heads,
/// head_dim] float32; kv_indptr: [batch + 1] int32; kv_indices: int32 slots. Writes `out`.
/// Raises ValueError (shapes, dtypes, non-contiguous arrays) or IndexError (bad kv_indptr,
/// slot outside the pool); `out` is untouched then.
#[pyfunction]
#[pyo3(signature = (q, k_buffer, v_buffer, kv_indptr, kv_indices, out, scaling, sliding_window=None, num_threads=1))]
#[allow(clippy::too_many_arguments)]
fn decode_attention(
    py: Python<'_>,
    q: PyReadonlyArray3<'_, f32>,
    k_buffer: PyReadonlyArray3<'_, f32>,
    v_buffer: PyReadonlyArray3<'_, f32>,
    kv_indptr: PyReadonlyArray1<'_, i32>,
    kv_indices: PyReadonlyArray1<'_, i32>,
    mut out: PyReadwriteArray3<'_, f32>,
    scaling: f32,
    sliding_window: Option<usize>,
    num_threads: usize,
) -> PyResult<()> {
    let (qs, ks) = (q.shape(), k_buffer.shape());
    if out.shape() != qs || v_buffer.shape() != ks || qs[2] != ks[2] {
        return Err(PyValueError::new_err(format!(
            "shapes do not fit: q {qs:?}, out {:?}, k_buffer {ks:?}, v_buffer {:?}",
            out.shape(),
            v_buffer.shape()
        )));
    }
    let shape = DecodeAttentionShape {
        batch: qs[0],
        num_heads: qs[1],
        num_kv_heads: ks[1],
        head_dim: qs[2],
        num_slots: ks[0],
    };
    let q = c_slice("q", &q)?;
    let k = c_slice("k_buffer", &k_buffer)?;
    let v = c_slice("v_buffer", &v_buffer)?;
    let indptr = c_slice("kv_indptr", &kv_indptr)?;
    let indices = c_slice("kv_indices", &kv_indices)?;
    let out = c_slice_mut("out", &mut out)?;
    check_disjoint(
        &[("out", span(out))],
        &[
            ("q", span(q)),
            ("k_buffer", span(k)),
            ("v_buffer", span(v)),
            ("kv_indptr", span(indptr)),
            ("kv_indices", span(indices)),
        ],
    )?;
    py.detach(|| {
        kernel::decode_attention(
            q,
            k,
            v,
            indptr,
            indices,
            out,
            shape,
            scaling,
            sliding_window,
            num_threads,
        )
    })
    .map_err(|e| match e {
        DecodeAttentionError::Shape(m) => PyValueError::new_err(m),
        DecodeAttentionError::Index(m) => PyIndexError::new_err(m),
    })
}

/// varlen_attention(qkv, cu_seqlens, out, num_heads, scaling, num_threads=1)
///
/// qkv: [num_tokens, 3 * hidden] float32 (q | k | v); cu_seqlens: [batch + 1] int32;
/// out: [num_tokens, hidden] float32, hidden = num_heads * head_dim. Writes `out`:
/// bidirectional attention within each sequence. Raises TypeError (an array's dtype or number
/// of dimensions), ValueError (shapes, non-contiguous or overlapping arrays) or IndexError (bad
/// cu_seqlens); `out` is untouched then.
#[pyfunction]
#[pyo3(signature = (qkv, cu_seqlens, out, num_heads, scaling, num_threads=1))]
fn varlen_attention(
    py: Python<'_>,
    qkv: PyReadonlyArray2<'_, f32>,
    cu_seqlens: PyReadonlyArray1<'_, i32>,
    mut out: PyReadwriteArray2<'_, f32>,
    num_heads: usize,
    scaling: f32,
    num_threads: usize,
) -> PyResult<()> {
    let (qs, os) = (qkv.shape(), out.shape());
    if num_heads == 0 || qs[0] != os[0] || qs[1] != 3 * os[1] || !os[1].is_multiple_of(num_heads) {
        return Err(PyValueError::new_err(format!(
            "varlen_attention: qkv {qs:?} and out {os:?} do not fit {num_heads} heads"
        )));
    }
    let head_dim = os[1] / num_heads;
    let qkv = c_slice("qkv", &qkv)?;
    let cu = c_slice("cu_seqlens", &cu_seqlens)?;
    let out = c_slice_mut("out", &mut out)?;
    check_disjoint(
        &[("out", span(out))],
        &[("qkv", span(qkv)), ("cu_seqlens", span(cu))],
    )?;
    py.detach(|| varlen::varlen_attention(qkv, cu, out, num_heads, head_dim, scaling, num_threads))
        .map_err(|e| match e {
            VarlenAttentionError::Shape(m) => PyValueError::new_err(m),
            VarlenAttentionError::Index(m) => PyIndexError::new_err(m),
        })
}

fn last_dim(name: &str, shape: &[usize]) -> PyResult<usize> {
    match shape.last() {
        Some(&d) if d > 0 => Ok(d),
        _ => Err(PyValueError::new_err(format!(
            "{name} must have a non-empty last dimension, got shape {shape:?}"
        ))),
    }
}

/// rms_norm(x, weight, eps, out, num_threads=1): out = x / sqrt(mean(x^2, -1) + eps) * weight.
/// x, out: [..., hidden]; weight: [hidden].
#[pyfunction]
#[pyo3(signature = (x, weight, eps, out, num_threads=1))]
fn rms_norm(
    py: Python<'_>,
    x: PyReadonlyArrayDyn<'_, f32>,
    weight: PyReadonlyArray1<'_, f32>,
    eps: f32,
    mut out: PyReadwriteArrayDyn<'_, f32>,
    num_threads: usize,
) -> PyResult<()> {
    if x.shape() != out.shape() || last_dim("x", x.shape())? != weight.len() {
        return Err(PyValueError::new_err(format!(
            "rms_norm: x {:?}, out {:?} and weight {:?} do not fit",
            x.shape(),
            out.shape(),
            weight.shape()
        )));
    }
    let (x, w) = (c_slice("x", &x)?, c_slice("weight", &weight)?);
    let out = c_slice_mut("out", &mut out)?;
    check_disjoint(
        &[("out", span(out))],
        &[("x", span(x)), ("weight", span(w))],
    )?;
    py.detach(|| norm::rms_norm(x, w, eps, out, num_threads));
    Ok(())
}

/// fused_add_rms_norm(x, residual, weight, eps, num_threads=1): residual += x, then
/// x = rms_norm(residual), both in place. x, residual: [..., hidden]; weight: [hidden].
#[pyfunction]
#[pyo3(signature = (x, residual, weight, eps, num_threads=1))]
fn fused_add_rms_norm(
    py: Python<'_>,
    mut x: PyReadwriteArrayDyn<'_, f32>,
    mut residual: PyReadwriteArrayDyn<'_, f32>,
    weight: PyReadonlyArray1<'_, f32>,
    eps: f32,
    num_threads: usize,
) -> PyResult<()> {
    if x.shape() != residual.shape() || last_dim("x", x.shape())? != weight.len() {
        return Err(PyValueError::new_err(format!(
            "fused_add_rms_norm: x {:?}, residual {:?} and weight {:?} do not fit",
            x.shape(),
            residual.shape(),
            weight.shape()
        )));
    }
    let w = c_slice("weight", &weight)?;
    let x = c_slice_mut("x", &mut x)?;
    let r = c_slice_mut("residual", &mut residual)?;
    check_disjoint(
        &[("x", span(x)), ("residual", span(r))],
        &[("weight", span(w))],
    )?;
    py.detach(|| norm::fused_add_rms_norm(x, r, w, eps, num_threads));
    Ok(())
}

/// rotary_embedding(x, cos, sin, num_heads, head_dim, num_threads=1): rotates in place the
/// first num_heads heads of each row of x [num_tokens, row_len] (rotate-half layout).
/// cos, sin: [num_tokens, head_dim].
#[pyfunction]
#[pyo3(signature = (x, cos, sin, num_heads, head_dim, num_threads=1))]
fn rotary_embedding(
    py: Python<'_>,
    mut x: PyReadwriteArrayDyn<'_, f32>,
    cos: PyReadonlyArrayDyn<'_, f32>,
    sin: PyReadonlyArrayDyn<'_, f32>,
    num_heads: usize,
    head_dim: usize,
    num_threads: usize,
) -> PyResult<()> {
    let xs = x.shape().to_vec();
    let rotated = num_heads.checked_mul(head_dim).unwrap_or(usize::MAX);
    if xs.len() != 2
        || head_dim == 0
        || head_dim % 2 != 0
        || xs[1] < rotated
        || cos.shape() != [xs[0], head_dim]
        || sin.shape() != cos.shape()
    {
        return Err(PyValueError::new_err(format!(
            "rotary_embedding: x {xs:?} (needs [num_tokens, >= {num_heads} x {head_dim}], even head_dim), cos {:?}, sin {:?} (need [num_tokens, head_dim])",
            cos.shape(), sin.shape())));
    }
    let (c, s) = (c_slice("cos", &cos)?, c_slice("sin", &sin)?);
    let x = c_slice_mut("x", &mut x)?;
    check_disjoint(&[("x", span(x))], &[("cos", span(c)), ("sin", span(s))])?;
    if xs[0] == 0 || num_heads == 0 {
        return Ok(());
    }
    py.detach(|| rotary::rotary_embedding(x, xs[1], num_heads, head_dim, c, s, num_threads));
    Ok(())
}

/// silu_and_mul(x, out, num_threads=1): out = silu(x[..., :d]) * x[..., d:], x [..., 2 d],
/// out [..., d].
#[pyfunction]
#[pyo3(signature = (x, out, num_threads=1))]
fn silu_and_mul(
    py: Python<'_>,
    x: PyReadonlyArrayDyn<'_, f32>,
    mut out: PyReadwriteArrayDyn<'_, f32>,
    num_threads: usize,
) -> PyResult<()> {
    let (xs, os) = (x.shape().to_vec(), out.shape().to_vec());
    let d = last_dim("out", &os)?;
    if xs.len() != os.len() || xs[..xs.len() - 1] != os[..os.len() - 1] || xs[xs.len() - 1] != 2 * d
    {
        return Err(PyValueError::new_err(format!(
            "silu_and_mul: x {xs:?} must be out {os:?} with a last dim twice as long"
        )));
    }
    let x = c_slice("x", &x)?;
    let out = c_slice_mut("out", &mut out)?;
    check_disjoint(&[("out", span(out))], &[("x", span(x))])?;
    py.detach(|| activation::silu_and_mul(x, out, d, num_threads));
    Ok(())
}

/// _use_openmp(parallel) -> bool: run parallel kernels on the calling thread's OpenMP team
/// through libgomp's `GOMP_parallel` (its address, in the libgomp torch uses). Called once by
/// `pyserve_kernels._native` at import. Returns False if already set.
///
/// Private: a wrong address crashes the process.
#[pyfunction]
fn _use_openmp(parallel: usize) -> PyResult<bool> {
    if parallel == 0 {
        return Err(PyValueError::new_err("null libgomp entry point"));
    }
    // SAFETY: the caller passes the libgomp function named above (private API).
    Ok(unsafe { crate::parallel::use_openmp(parallel) })
}

/// _uses_openmp() -> bool: whether parallel kernels run on the OpenMP team.
#[pyfunction]
fn _uses_openmp() -> bool {
    crate::parallel::uses_openmp()
}

/// store_kv(k_buffer, v_buffer, loc, k, v): k_buffer[loc[t]] = k[t], v_buffer[loc[t]] = v[t].
/// k_buffer, v_buffer: [num_slots, num_kv_heads, head_dim] C-contiguous; loc: [T] int32;
/// k, v: [T, num_kv_heads, head_dim] whose rows may be strided (views of a fused q|k|v
/// projection) but each row contiguous. Raises ValueError (shapes, layouts) or IndexError (a
/// slot outside the pool; nothing written then).
#[pyfunction]
fn store_kv(
    py: Python<'_>,
    mut k_buffer: PyReadwriteArray3<'_, f32>,
    mut v_buffer: PyReadwriteArray3<'_, f32>,
    loc: PyReadonlyArray1<'_, i32>,
    k: PyReadonlyArray3<'_, f32>,
    v: PyReadonlyArray3<'_, f32>,
) -> PyResult<()> {
    let bs = k_buffer.shape().to_vec();
    let (kv, vv) = (k.as_array(), v.as_array());
    if v_buffer.shape() != bs.as_slice()
        || kv.shape() != vv.shape()
        || kv.shape()[1..] != bs[1..]
        || kv.shape()[0] != loc.len()
    {
        return Err(PyValueError::new_err(format!(
            "store_kv: buffers {bs:?}, k {:?}, v {:?}, loc [{}] do not fit",
            kv.shape(),
            vv.shape(),
            loc.len()
        )));
    }
    let row_len = bs[1] * bs[2];
    let k_rows: Vec<&[f32]> = kv
        .axis_iter(Axis(0))
        .map(|r| r.to_slice())
        .collect::<Option<_>>()
        .ok_or_else(|| PyValueError::new_err("store_kv: each row of k must be contiguous"))?;
    let v_rows: Vec<&[f32]> = vv
        .axis_iter(Axis(0))
        .map(|r| r.to_slice())
        .collect::<Option<_>>()
        .ok_or_else(|| PyValueError::new_err("store_kv: each row of v must be contiguous"))?;
    let loc = c_slice("loc", &loc)?;
    let kb = c_slice_mut("k_buffer", &mut k_buffer)?;
    let vb = c_slice_mut("v_buffer", &mut v_buffer)?;
    check_disjoint(
        &[("k_buffer", span(kb)), ("v_buffer", span(vb))],
        &[
            ("loc", span(loc)),
            ("k", rows_span(&k_rows)),
            ("v", rows_span(&v_rows)),
        ],
    )?;
    let slot_error = |slot: i32| {
        PyIndexError::new_err(format!(
            "store_kv: slot {slot} is outside the pool of {} slots",
            bs[0]
        ))
    };
    if row_len == 0 {
        return match loc.iter().find(|&&s| s < 0 || s as u64 >= bs[0] as u64) {
            Some(&bad) => Err(slot_error(bad)),
            None => Ok(()),
        };
    }
    py.detach(|| kv_store::store_kv(kb, vb, row_len, loc, |t| k_rows[t], |t| v_rows[t]))
        .map_err(slot_error)
}

#[pymodule]
fn _cpu(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_use_openmp, m)?)?;
    m.add_function(wrap_pyfunction!(_uses_openmp, m)?)?;
    m.add_function(wrap_pyfunction!(decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(varlen_attention, m)?)?;
    m.add_function(wrap_pyfunction!(store_kv, m)?)?;
    m.add_function(wrap_pyfunction!(rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(fused_add_rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(rotary_embedding, m)?)?;
    m.add_function(wrap_pyfunction!(silu_and_mul, m)?)?;
    crate::python_logits::register(m)?;
    crate::python_moe::register(m)?;
    crate::python_quant::register(m)?;
    m.add_class::<crate::python_layer::QuantDecoderLayer>()?;
    Ok(())
}
