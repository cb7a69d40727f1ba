//! rdma_device: a tensor transport for TensorFlow's distributed runtime in
//! which the receiver places each incoming tensor in registered memory ahead
//! of time and the sender writes it there with one one-sided write.
//!
//! Layers, top to bottom (arrows point down only):
//! `ffi` (C ABI) → `node` (one task: transports + protocol) →
//! `rendezvous` (the protocol, no unsafe, no transport types) and
//! `fabric` (the remote-memory device: shm, verbs).

pub mod codec;
pub mod completion;
pub mod config;
pub mod constants;
pub mod error;
pub mod fabric;
pub(crate) mod pool;
pub mod stats;
pub mod sync;
pub mod trace;

pub use error::{Error, Result};
pub mod rendezvous;
pub mod node;
pub mod ffi;

/// The deterministic simulation with faults (`--features sim`).
#[cfg(feature = "sim")]
pub mod sim;

/// Entry points for the coverage-guided fuzz targets (tests/fuzz), which
/// reach decoders that are otherwise private. Built only with `--cfg fuzzing`.
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod fuzzing;
