//! `send_each(fds, chunks)`: a thin wrapper over `pyserve_core::socket_send::send_each`.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use pyserve_core::socket_send;

/// Sends `chunks[i]` (bytes) to the non-blocking socket `fds[i]`, for every i in order, with
/// the GIL released; returns for each the number of bytes sent (fewer than its length when
/// that socket's buffer filled up) or the negated errno of a failed send. The fds are
/// borrowed, never closed. Raises ValueError if the lists differ in length.
#[pyfunction]
pub fn send_each(
    py: Python<'_>,
    fds: Vec<i32>,
    chunks: Vec<Bound<'_, PyBytes>>,
) -> PyResult<Vec<i64>> {
    if fds.len() != chunks.len() {
        return Err(PyValueError::new_err(format!(
            "send_each: {} fds but {} chunks",
            fds.len(),
            chunks.len()
        )));
    }
    // The bytes objects are immutable and `chunks` keeps them alive across the call, so their
    // buffers may be read while the GIL is released; they cross as (address, length).
    let spans: Vec<(i32, usize, usize)> = fds
        .iter()
        .zip(&chunks)
        .map(|(&fd, c)| {
            let b = c.as_bytes();
            (fd, b.as_ptr() as usize, b.len())
        })
        .collect();
    Ok(py.detach(move || {
        let items: Vec<(i32, &[u8])> = spans
            .iter()
            // SAFETY: each span is a live bytes object's buffer (see above).
            .map(|&(fd, ptr, len)| {
                (fd, unsafe {
                    std::slice::from_raw_parts(ptr as *const u8, len)
                })
            })
            .collect();
        socket_send::send_each(&items)
    }))
}
