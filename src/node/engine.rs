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
//! Shape: a queue preallocated for `ENGINE_QUEUE` jobs (posting never
//! blocks and, in a steady state, allocates nothing), `WRITE_ENGINE_THREADS`
//! threads, each job's completion run by the write itself (`TensorWrite`).
//! When the node goes, the threads drain the queue (the endpoints fail what
//! they can no longer write) and end.

use std::sync::Arc;

use super::jobs::JobQueue;
use super::write::TensorWrite;
use crate::constants::{ENGINE_QUEUE, WRITE_ENGINE_THREADS};
use crate::fabric::Endpoint;
use crate::trace;

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
    queue: Arc<JobQueue<Job>>,
    /// Threads that started (0: writes run on the caller).
    threads: usize,
}

impl WriteEngine {
    pub(super) fn start() -> WriteEngine {
        let queue = Arc::new(JobQueue::with_room(ENGINE_QUEUE));
        let mut threads = 0;
        for i in 0..WRITE_ENGINE_THREADS {
            let q = queue.clone();
            match std::thread::Builder::new().name(format!("rdev-write-{i}")).spawn(move || serve(&q)) {
                Ok(_) => threads += 1,
                Err(e) => log::error!("cannot start a rdev-write thread ({e}): large writes run on fewer"),
            }
        }
        WriteEngine { queue, threads }
    }

    /// Write `op` at `offset` of `ep`'s peer, now on this thread or later
    /// on the engine's; never blocks for more than a queue push.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn post(&self, ep: Arc<dyn Endpoint>, offset: u64, key: u32, imm: u32, op: Box<TensorWrite>, step: u64, bytes: u64) {
        let job = Job::new(ep, offset, key, imm, op, step, bytes);
        if self.threads == 0 {
            return run(job);
        }
        if let Err(job) = self.queue.push(job) {
            log::error!("rdev-write: out of memory for its queue; writing on the caller's thread");
            run(job);
        }
    }
}

impl Drop for WriteEngine {
    fn drop(&mut self) {
        self.queue.close();
    }
}

fn run(j: Job) {
    let t = trace::start();
    j.ep.write(j.offset, j.key, j.imm, j.op);
    trace::end("write", t, j.step, j.bytes, None);
}

fn serve(q: &JobQueue<Job>) {
    while let Some(job) = q.pop() {
        serve_one(job);
    }
}

/// One job on an engine thread: a write that panics is caught (the
/// write's `Drop` fails it: L4) and the thread goes on.
pub(super) fn serve_one(job: Job) {
    if crate::error::catch_panic("a tensor write", || run(job)).is_err() {
        log::error!("rdev-write: a write panicked; the thread goes on");
    }
}
