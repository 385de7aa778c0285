//! Module functions `prepare_extend` / `prepare_decode`: one call per forward batch.

use numpy::PyArray1;
use pyo3::prelude::*;
use pyserve_core as rs;

use crate::convert::{to_array, usize_vec};
use crate::errors::IntoPyResult;
use crate::pools::{ReqToTokenPool, TokenToKVPoolAllocator};

/// `(out_cache_loc, positions, kv_indptr, kv_indices)`, all 1-D int64 numpy arrays.
type Arrays<'py> = (
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
);

fn to_arrays(py: Python<'_>, a: rs::BatchArrays) -> Arrays<'_> {
    (
        to_array(py, a.out_cache_loc),
        to_array(py, a.positions),
        to_array(py, a.kv_indptr),
        to_array(py, a.kv_indices),
    )
}

/// Allocates the KV slots of an extend batch and returns its flat arrays, or None if the
/// allocator has too few free slots (nothing changed).
#[pyfunction]
pub fn prepare_extend<'py>(
    py: Python<'py>,
    req_to_token_pool: &Bound<'py, ReqToTokenPool>,
    allocator: &Bound<'py, TokenToKVPoolAllocator>,
    req_pool_indices: &Bound<'py, PyAny>,
    prefix_lens: &Bound<'py, PyAny>,
    extend_lens: &Bound<'py, PyAny>,
) -> PyResult<Option<Arrays<'py>>> {
    let rows = usize_vec(req_pool_indices)?;
    let prefix = usize_vec(prefix_lens)?;
    let extend = usize_vec(extend_lens)?;
    let mut pool = req_to_token_pool.try_borrow_mut()?;
    let mut alloc = allocator.try_borrow_mut()?;
    let (p, a) = (&mut pool.inner, &mut alloc.inner);
    let out = py
        .detach(move || rs::prepare_extend(p, a, &rows, &prefix, &extend))
        .py()?;
    Ok(out.map(|arrays| to_arrays(py, arrays)))
}

/// Allocates one KV slot per request of a decode batch and returns its flat arrays, or None
/// if the allocator has too few free slots (nothing changed).
#[pyfunction]
pub fn prepare_decode<'py>(
    py: Python<'py>,
    req_to_token_pool: &Bound<'py, ReqToTokenPool>,
    allocator: &Bound<'py, TokenToKVPoolAllocator>,
    req_pool_indices: &Bound<'py, PyAny>,
    seq_lens: &Bound<'py, PyAny>,
) -> PyResult<Option<Arrays<'py>>> {
    let rows = usize_vec(req_pool_indices)?;
    let seq = usize_vec(seq_lens)?;
    let mut pool = req_to_token_pool.try_borrow_mut()?;
    let mut alloc = allocator.try_borrow_mut()?;
    let (p, a) = (&mut pool.inner, &mut alloc.inner);
    let out = py
        .detach(move || rs::prepare_decode(p, a, &rows, &seq))
        .py()?;
    Ok(out.map(|arrays| to_arrays(py, arrays)))
}
