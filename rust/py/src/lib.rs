//! `pyserve._rs`: the thin pyo3 binding of `pyserve-core`.
//!
//! Wrappers of the core: convert arrays in and out, map core errors to the exception hierarchy
//! in `errors.rs`; the scheduling logic and its tests live in `rust/core`. One piece is the
//! HTTP server's own, so it lives here with its tests: `send_each` (`socket_send.rs`, the SSE
//! stream writer's batched socket sends). The `KVCache` calls keep the GIL
//! (but `check_integrity`, O(pool)): they take microseconds on the loop thread, where a GIL
//! release costs up to the interpreter's switch interval (see `kv_cache.rs`); `send_each`
//! releases it.
//! Only the scheduler (loop) thread may call into these objects (DESIGN.md section 1);
//! `send_each` is a free function for the SSE stream writer's thread.

mod convert;
mod errors;
mod kv_cache;
mod socket_send;

use pyo3::prelude::*;

#[pymodule]
fn _rs(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<kv_cache::KVCache>()?;
    m.add_class::<kv_cache::BatchArrays>()?;
    m.add_function(wrap_pyfunction!(socket_send::send_each, m)?)?;
    errors::register(m)?;
    Ok(())
}
