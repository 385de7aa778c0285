//! Sending many buffers, each to its own non-blocking socket, in one call.
//!
//! The HTTP server's stream writer hands one step's SSE chunks of every streamed response to
//! [`send_each`] (Python: `pyserve._rs.send_each`) on a thread of its own, with the GIL
//! released, so the event loop does not spend a system call per chunk (on loopback, the kernel also delivers the bytes to the
//! reader inside that call). Each buffer is sent until it is done or its socket's send buffer
//! is full; the caller takes any unsent rest back to its event loop, which waits for the
//! socket to drain. Sockets are sent to with `MSG_NOSIGNAL` (Rust's `TcpStream::write` on
//! Linux), so a closed peer is an `EPIPE` error, never a `SIGPIPE`.
//!
//! It lives in the binding crate, not in `pyserve-core`: it is the HTTP server's, not the
//! scheduler's.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::io::{ErrorKind, Write};
use std::mem::ManuallyDrop;
use std::net::TcpStream;
use std::os::fd::{FromRawFd, RawFd};

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
        send_all(&items)
    }))
}

/// Sends `buf` to the non-blocking socket `fd` (borrowed: it stays open): the number of bytes
/// the socket took (all of them, or fewer once its send buffer was full), retrying on
/// `EINTR`; `Err(errno)` if the send failed (`EPIPE`, `ECONNRESET`, `EBADF`, ...) before
/// anything was sent. A failure after part of `buf` went out returns that part's length;
/// the next send reports the error.
pub fn send_nonblocking(fd: RawFd, buf: &[u8]) -> Result<usize, i32> {
    if fd < 0 {
        return Err(EBADF);
    }
    // SAFETY: the stream is never dropped, so `fd` is only borrowed, never closed here; any
    // non-negative fd value is memory-safe to send to (a bad one is an EBADF / ENOTSOCK error).
    let mut sock = ManuallyDrop::new(unsafe { TcpStream::from_raw_fd(fd) });
    let mut sent = 0;
    while sent < buf.len() {
        match sock.write(&buf[sent..]) {
            Ok(0) => break,
            Ok(n) => sent += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if sent == 0 => return Err(e.raw_os_error().unwrap_or(EIO)),
            Err(_) => break,
        }
    }
    Ok(sent)
}

/// [`send_nonblocking`] of every `(fd, buf)` in order: for each, the bytes sent, or the
/// negated errno of a failure.
pub fn send_all(items: &[(RawFd, &[u8])]) -> Vec<i64> {
    items
        .iter()
        .map(|&(fd, buf)| match send_nonblocking(fd, buf) {
            Ok(n) => n as i64,
            Err(errno) => -i64::from(errno),
        })
        .collect()
}

/// Linux errno values returned without an OS error code to carry them.
const EIO: i32 = 5;
const EBADF: i32 = 9;

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn sends_whole_buffers_and_stops_at_a_full_socket() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let (c, mut d) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        c.set_nonblocking(true).unwrap();
        let big = vec![7u8; 16 << 20]; // more than any socket buffer takes
        let out = send_all(&[
            (a.as_raw_fd(), b"hello"),
            (c.as_raw_fd(), &big),
            (a.as_raw_fd(), b" world"),
        ]);
        assert_eq!((out[0], out[2]), (5, 6));
        let taken = out[1] as usize;
        assert!(taken > 0 && taken < big.len(), "{taken}");
        let mut got = [0u8; 11];
        b.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hello world");
        // The socket took exactly what it reported: the reader sees `taken` bytes, no more.
        drop(c);
        let mut rest = Vec::new();
        d.read_to_end(&mut rest).unwrap();
        assert_eq!(rest.len(), taken);
        // Still full-less and open: the borrowed fds were not closed.
        assert_eq!(send_all(&[(a.as_raw_fd(), b"!")]), vec![1]);
    }

    #[test]
    fn a_closed_peer_or_bad_fd_is_an_errno() {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        drop(b);
        assert_eq!(send_all(&[(a.as_raw_fd(), b"x")]), vec![-32]); // EPIPE, no SIGPIPE
        assert_eq!(send_all(&[(-1, b"x")]), vec![-9]); // EBADF
        assert_eq!(send_all(&[(a.as_raw_fd(), b"")]), vec![0]);
    }
}
