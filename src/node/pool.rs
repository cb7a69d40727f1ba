//! The node's own worker threads for work that may wait on the network, so
//! that no caller (TF executor threads inside `rdev_send`/`rdev_recv`,
//! progress threads handling a control message) ever waits for it:
//! - [`CONNECT`] (`rdev-connect-N`): connecting to a peer and sending what
//!   queued for it, and watching a peer we only receive from;
//! - [`ROUTE`] (`rdev-route-N`): choosing a peer's route (routes.rs);
//! - [`PLACE`] (`rdev-place-N`): placing an edge on another task's behalf
//!   (`PlaceFor`), which waits for the receiver's answer;
//! - [`STREAM`] (`rdev-stream-N`): the chunk writes and copies of streamed
//!   tensors (memcpys of up to 16 MiB; a shm write may also wait for ring
//!   space, 10 s at most).
//!
//! Each is a [`ProcessPool`] (crate::pool: named threads started on first
//! use and kept for the process's life, a queue that never blocks, every
//! job inside `catch_unwind`). Jobs bound their own waits (every connect
//! and placement has a deadline), so a queue always drains. Placements
//! have a pool apart from connects: a burst of them (up to one per edge of
//! a graph) never delays a connect that queued sends wait for.

use crate::pool::ProcessPool;

/// Connects (and the sends queued behind them) and peer watches.
pub(super) static CONNECT: ProcessPool = ProcessPool::new("rdev-connect", 4);
/// Choosing peers' routes (routes.rs): a name lookup and a probe each,
/// every peer of a cluster at once. Apart from `CONNECT`, whose connects
/// wait for routes being chosen.
pub(super) static ROUTE: ProcessPool = ProcessPool::new("rdev-route", 8);
/// Placements on another task's behalf.
pub(super) static PLACE: ProcessPool = ProcessPool::new("rdev-place", 4);
/// Chunk writes and copies of streamed tensors: at most STREAM_SLOTS of
/// each per link are queued at once.
pub(super) static STREAM: ProcessPool = ProcessPool::new("rdev-stream", 4);
