//! The verbs backend's worker threads, each one per process, FIFO, fed by
//! an unbounded queue (handing over never blocks), each job inside
//! `catch_unwind`. They take work that the progress thread (which must
//! never block) and the node's protocol lock (held while granting) must
//! not do themselves:
//! - `rdev-verbs-setup` ([`spawn`]): work that pins memory or may
//!   otherwise take long: a connection's bring-up on either side (opening
//!   the device, which registers its shared receive buffers; the
//!   connection's own buffers; without memory windows, the whole arena),
//!   registering a chunk of an arena on the first grant in it, and a
//!   sender's hello (`on_accept`, which may wait for its node to finish
//!   starting).
//! - `rdev-verbs-copy` ([`copy`]): staged writes' copies into a
//!   connection's staging chunks when a completion frees a chunk on the
//!   progress thread (see `conn::post`); apart from setup, so a copy never
//!   waits behind a registration.

use std::sync::mpsc::{channel, Sender};
use std::sync::OnceLock;

use parking_lot::Mutex;

type Job = Box<dyn FnOnce() + Send>;
type Queue = OnceLock<Option<Mutex<Sender<Job>>>>;

static SETUP: Queue = OnceLock::new();
static COPY: Queue = OnceLock::new();

/// Run `job` on the setup thread (here, logged, if it cannot start).
pub(crate) fn spawn(job: impl FnOnce() + Send + 'static) {
    run_on(&SETUP, "rdev-verbs-setup", Box::new(job));
}

/// Run `job` on the copy thread (here, logged, if it cannot start).
pub(crate) fn copy(job: impl FnOnce() + Send + 'static) {
    run_on(&COPY, "rdev-verbs-copy", Box::new(job));
}

fn run_on(queue: &'static Queue, name: &'static str, job: Job) {
    let q = queue.get_or_init(|| {
        let (tx, rx) = channel::<Job>();
        let spawned = std::thread::Builder::new().name(name.into()).spawn(move || {
            while let Ok(job) = rx.recv() {
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                    log::error!("verbs: a job panicked on {name}; the thread goes on");
                }
            }
        });
        match spawned {
            Ok(_) => Some(Mutex::new(tx)),
            Err(e) => {
                log::error!("verbs: cannot start {name} ({e}): its jobs run on the caller's thread");
                None
            }
        }
    });
    let left = match q {
        Some(tx) => tx.lock().send(job).err().map(|e| e.0),
        None => Some(job),
    };
    if let Some(job) = left {
        job();
    }
}
