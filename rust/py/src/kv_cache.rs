//! Python classes `KVCache` and `BatchArrays`: thin wrappers over `pyserve_core::KVCache`.
//!
//! Every call but `check_integrity` comes from the event loop thread and keeps the GIL: the
//! per-batch calls (`prepare_extend`, `prepare_decode`), `free_req` and `evict` take tens of
//! microseconds, while giving the GIL up on the loop lets another Python thread (the
//! tokenizer's, the worker) take it, and the loop then waits for it to be handed back: up to
//! the interpreter's switch interval (5 ms) per call, measured at ~30 us -> ~4.6 ms for a
//! 256-request `prepare_decode` beside one busy Python thread. The per-batch calls copy their
//! inputs, then hand the output vectors to numpy without copying their elements. The calls
//! on one request's token ids (`match_prefix`, `add_req`, `cache_unfinished_req`,
//! `cache_finished_req`) read an int32 array in place (see `convert::with_tokens`).
//! `check_integrity` (tests and debugging; O(pool)) releases the GIL.

use numpy::PyArray1;
use pyo3::prelude::*;
use pyserve_core as rs;

use crate::convert::{to_array, u64_vec, usize_vec, with_tokens};
use crate::errors::IntoPyResult;

/// All arrays of one forward batch (1-D int32 numpy arrays; see `rs::BatchArrays`).
#[pyclass(module = "pyserve._rs", name = "BatchArrays", frozen)]
pub struct BatchArrays {
    #[pyo3(get)]
    req_pool_indices: Py<PyArray1<i32>>,
    #[pyo3(get)]
    prefix_lens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    extend_lens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    seq_lens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    out_cache_loc: Py<PyArray1<i32>>,
    #[pyo3(get)]
    positions: Py<PyArray1<i32>>,
    #[pyo3(get)]
    kv_indptr: Py<PyArray1<i32>>,
    #[pyo3(get)]
    kv_indices: Py<PyArray1<i32>>,
}

impl BatchArrays {
    fn new(py: Python<'_>, a: rs::BatchArrays) -> Self {
        let arr = |v: Vec<i32>| PyArray1::from_vec(py, v).unbind();
        Self {
            req_pool_indices: arr(a.req_pool_indices),
            prefix_lens: arr(a.prefix_lens),
            extend_lens: arr(a.extend_lens),
            seq_lens: arr(a.seq_lens),
            out_cache_loc: arr(a.out_cache_loc),
            positions: arr(a.positions),
            kv_indptr: arr(a.kv_indptr),
            kv_indices: arr(a.kv_indices),
        }
    }
}

#[pymethods]
impl BatchArrays {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "BatchArrays(batch_size={})",
            self.req_pool_indices.bind(py).len().unwrap_or(0)
        )
    }
}

/// KV pages, request rows, radix cache and admitted requests (see `rs::KVCache`).
#[pyclass(module = "pyserve._rs", name = "KVCache")]
pub struct KVCache {
    inner: rs::KVCache,
}

#[pymethods]
impl KVCache {
    #[new]
    #[pyo3(signature = (max_total_tokens, num_rows, max_context_len, page_size = 1, disable_radix_cache = false))]
    fn new(
        max_total_tokens: usize,
        num_rows: usize,
        max_context_len: usize,
        page_size: usize,
        disable_radix_cache: bool,
    ) -> PyResult<Self> {
        let inner = rs::KVCache::new(
            max_total_tokens,
            page_size,
            num_rows,
            max_context_len,
            disable_radix_cache,
        )
        .py()?;
        Ok(Self { inner })
    }

    #[getter]
    fn page_size(&self) -> usize {
        self.inner.page_size()
    }

    #[getter]
    fn max_total_tokens(&self) -> usize {
        self.inner.alloc.size()
    }

    #[getter]
    fn num_slot_rows(&self) -> usize {
        self.inner.alloc.num_slot_rows()
    }

    #[getter]
    fn disable_radix_cache(&self) -> bool {
        self.inner.tree.disabled()
    }

    fn free_size(&self) -> usize {
        self.inner.alloc.available_size()
    }

    fn available_size(&self) -> usize {
        self.inner.available_size()
    }

    fn evictable_size(&self) -> usize {
        self.inner.tree.evictable_size()
    }

    fn protected_size(&self) -> usize {
        self.inner.tree.protected_size()
    }

    fn num_nodes(&self) -> usize {
        self.inner.tree.num_nodes()
    }

    fn num_reqs(&self) -> usize {
        self.inner.num_reqs()
    }

    fn free_rows(&self) -> usize {
        self.inner.req_pool.available_size()
    }

    fn match_prefix<'py>(
        &mut self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyArray1<i64>>, usize)> {
        let m = with_tokens(key, |key| self.inner.match_prefix(key))?;
        Ok((to_array(py, m.indices), m.last_node))
    }

    fn match_unlocked(&self, key: &Bound<'_, PyAny>) -> PyResult<(usize, usize)> {
        with_tokens(key, |key| self.inner.match_unlocked(key))
    }

    /// Keys given flat: key i is tokens[offsets[i]..offsets[i + 1]].
    fn match_lens<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        offsets: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        per_key(py, tokens, offsets, |keys| self.inner.match_lens(keys))
    }

    fn dfs_weight_order<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        offsets: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        per_key(py, tokens, offsets, |keys| {
            self.inner.dfs_weight_order(keys)
        })
    }

    fn add_req(&mut self, key: &Bound<'_, PyAny>) -> PyResult<Option<(u64, usize, usize)>> {
        let r = with_tokens(key, |key| self.inner.add_req(key))?.py()?;
        Ok(r.map(|a| (a.req_id, a.req_pool_idx, a.prefix_len)))
    }

    fn prepare_extend(
        &mut self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        extend_lens: &Bound<'_, PyAny>,
    ) -> PyResult<Option<BatchArrays>> {
        let (ids, lens) = (u64_vec(req_ids)?, usize_vec(extend_lens)?);
        let out = self.inner.prepare_extend(&ids, &lens).py()?;
        Ok(out.map(|a| BatchArrays::new(py, a)))
    }

    fn prepare_decode(
        &mut self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Option<BatchArrays>> {
        let ids = u64_vec(req_ids)?;
        let out = self.inner.prepare_decode(&ids).py()?;
        Ok(out.map(|a| BatchArrays::new(py, a)))
    }

    fn cache_unfinished_req(
        &mut self,
        req_id: u64,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        with_tokens(token_ids, |t| self.inner.cache_unfinished_req(req_id, t))?.py()
    }

    fn cache_finished_req(&mut self, req_id: u64, token_ids: &Bound<'_, PyAny>) -> PyResult<bool> {
        with_tokens(token_ids, |t| self.inner.cache_finished_req(req_id, t))?.py()
    }

    fn free_req(&mut self, req_id: u64) -> PyResult<bool> {
        self.inner.free_req(req_id).py()
    }

    fn req_info(&self, req_id: u64) -> PyResult<(usize, usize, usize, usize)> {
        let r = self.inner.req(req_id).py()?;
        Ok((r.req_pool_idx, r.prefix_len, r.kv_len, r.last_node))
    }

    fn req_slots<'py>(&self, py: Python<'py>, req_id: u64) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let slots = self.inner.req_slots(req_id).py()?;
        Ok(to_array(py, slots.iter().map(|&s| i64::from(s)).collect()))
    }

    fn evict(&mut self, num_tokens: usize) -> PyResult<usize> {
        self.inner.evict(num_tokens).py()
    }

    fn reset(&mut self) -> PyResult<()> {
        self.inner.reset().py()
    }

    fn check_integrity(&self, py: Python<'_>) -> PyResult<()> {
        let inner = &self.inner;
        py.detach(move || inner.check_integrity()).py()
    }

    fn __repr__(&self) -> String {
        format!(
            "KVCache(page_size={}, free={}, evictable={}, protected={}, reqs={})",
            self.inner.page_size(),
            self.inner.alloc.available_size(),
            self.inner.tree.evictable_size(),
            self.inner.tree.protected_size(),
            self.inner.num_reqs()
        )
    }
}

/// `f` of the keys of a flat token array cut at `offsets`, as a numpy int64 array.
fn per_key<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    offsets: &Bound<'py, PyAny>,
    f: impl FnOnce(&[&[i32]]) -> Vec<usize>,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let offsets = usize_vec(offsets)?;
    let out = with_tokens(tokens, |t| split_keys(t, &offsets).map(|keys| f(&keys)))??;
    Ok(to_array(py, out.into_iter().map(|n| n as i64).collect()))
}

/// The keys of a flat token array cut at `offsets` ([n + 1], non-decreasing, ending at the
/// array's length), or ShapeError.
fn split_keys<'a>(tokens: &'a [i32], offsets: &[usize]) -> PyResult<Vec<&'a [i32]>> {
    let ok = !offsets.is_empty()
        && offsets[0] == 0
        && *offsets.last().unwrap() == tokens.len()
        && offsets.windows(2).all(|w| w[0] <= w[1]);
    if !ok {
        return Err(crate::errors::ShapeError::new_err(
            "offsets must rise from 0 to the number of tokens",
        ));
    }
    Ok(offsets.windows(2).map(|w| &tokens[w[0]..w[1]]).collect())
}
