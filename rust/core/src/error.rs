//! The one error type of the core: every fallible operation returns `Result<_, CoreError>`.
//!
//! Errors mean a caller broke a contract (freed a slot twice, named a node that does not exist,
//! passed arrays of different lengths). Expected shortfalls, such as "not enough free KV slots",
//! are not errors: those operations return `None` instead.

use std::fmt;

/// Why a core operation refused to run. Operations that return this error check their inputs
/// before mutating anything, unless their documentation says otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// A radix-tree node id that is not a live node of this cache.
    UnknownNode(usize),
    /// A request row index that is out of range or not currently allocated.
    UnknownReqSlot(usize),
    /// A request id that is not admitted (never was, or was released long ago and is not
    /// known any more).
    UnknownReq(u64),
    /// A request id that appears twice where it must appear once (e.g. in one batch).
    DuplicateReq(u64),
    /// A KV slot (or request row) that is already free was freed again.
    DoubleFree(i64),
    /// An index outside its valid range: `value` is not in `[low, high)`.
    OutOfRange {
        /// What the index refers to, e.g. `"kv slot"` or `"req_to_token column"`.
        what: &'static str,
        /// The offending value.
        value: i64,
        /// Inclusive lower bound.
        low: i64,
        /// Exclusive upper bound.
        high: i64,
    },
    /// `dec_lock_ref` would take the lock count of this node below zero.
    LockUnderflow(usize),
    /// Inputs whose lengths must agree do not (the message names them).
    ShapeMismatch(String),
    /// An internal invariant does not hold; the message says which.
    Invariant(String),
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::UnknownNode(id) => write!(f, "unknown radix cache node {id}"),
            CoreError::UnknownReqSlot(idx) => {
                write!(f, "unknown or unallocated req_pool_idx {idx}")
            }
            CoreError::UnknownReq(id) => write!(f, "unknown request id {id}"),
            CoreError::DuplicateReq(id) => write!(f, "request id {id} appears twice"),
            CoreError::DoubleFree(i) => write!(f, "double free of index {i}"),
            CoreError::OutOfRange {
                what,
                value,
                low,
                high,
            } => write!(f, "{what} {value} out of range [{low}, {high})"),
            CoreError::LockUnderflow(id) => {
                write!(f, "dec_lock_ref below zero on radix cache node {id}")
            }
            CoreError::ShapeMismatch(msg) => write!(f, "shape mismatch: {msg}"),
            CoreError::Invariant(msg) => write!(f, "invariant violated: {msg}"),
        }
    }
}

impl std::error::Error for CoreError {}

/// Shorthand for results of core operations.
pub type CoreResult<T> = Result<T, CoreError>;
