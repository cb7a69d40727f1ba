//! The node's callback thread (`rdev-callbacks`): work that a backend's
//! event thread (shm progress and reader threads, the verbs progress
//! thread) must not do itself is handed over to it:
//! - TensorFlow's callbacks (a receive's or a send's completion), which run
//!   application code that may call back into the transport;
//! - writes started by an event (a queued send that a credit or a publish
//!   released), which copy the tensor (shm) or register its memory (verbs).
//!
//! One thread per node, fed by an unbounded queue (handing over never
//! blocks), so callbacks keep the order in which the events produced them.
//! Each job runs inside `catch_unwind`: a panicking callback is logged and
//! the thread goes on. The thread ends when the node is gone and its queue
//! is drained.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Sender};

use parking_lot::Mutex;

type Job = Box<dyn FnOnce() + Send>;

pub(super) struct Handoff {
    tx: Mutex<Option<Sender<Job>>>,
}

impl Handoff {
    pub(super) fn start() -> Handoff {
        let (tx, rx) = channel::<Job>();
        let spawned = std::thread::Builder::new().name("rdev-callbacks".into()).spawn(move || {
            while let Ok(job) = rx.recv() {
                if catch_unwind(AssertUnwindSafe(job)).is_err() {
                    log::error!("a callback handed to rdev-callbacks panicked; the thread goes on");
                }
            }
        });
        match spawned {
            Ok(_) => Handoff { tx: Mutex::new(Some(tx)) },
            Err(e) => {
                log::error!("cannot start the rdev-callbacks thread ({e}): callbacks run on the transport's threads");
                Handoff { tx: Mutex::new(None) }
            }
        }
    }

    /// Queue `job`; never blocks. Without a thread it runs here.
    pub(super) fn run(&self, job: impl FnOnce() + Send + 'static) {
        let job: Job = Box::new(job);
        let left = match &*self.tx.lock() {
            Some(tx) => tx.send(job).err().map(|e| e.0),
            None => Some(job),
        };
        if let Some(job) = left {
            job();
        }
    }
}
