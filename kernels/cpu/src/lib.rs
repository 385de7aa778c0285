//! CPU kernels of `pyserve-kernels`, for the float32 CPU path of pyserve: paged decode
//! attention, encoders' bidirectional attention over ragged batches, storing new K/V rows
//! into the pool, RMSNorm (plain and with the residual add fused), rotary embedding, SwiGLU,
//! a mixture of experts' routed feed-forward, and the grammar token-bitmask mask of structured output.
//!
//! The kernels are plain Rust on slices (tested with `cargo test`); `python` (feature
//! "python") is the thin pyo3 binding imported as `pyserve_kernels._cpu`. Inner loops exist in
//! portable Rust and in AVX2 + FMA intrinsics, chosen at run time from what the CPU has.

pub mod activation;
pub mod argmax;
pub mod decode_attention;
pub mod decoder_layer;
pub mod exp;
pub mod moe;
pub mod moe_route;
pub mod norm;
pub mod parallel;
pub mod quant;
pub mod rotary;
mod simd;
pub mod store_kv;
pub mod token_bitmask;
pub mod varlen_attention;

pub use decode_attention::{decode_attention, DecodeAttentionError, DecodeAttentionShape};
pub use varlen_attention::{varlen_attention, VarlenAttentionError};

#[cfg(feature = "python")]
mod python;
#[cfg(feature = "python")]
mod python_layer;
#[cfg(feature = "python")]
mod python_logits;
#[cfg(feature = "python")]
mod python_moe;
#[cfg(feature = "python")]
mod python_quant;
