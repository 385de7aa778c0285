//! `pyserve._rs`: the thin pyo3 binding of `pyserve-core`.
//!
//! Wrappers only: convert arrays in and out, release the GIL around the work, map core errors
//! to the exception hierarchy in `errors.rs`. All logic and its tests live in `rust/core`.
//! Only the scheduler (loop) thread may call into these objects (DESIGN.md section 1).

mod batch;
mod convert;
mod errors;
mod pools;
mod radix;

use pyo3::prelude::*;

#[pymodule]
fn _rs(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<pools::TokenToKVPoolAllocator>()?;
    m.add_class::<pools::ReqToTokenPool>()?;
    m.add_class::<radix::RadixCache>()?;
    m.add_function(wrap_pyfunction!(batch::prepare_extend, m)?)?;
    m.add_function(wrap_pyfunction!(batch::prepare_decode, m)?)?;
    errors::register(m)?;
    Ok(())
}
