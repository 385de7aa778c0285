//! Python class `RadixCache`: holds references to the request pool and the allocator it
//! frees into, and borrows them mutably inside each call (so Python never passes them again).

use numpy::PyArray1;
use pyo3::prelude::*;
use pyserve_core as rs;

use crate::convert::{i32_vec, i64_vec, to_array};
use crate::errors::IntoPyResult;
use crate::pools::{ReqToTokenPool, TokenToKVPoolAllocator};

/// Radix tree from token ids to KV slots with LRU eviction of unlocked leaves.
#[pyclass(module = "pyserve._rs", name = "RadixCache")]
pub struct RadixCache {
    inner: rs::RadixCache,
    req_to_token_pool: Py<ReqToTokenPool>,
    token_to_kv_pool_allocator: Py<TokenToKVPoolAllocator>,
}

impl RadixCache {
    /// Runs `f` on the cache, the request pool and the allocator with the GIL released.
    /// Raises RuntimeError if the pool or allocator is already borrowed (re-entrant call).
    fn with_all<T: Send>(
        &mut self,
        py: Python<'_>,
        f: impl FnOnce(
                &mut rs::RadixCache,
                &mut rs::ReqToTokenPool,
                &mut rs::TokenToKVPoolAllocator,
            ) -> T
            + Send,
    ) -> PyResult<T> {
        let mut pool = self.req_to_token_pool.bind(py).try_borrow_mut()?;
        let mut alloc = self.token_to_kv_pool_allocator.bind(py).try_borrow_mut()?;
        let (cache, pool, alloc) = (&mut self.inner, &mut pool.inner, &mut alloc.inner);
        Ok(py.detach(move || f(cache, pool, alloc)))
    }
}

#[pymethods]
impl RadixCache {
    #[new]
    #[pyo3(signature = (req_to_token_pool, token_to_kv_pool_allocator, page_size = 1, disable = false))]
    fn new(
        req_to_token_pool: Py<ReqToTokenPool>,
        token_to_kv_pool_allocator: Py<TokenToKVPoolAllocator>,
        page_size: usize,
        disable: bool,
    ) -> PyResult<Self> {
        Ok(Self {
            inner: rs::RadixCache::new(page_size, disable).py()?,
            req_to_token_pool,
            token_to_kv_pool_allocator,
        })
    }

    #[getter]
    fn req_to_token_pool(&self, py: Python<'_>) -> Py<ReqToTokenPool> {
        self.req_to_token_pool.clone_ref(py)
    }

    #[getter]
    fn token_to_kv_pool_allocator(&self, py: Python<'_>) -> Py<TokenToKVPoolAllocator> {
        self.token_to_kv_pool_allocator.clone_ref(py)
    }

    #[getter]
    fn page_size(&self) -> usize {
        self.inner.page_size()
    }

    #[getter]
    fn disable(&self) -> bool {
        self.inner.disabled()
    }

    /// Longest cached prefix of `key`: (int64 slots, last_node). Splits a node if needed.
    fn match_prefix<'py>(
        &mut self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyArray1<i64>>, usize)> {
        let key = i32_vec(key)?;
        let inner = &mut self.inner;
        let m = py.detach(move || inner.match_prefix(&key));
        Ok((to_array(py, m.indices), m.last_node))
    }

    /// Inserts `key` -> `value`; returns how many leading tokens were already cached.
    fn insert(
        &mut self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        value: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let (key, value) = (i32_vec(key)?, i64_vec(value)?);
        let inner = &mut self.inner;
        py.detach(move || inner.insert(&key, &value)).py()
    }

    /// Evicts LRU unlocked leaves until `num_tokens` slots are freed; returns slots freed.
    fn evict(&mut self, py: Python<'_>, num_tokens: usize) -> PyResult<usize> {
        self.with_all(py, |c, _, a| c.evict(num_tokens, a))?.py()
    }

    fn inc_lock_ref(&mut self, node: usize) -> PyResult<()> {
        self.inner.inc_lock_ref(node).py()
    }

    fn dec_lock_ref(&mut self, node: usize) -> PyResult<()> {
        self.inner.dec_lock_ref(node).py()
    }

    fn lock_ref(&self, node: usize) -> PyResult<usize> {
        self.inner.lock_ref(node).py()
    }

    fn evictable_size(&self) -> usize {
        self.inner.evictable_size()
    }

    fn protected_size(&self) -> usize {
        self.inner.protected_size()
    }

    fn total_size(&self) -> usize {
        self.inner.total_size()
    }

    fn num_nodes(&self) -> usize {
        self.inner.num_nodes()
    }

    /// Empties the tree, freeing its slots into the allocator.
    fn reset(&mut self, py: Python<'_>) -> PyResult<()> {
        self.with_all(py, |c, _, a| c.reset(a))?.py()
    }

    /// Raises InvariantError if the tree's cached sizes or links are inconsistent.
    fn check_integrity(&self, py: Python<'_>) -> PyResult<()> {
        let inner = &self.inner;
        py.detach(move || inner.check_integrity()).py()
    }

    /// Caches a finished request's tokens, frees duplicate slots, unlocks, frees the row.
    fn cache_finished_req(
        &mut self,
        py: Python<'_>,
        req_pool_idx: usize,
        token_ids: &Bound<'_, PyAny>,
        prefix_len: usize,
        last_node: usize,
    ) -> PyResult<()> {
        let tokens = i32_vec(token_ids)?;
        self.with_all(py, |c, p, a| {
            c.cache_finished_req(p, a, req_pool_idx, &tokens, prefix_len, last_node)
        })?
        .py()
    }

    /// Caches a running request's tokens, re-locks; returns (new_prefix_len, new_last_node).
    fn cache_unfinished_req(
        &mut self,
        py: Python<'_>,
        req_pool_idx: usize,
        token_ids: &Bound<'_, PyAny>,
        prefix_len: usize,
        last_node: usize,
    ) -> PyResult<(usize, usize)> {
        let tokens = i32_vec(token_ids)?;
        self.with_all(py, |c, p, a| {
            c.cache_unfinished_req(p, a, req_pool_idx, &tokens, prefix_len, last_node)
        })?
        .py()
    }

    /// Drops a request without caching: frees row[prefix_len:kv_len], unlocks, frees the row.
    fn release_req(
        &mut self,
        py: Python<'_>,
        req_pool_idx: usize,
        kv_len: usize,
        prefix_len: usize,
        last_node: usize,
    ) -> PyResult<()> {
        self.with_all(py, |c, p, a| {
            c.release_req(p, a, req_pool_idx, kv_len, prefix_len, last_node)
        })?
        .py()
    }

    fn __repr__(&self) -> String {
        format!(
            "RadixCache(disable={}, evictable_size={}, protected_size={})",
            if self.inner.disabled() {
                "True"
            } else {
                "False"
            },
            self.inner.evictable_size(),
            self.inner.protected_size()
        )
    }
}
