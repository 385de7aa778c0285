//! pyo3 bindings of the GGUF-quantized kernels (`quant`): products, row dequantization, the
//! instruction sets and the interleaved Q4_0 layout. The conventions are `python`'s (numpy
//! arrays in, results written into given arrays, the GIL released while a kernel runs);
//! `quant_matrix` is how every binding that takes quantized weights reads them.

use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;

use crate::python::{c_slice, c_slice_mut, check_disjoint, span};
use crate::quant::{self, Isa, QuantError, QuantMatrix, QuantType};

pub(crate) fn quant_error(e: QuantError) -> PyErr {
    match e {
        QuantError::RowIndex { .. } => PyIndexError::new_err(e.to_string()),
        _ => PyValueError::new_err(e.to_string()),
    }
}

/// Added to a ggml type id: the blocks are in `quant::interleave`'s layout.
pub(crate) const INTERLEAVED: u32 = 0x100;

/// A [rows, row_bytes] uint8 array of `qtype` (a ggml type id, plus INTERLEAVED for Q4_0 rows
/// interleaved eight at a time) blocks as a QuantMatrix.
pub(crate) fn quant_matrix<'a>(
    weight: &'a PyReadonlyArray2<'_, u8>,
    qtype: u32,
) -> PyResult<QuantMatrix<'a>> {
    let id = qtype & !INTERLEAVED;
    let qt = QuantType::from_ggml(id)
        .ok_or_else(|| PyValueError::new_err(format!("ggml type {id} has no quantized kernel")))?;
    let (data, row_bytes) = (c_slice("weight", weight)?, weight.shape()[1]);
    if qtype & INTERLEAVED != 0 {
        QuantMatrix::new_interleaved(qt, data, row_bytes).map_err(quant_error)
    } else {
        QuantMatrix::new(qt, data, row_bytes).map_err(quant_error)
    }
}

/// quant_interleave(weight, qtype) -> array: a Q4_0 weight ([rows, row_bytes] uint8, rows a
/// multiple of 8) in the interleaved layout of kernels/cpu/src/quant/interleave.rs (a new array
/// of the same shape; pass its type id plus 0x100 to the kernels). Raises ValueError for another
/// type or a row count that is not a multiple of 8.
#[pyfunction]
fn quant_interleave<'py>(
    py: Python<'py>,
    weight: PyReadonlyArray2<'py, u8>,
    qtype: u32,
) -> PyResult<Bound<'py, numpy::PyArray2<u8>>> {
    let w = quant_matrix(&weight, qtype)?;
    if w.interleaved || w.qtype != QuantType::Q4_0 {
        return Err(quant_error(QuantError::Interleaved(w.qtype)));
    }
    let (rows, row_bytes) = (w.rows(), w.row_bytes);
    let packed = py
        .detach(|| quant::interleave::interleave_q4_0(w.data, row_bytes))
        .map_err(quant_error)?;
    use numpy::PyArrayMethods;
    numpy::PyArray1::from_vec(py, packed).reshape([rows, row_bytes])
}

pub(crate) fn quant_isa(isa: Option<&str>) -> PyResult<Isa> {
    match isa {
        None => Ok(quant::best_isa()),
        Some(name) => Isa::from_name(name)
            .ok_or_else(|| PyValueError::new_err(format!("unknown instruction set {name:?}"))),
    }
}

/// quant_matmul(x, weight, qtype, out, num_threads=1, isa=None): out = x @ dequant(weight).T
/// with activations quantized per 32 to int8 (kernels/cpu/src/quant). x: [m, k] float32;
/// weight: [n, row_bytes] uint8, whole blocks of ggml type `qtype`; out: [m, n] float32.
/// isa: "scalar", "avx2" or "avx512vnni" (None: the best this CPU has; every path gives the
/// same bits).
#[pyfunction]
#[pyo3(signature = (x, weight, qtype, out, num_threads=1, isa=None))]
fn quant_matmul(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    weight: PyReadonlyArray2<'_, u8>,
    qtype: u32,
    mut out: PyReadwriteArray2<'_, f32>,
    num_threads: usize,
    isa: Option<&str>,
) -> PyResult<()> {
    let w = quant_matrix(&weight, qtype)?;
    let isa = quant_isa(isa)?;
    if x.shape()[1] != w.k() || out.shape() != [x.shape()[0], w.rows()] {
        return Err(PyValueError::new_err(format!(
            "quant_matmul: x {:?}, weight of {} rows x {} and out {:?} do not fit",
            x.shape(),
            w.rows(),
            w.k(),
            out.shape()
        )));
    }
    let x = c_slice("x", &x)?;
    let out = c_slice_mut("out", &mut out)?;
    check_disjoint(
        &[("out", span(out))],
        &[("x", span(x)), ("weight", span(w.data))],
    )?;
    py.detach(|| quant::matmul(x, w, out, num_threads, isa))
        .map_err(quant_error)
}

/// quant_dequantize_rows(weight, qtype, rows, out): out[i] = the float32 weights of row
/// rows[i] (exactly as ggml dequantizes them). rows: [t] int64; out: [t, k] float32.
/// Raises IndexError for a row outside the weight.
#[pyfunction]
fn quant_dequantize_rows(
    py: Python<'_>,
    weight: PyReadonlyArray2<'_, u8>,
    qtype: u32,
    rows: PyReadonlyArray1<'_, i64>,
    mut out: PyReadwriteArray2<'_, f32>,
) -> PyResult<()> {
    let w = quant_matrix(&weight, qtype)?;
    if out.shape() != [rows.len(), w.k()] {
        return Err(PyValueError::new_err(format!(
            "quant_dequantize_rows: {} rows of {} weights do not fit out {:?}",
            rows.len(),
            w.k(),
            out.shape()
        )));
    }
    let rows = c_slice("rows", &rows)?;
    let out = c_slice_mut("out", &mut out)?;
    check_disjoint(
        &[("out", span(out))],
        &[("weight", span(w.data)), ("rows", span(rows))],
    )?;
    py.detach(|| quant::dequantize_rows(w, rows, out))
        .map_err(quant_error)
}

/// The instruction sets quant_matmul can use on this CPU, the best last.
#[pyfunction]
fn quant_isas() -> Vec<&'static str> {
    quant::available_isas()
        .iter()
        .map(|isa| isa.name())
        .collect()
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quant_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(quant_dequantize_rows, m)?)?;
    m.add_function(wrap_pyfunction!(quant_isas, m)?)?;
    m.add_function(wrap_pyfunction!(quant_interleave, m)?)?;
    Ok(())
}
