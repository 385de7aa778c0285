//! Python classes `TokenToKVPoolAllocator` and `ReqToTokenPool`: thin wrappers over the core.

use numpy::PyArray1;
use pyo3::prelude::*;
use pyserve_core as rs;

use crate::convert::{i64_vec, to_array};
use crate::errors::IntoPyResult;

/// KV slot allocator over slots `1..=size` (slot 0 is the padding slot, never handed out).
#[pyclass(module = "pyserve._rs", name = "TokenToKVPoolAllocator")]
pub struct TokenToKVPoolAllocator {
    pub(crate) inner: rs::TokenToKVPoolAllocator,
}

#[pymethods]
impl TokenToKVPoolAllocator {
    #[new]
    fn new(size: usize) -> Self {
        Self {
            inner: rs::TokenToKVPoolAllocator::new(size),
        }
    }

    /// `n` free slots as an int64 array, or None (nothing taken) if fewer are free.
    fn alloc<'py>(&mut self, py: Python<'py>, n: usize) -> Option<Bound<'py, PyArray1<i64>>> {
        self.inner.alloc(n).map(|v| to_array(py, v))
    }

    /// Frees `slots`; raises DoubleFreeError / ShapeError (out of range) with nothing freed.
    fn free(&mut self, slots: &Bound<'_, PyAny>) -> PyResult<()> {
        let slots = i64_vec(slots)?;
        self.inner.free(&slots).py()
    }

    fn available_size(&self) -> usize {
        self.inner.available_size()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    #[getter]
    fn page_size(&self) -> usize {
        self.inner.page_size()
    }

    fn is_free(&self, slot: i64) -> bool {
        self.inner.is_free(slot)
    }

    fn clear(&mut self) {
        self.inner.clear()
    }

    fn __repr__(&self) -> String {
        format!(
            "TokenToKVPoolAllocator(size={}, available_size={})",
            self.inner.size(),
            self.inner.available_size()
        )
    }
}

/// `size` request rows x `max_context_len` KV slots (int64).
#[pyclass(module = "pyserve._rs", name = "ReqToTokenPool")]
pub struct ReqToTokenPool {
    pub(crate) inner: rs::ReqToTokenPool,
}

#[pymethods]
impl ReqToTokenPool {
    #[new]
    fn new(size: usize, max_context_len: usize) -> Self {
        Self {
            inner: rs::ReqToTokenPool::new(size, max_context_len),
        }
    }

    /// A free row index, or None if all rows are in use.
    fn alloc(&mut self) -> Option<usize> {
        self.inner.alloc()
    }

    fn free(&mut self, req_pool_idx: usize) -> PyResult<()> {
        self.inner.free(req_pool_idx).py()
    }

    /// Writes `slots` into row `req_pool_idx` at columns `[start, start + len(slots))`.
    fn write(
        &mut self,
        req_pool_idx: usize,
        start: usize,
        slots: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let slots = i64_vec(slots)?;
        self.inner.write(req_pool_idx, start, &slots).py()
    }

    /// Copy of columns `[start, end)` of row `req_pool_idx` as an int64 array.
    fn read<'py>(
        &self,
        py: Python<'py>,
        req_pool_idx: usize,
        start: usize,
        end: usize,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let row = self.inner.read(req_pool_idx, start, end).py()?;
        Ok(PyArray1::from_slice(py, row))
    }

    fn available_size(&self) -> usize {
        self.inner.available_size()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn max_context_len(&self) -> usize {
        self.inner.max_context_len()
    }

    fn clear(&mut self) {
        self.inner.clear()
    }

    fn __repr__(&self) -> String {
        format!(
            "ReqToTokenPool(size={}, max_context_len={}, available_size={})",
            self.inner.size(),
            self.inner.max_context_len(),
            self.inner.available_size()
        )
    }
}
