//! The exception hierarchy of `pyserve._rs` and the mapping from core errors to it.
//!
//! `CoreError` is the base; each subclass names what the caller got wrong, so Python code can
//! catch precisely (`except DoubleFreeError`) or broadly (`except CoreError`).

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyserve_core::CoreError as RsError;

create_exception!(
    pyserve._rs,
    CoreError,
    PyException,
    "Base class of every error raised by the pyserve Rust core."
);
create_exception!(
    pyserve._rs,
    UnknownRequestError,
    CoreError,
    "A request id, req_pool_idx or radix cache node id that is not admitted / not live."
);
create_exception!(
    pyserve._rs,
    DuplicateRequestError,
    CoreError,
    "A request id given twice where it must appear once (e.g. twice in one batch)."
);
create_exception!(
    pyserve._rs,
    DoubleFreeError,
    CoreError,
    "A KV slot or request row freed while already free (or twice in one call)."
);
create_exception!(
    pyserve._rs,
    ShapeError,
    CoreError,
    "Bad array input: mismatched lengths, wrong dtype or dimensions, a negative or
out-of-range index or length."
);
create_exception!(
    pyserve._rs,
    InvariantError,
    CoreError,
    "A broken internal invariant (e.g. dec_lock_ref below zero, inconsistent tree)."
);

/// Converts a core error into the matching Python exception, keeping its message.
pub fn to_py_err(e: RsError) -> PyErr {
    let msg = e.to_string();
    match e {
        RsError::UnknownNode(_) | RsError::UnknownReqSlot(_) | RsError::UnknownReq(_) => {
            UnknownRequestError::new_err(msg)
        }
        RsError::DuplicateReq(_) => DuplicateRequestError::new_err(msg),
        RsError::DoubleFree(_) => DoubleFreeError::new_err(msg),
        RsError::OutOfRange { .. } | RsError::ShapeMismatch(_) => ShapeError::new_err(msg),
        RsError::LockUnderflow(_) | RsError::Invariant(_) => InvariantError::new_err(msg),
    }
}

/// `Result` adapter: `core_call().py()?` raises the mapped Python exception.
pub trait IntoPyResult<T> {
    /// Maps the error with [`to_py_err`].
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, RsError> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py_err)
    }
}

/// Adds the exception classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("CoreError", py.get_type::<CoreError>())?;
    m.add("UnknownRequestError", py.get_type::<UnknownRequestError>())?;
    m.add(
        "DuplicateRequestError",
        py.get_type::<DuplicateRequestError>(),
    )?;
    m.add("DoubleFreeError", py.get_type::<DoubleFreeError>())?;
    m.add("ShapeError", py.get_type::<ShapeError>())?;
    m.add("InvariantError", py.get_type::<InvariantError>())?;
    Ok(())
}
