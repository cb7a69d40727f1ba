//! The write engine (`rdev-write-N`, per node): large tensor writes are
//! posted here and TensorFlow's thread returns, as it would after posting
//! to a NIC. On shm the write *is* the copy into the receiver's slot (with
//! the copy helpers for very large ones) and the doorbell; on verbs it is
//! the registration (through the cache) and the post. Either can take
//! long: milliseconds for 16 MiB, and up to `RING_FULL_TIMEOUT` when a
//! receiver stopped taking writes. None of it belongs on an executor
//! thread (threading rules: "no copy of a large tensor on that thread").
//!
//! Writes below `WRITE_ENGINE_MIN` stay on the caller: a copy of a few KiB
//! costs less than the wake-up of another thread.
//!
//! Shape: a [`Pool`] (crate::pool) of `WRITE_ENGINE_THREADS` threads with
//! a queue preallocated for `ENGINE_QUEUE` jobs (posting never blocks and,
//! in a steady state, allocates nothing), each job's completion run by the
//! write itself (`TensorWrite`). When the node goes, the threads drain the
//! queue (the endpoints fail what they can no longer write) and end.

use std::sync::Arc;

use super::write::TensorWrite;
use crate::constants::{ENGINE_QUEUE, WRITE_ENGINE_THREADS};
use crate::fabric::Endpoint;
use crate::pool::Pool;
use crate::trace;

/// The engine's threads: `rdev-write-0`, `rdev-write-1`, ...
const NAME: &str = "rdev-write";

/// One write for the engine: `op` at `offset` of `ep`'s peer.
pub(super) struct Job {
    ep: Arc<dyn Endpoint>,
    offset: u64,
    key: u32,
    imm: u32,
    op: Box<TensorWrite>,
    step: u64,
    bytes: u64,
}

impl Job {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(ep: Arc<dyn Endpoint>, offset: u64, key: u32, imm: u32, op: Box<TensorWrite>, step: u64, bytes: u64) -> Job {
        Job { ep, offset, key, imm, op, step, bytes }
    }
}

pub(super) struct WriteEngine {
    /// The engine's threads (if none could start, writes run on the
    /// caller).
    pool: Pool<Job>,
}

impl WriteEngine {
    pub(super) fn start() -> WriteEngine {
        let pool = Pool::start(NAME, WRITE_ENGINE_THREADS, ENGINE_QUEUE, run);
        if pool.threads() < WRITE_ENGINE_THREADS {
            log::error!("{NAME}: {} of {WRITE_ENGINE_THREADS} threads started: large writes run on fewer (none: on the caller)", pool.threads());
        }
        WriteEngine { pool }
    }

    /// Write `op` at `offset` of `ep`'s peer, now on this thread or later
    /// on the engine's; never blocks for more than a queue push.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn post(&self, ep: Arc<dyn Endpoint>, offset: u64, key: u32, imm: u32, op: Box<TensorWrite>, step: u64, bytes: u64) {
        let job = Job::new(ep, offset, key, imm, op, step, bytes);
        if let Err(job) = self.pool.push(job) {
            // No thread, or no memory for the queue (logged): write here.
            run(job);
        }
    }
}

fn run(j: Job) {
    let t = trace::start();
    j.ep.write(j.offset, j.key, j.imm, j.op);
    trace::end("write", t, j.step, j.bytes, None);
}

/// One job as an engine thread runs it (the pool runs `run` inside
/// `run_caught`): a write that panics is caught (the write's `Drop` fails
/// it: L4) and the thread goes on. The schedule tests run it on threads of
/// their own.
#[cfg(all(test, feature = "shuttle"))]
pub(super) fn serve_one(job: Job) {
    crate::pool::run_caught(NAME, || run(job));
}
