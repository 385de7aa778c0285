//! pyserve-core: the part of the pyserve scheduler that decides where KV bytes go.
//!
//! * [`TokenToKVPoolAllocator`] hands out KV slots (`i64`, slot 0 reserved for padding).
//! * [`ReqToTokenPool`] maps each running request's token positions to KV slots.
//! * [`RadixCache`] shares KV slots between requests with a common prefix of token ids
//!   (`i32`), locks the prefixes running requests use, and evicts the rest LRU-first.
//! * [`batch`] builds the flat arrays of one forward batch.
//!
//! Pure Rust with no Python dependency; the pyo3 binding lives in `rust/py`. Nothing here is
//! thread-safe by itself: one thread (the scheduler's) owns all of these objects.

#![warn(missing_docs)]

pub mod allocator;
pub mod batch;
pub mod error;
pub mod radix_cache;
pub mod req_to_token;

pub use allocator::TokenToKVPoolAllocator;
pub use batch::{prepare_decode, prepare_extend, BatchArrays, DecodeArrays, ExtendArrays};
pub use error::{CoreError, CoreResult};
pub use radix_cache::{MatchResult, RadixCache, ROOT};
pub use req_to_token::ReqToTokenPool;
