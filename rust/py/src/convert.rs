//! Conversion of Python inputs (numpy arrays, lists, tuples, anything `numpy.asarray`
//! accepts with an integer dtype) into Rust vectors, and of Rust vectors into numpy arrays.
//!
//! The per-batch calls' inputs (request ids and lengths, any integer dtype) are copied into
//! owned vectors, O(batch). The token ids of one request are read in place by
//! [`with_tokens`], O(tokens) saved per call. Every call holds the GIL while it reads.
//! Outputs are handed to numpy without a copy.

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1};
use pyo3::prelude::*;

use crate::errors::ShapeError;

/// Reads a 1-D integer sequence as `i64`.
///
/// Raises `ShapeError` for non-integer or non-1-D input (floats are refused rather than
/// truncated).
pub fn i64_vec(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return Ok(a.as_array().to_vec());
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        return Ok(a.as_array().iter().map(|&x| i64::from(x)).collect());
    }
    if let Ok(v) = obj.extract::<Vec<i64>>() {
        return Ok(v);
    }
    let np = obj.py().import("numpy")?;
    let arr = np.call_method1("asarray", (obj,))?;
    let kind: String = arr.getattr("dtype")?.getattr("kind")?.extract()?;
    let ndim: usize = arr.getattr("ndim")?.extract()?;
    if !matches!(kind.as_str(), "i" | "u") || ndim != 1 {
        return Err(ShapeError::new_err(format!(
            "expected a 1-D sequence of integers, got {} with dtype kind '{kind}' and ndim {ndim}",
            obj.get_type().name()?
        )));
    }
    if kind == "u" && arr.getattr("size")?.extract::<usize>()? > 0 {
        let max: u64 = arr.call_method0("max")?.extract()?;
        if max > i64::MAX as u64 {
            return Err(ShapeError::new_err(format!(
                "integer {max} does not fit in int64"
            )));
        }
    }
    let arr = arr.call_method1("astype", ("int64",))?;
    let a = arr.extract::<PyReadonlyArray1<'_, i64>>()?;
    Ok(a.as_array().to_vec())
}

/// Reads a 1-D integer sequence of token ids as `i32`; `ShapeError` if one does not fit.
pub fn i32_vec(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i32>> {
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        return Ok(a.as_array().to_vec());
    }
    i64_vec(obj)?
        .into_iter()
        .map(|x| {
            i32::try_from(x).map_err(|_| ShapeError::new_err(format!("token id {x} overflows i32")))
        })
        .collect()
}

/// Reads a 1-D integer sequence of indices or lengths; `ShapeError` on a negative entry.
pub fn usize_vec(obj: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    i64_vec(obj)?
        .into_iter()
        .map(|x| {
            usize::try_from(x)
                .map_err(|_| ShapeError::new_err(format!("negative index or length {x}")))
        })
        .collect()
}

/// Hands `v` to numpy as a 1-D int64 array without copying its elements.
pub fn to_array(py: Python<'_>, v: Vec<i64>) -> Bound<'_, PyArray1<i64>> {
    PyArray1::from_vec(py, v)
}

/// Reads a 1-D integer sequence of request ids; `ShapeError` on a negative entry.
pub fn u64_vec(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    i64_vec(obj)?
        .into_iter()
        .map(|x| {
            u64::try_from(x).map_err(|_| ShapeError::new_err(format!("negative request id {x}")))
        })
        .collect()
}

/// Runs `f` on `obj` read as token ids, holding the GIL throughout. A C-contiguous 1-D int32
/// numpy array is read in place, without a copy; anything else is converted by [`i32_vec`]
/// (and its errors are returned).
///
/// For the calls on one request's tokens (match, admit, finish), which take microseconds:
/// reading in place saves a copy of every token, and not releasing the GIL saves a handoff
/// that would cost about as much as the call.
pub fn with_tokens<R>(obj: &Bound<'_, PyAny>, f: impl FnOnce(&[i32]) -> R) -> PyResult<R> {
    if let Ok(a) = obj.cast::<PyArray1<i32>>() {
        // SAFETY: the slice lives only while `f` runs, with the GIL held and without calling
        // into Python, so no Python code can write to the array meanwhile, and this crate never
        // borrows a numpy array mutably. What the GIL cannot exclude is native code in another
        // thread writing the same memory with the GIL released (a numpy or torch operation on
        // a shared buffer); the copying path has the same exposure while it copies. Callers
        // pass arrays no other thread writes: pyserve passes fresh `np.asarray` results.
        if let Ok(tokens) = unsafe { a.as_slice() } {
            return Ok(f(tokens));
        }
    }
    let tokens = i32_vec(obj)?;
    Ok(f(&tokens))
}
