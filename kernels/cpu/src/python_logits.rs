//! pyo3 bindings of the kernels that work on a step's logits: the grammar token mask
//! (`token_bitmask`) and the greedy pick with each row's max (`argmax`). The conventions are
//! `python`'s: numpy arrays in, results written into given arrays, the GIL released.

use numpy::ndarray::Axis;
use numpy::{
    PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray1, PyReadwriteArray2, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::python::{c_slice, c_slice_mut, check_disjoint, rows_span, span};
use crate::{argmax, token_bitmask};

/// apply_token_bitmask(logits, bitmask, rows, num_threads=1, simd=True) -> str: for each k,
/// logits row rows[k] gets -inf at every token whose bit in bitmask row k is 0 (xgrammar's
/// layout: bit j of word w is token 32 w + j, least significant bit first), in place.
/// logits: [batch, vocab] float32 whose rows are contiguous (a row stride is fine); bitmask:
/// [len(rows), ceil(vocab / 32)] int32 C-contiguous; rows: [K] int32, distinct, in 0..batch.
/// `simd=False` forces the portable loop (tests). Returns the path that ran ("avx2" or
/// "scalar"). Raises ValueError (shapes, layouts, a row out of range or repeated; nothing
/// written then).
#[pyfunction]
#[pyo3(signature = (logits, bitmask, rows, num_threads=1, simd=true))]
fn apply_token_bitmask(
    py: Python<'_>,
    mut logits: PyReadwriteArray2<'_, f32>,
    bitmask: PyReadonlyArray2<'_, i32>,
    rows: PyReadonlyArray1<'_, i32>,
    num_threads: usize,
    simd: bool,
) -> PyResult<&'static str> {
    let (ls, bs) = (logits.shape().to_vec(), bitmask.shape().to_vec());
    let words = ls[1].div_ceil(token_bitmask::BITS_PER_WORD);
    if bs != [rows.len(), words] {
        return Err(PyValueError::new_err(format!(
            "apply_token_bitmask_: logits {ls:?}, bitmask {bs:?}, rows [{}] do not fit (bitmask must be [len(rows), ceil(vocab / 32)])",
            rows.len()
        )));
    }
    let mask = c_slice("bitmask", &bitmask)?;
    let row_ids = c_slice("rows", &rows)?;
    let mut view = logits.as_array_mut();
    let row_stride = view.strides()[0].unsigned_abs();
    let logits_rows: Vec<&mut [f32]> = view
        .axis_iter_mut(Axis(0))
        .map(|r| r.into_slice())
        .collect::<Option<_>>()
        .ok_or_else(|| {
            PyValueError::new_err("apply_token_bitmask_: each row of logits must be contiguous")
        })?;
    // Rows sharing memory (a broadcast view) would be written by several threads at once.
    if ls[0] > 1 && ls[1] > 0 && row_stride < ls[1] {
        return Err(PyValueError::new_err(
            "apply_token_bitmask_: rows of logits overlap in memory",
        ));
    }
    let read_only: Vec<&[f32]> = logits_rows.iter().map(|r| &**r).collect();
    check_disjoint(
        &[("logits", rows_span(&read_only))],
        &[("bitmask", span(mask)), ("rows", span(row_ids))],
    )?;
    py.detach(|| {
        token_bitmask::apply_token_bitmask(logits_rows, ls[1], mask, row_ids, simd, num_threads)
    })
    .map(token_bitmask::MaskPath::name)
    .map_err(|e| PyValueError::new_err(e.0))
}

/// row_argmax(logits, ids, maxes, num_threads=1): for each row r of logits [B, vocab] float32,
/// ids[r] ([B] int64) = the index of its largest value (ties: the lowest, +0 and -0 tying; a
/// row holding a NaN: its first NaN) and maxes[r] ([B] float32) = logits[r, ids[r]].
/// Raises ValueError (shapes, layouts, outputs overlapping other arguments' memory as torch
/// views of one tensor do; nothing written then); numpy's own borrow check raises TypeError
/// for numpy arrays that share memory.
#[pyfunction]
#[pyo3(signature = (logits, ids, maxes, num_threads=1))]
fn row_argmax(
    py: Python<'_>,
    logits: PyReadonlyArray2<'_, f32>,
    mut ids: PyReadwriteArray1<'_, i64>,
    mut maxes: PyReadwriteArray1<'_, f32>,
    num_threads: usize,
) -> PyResult<()> {
    let vocab = logits.shape()[1];
    let x = c_slice("logits", &logits)?;
    let ids = c_slice_mut("ids", &mut ids)?;
    let maxes = c_slice_mut("maxes", &mut maxes)?;
    check_disjoint(
        &[("ids", span(ids)), ("maxes", span(maxes))],
        &[("logits", span(x))],
    )?;
    py.detach(|| argmax::row_argmax(x, vocab, ids, maxes, num_threads))
        .map_err(|e| PyValueError::new_err(e.0))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(apply_token_bitmask, m)?)?;
    m.add_function(wrap_pyfunction!(row_argmax, m)?)?;
    Ok(())
}
