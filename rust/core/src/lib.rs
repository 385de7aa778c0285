//! pyserve-core: the part of the pyserve scheduler that decides where KV bytes go.
//!
//! * [`TokenToKVPoolAllocator`] hands out whole pages of KV slots (`i64`; page 0, holding the
//!   padding slot 0, is reserved).
//! * [`ReqToTokenPool`] maps each running request's token positions to KV slots.
//! * [`RadixCache`] shares KV pages between requests with a common prefix of token ids
//!   (`i32`, page-aligned), locks the prefixes running requests use, and evicts the rest
//!   LRU-first through a heap.
//! * [`KVCache`] owns all three plus the admitted requests: the request lifecycle
//!   (`add_req`, `cache_unfinished_req`, `cache_finished_req`, `free_req`), the per-step
//!   arrays ([`BatchArrays`] from `prepare_extend` / `prepare_decode`) and the global
//!   `check_integrity`.
//!
//! Pure Rust with no Python dependency; the pyo3 binding lives in `rust/py`. Nothing here is
//! thread-safe by itself: one thread (the scheduler's) owns all of these objects.

#![warn(missing_docs)]

pub mod allocator;
pub mod batch;
pub mod error;
mod fxhash;
pub mod kv_cache;
pub mod radix_cache;
pub mod req_to_token;
pub mod slot_runs;

pub use allocator::TokenToKVPoolAllocator;
pub use batch::BatchArrays;
pub use error::{CoreError, CoreResult};
pub use kv_cache::{AdmittedReq, KVCache, ReqState};
pub use radix_cache::{MatchResult, RadixCache, ROOT};
pub use req_to_token::ReqToTokenPool;
pub use slot_runs::SlotRuns;
