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

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use super::write::TensorWrite;
use crate::constants::{ENGINE_QUEUE, WRITE_ENGINE_THREADS};
use crate::fabric::Endpoint;
use crate::trace;

struct Job {
    ep: Arc<dyn Endpoint>,
    offset: u64,
    key: u32,
    imm: u32,
    op: Box<TensorWrite>,
    step: u64,
    bytes: u64,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    closed: bool,
}

#[derive(Default)]
struct Shared {
    q: Mutex<Queue>,
    cv: Condvar,
}

pub(super) struct WriteEngine {
    shared: Arc<Shared>,
    /// Threads that started (0: writes run on the caller).
    threads: usize,
}

impl WriteEngine {
    pub(super) fn start() -> WriteEngine {
        let shared = Arc::new(Shared::default());
        shared.q.lock().jobs.reserve(ENGINE_QUEUE);
        let mut threads = 0;
        for i in 0..WRITE_ENGINE_THREADS {
            let s = shared.clone();
            match std::thread::Builder::new().name(format!("rdev-write-{i}")).spawn(move || serve(&s)) {
                Ok(_) => threads += 1,
                Err(e) => log::error!("cannot start a rdev-write thread ({e}): large writes run on fewer"),
            }
        }
        WriteEngine { shared, threads }
    }

    /// Write `op` at `offset` of `ep`'s peer, now on this thread or later
    /// on the engine's; never blocks for more than a queue push.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn post(&self, ep: Arc<dyn Endpoint>, offset: u64, key: u32, imm: u32, op: Box<TensorWrite>, step: u64, bytes: u64) {
        let job = Job { ep, offset, key, imm, op, step, bytes };
        if self.threads == 0 {
            return run(job);
        }
        let mut q = self.shared.q.lock();
        if q.jobs.try_reserve(1).is_err() {
            drop(q);
            log::error!("rdev-write: out of memory for its queue; writing on the caller's thread");
            return run(job);
        }
        q.jobs.push_back(job);
        drop(q);
        self.shared.cv.notify_one();
    }
}

impl Drop for WriteEngine {
    fn drop(&mut self) {
        self.shared.q.lock().closed = true;
        self.shared.cv.notify_all();
    }
}

fn run(j: Job) {
    let t = trace::start();
    j.ep.write(j.offset, j.key, j.imm, j.op);
    trace::end("write", t, j.step, j.bytes, None);
}

fn serve(s: &Shared) {
    loop {
        let job = {
            let mut q = s.q.lock();
            loop {
                if let Some(j) = q.jobs.pop_front() {
                    break j;
                }
                if q.closed {
                    return;
                }
                s.cv.wait(&mut q);
            }
        };
        if crate::error::catch_panic("a tensor write", || run(job)).is_err() {
            log::error!("rdev-write: a write panicked; the thread goes on");
        }
    }
}
