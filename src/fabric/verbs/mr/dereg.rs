//! The deregistration thread (`rdev-verbs-dereg`): a memory region dropped
//! on a backend's event thread (the progress thread: a write's last
//! reference to an uncached or evicted registration, a connection's
//! buffers at teardown, a chunk of a closed listener's arena) is
//! deregistered here, because `ibv_dereg_mr` unpins every page of the
//! region and can take long for a large one. One thread for the process,
//! fed by an unbounded queue (handing over never blocks); the regions stay
//! pinned, and so valid, until then, and no work request uses them any
//! more.

use std::sync::mpsc::{channel, Sender};
use std::sync::OnceLock;

use parking_lot::Mutex;

use crate::fabric::verbs::mr::Mr;

static QUEUE: OnceLock<Option<Mutex<Sender<Mr>>>> = OnceLock::new();

/// Deregister `mr` on the deregistration thread (here if it cannot start).
pub(crate) fn later(mr: Mr) {
    let q = QUEUE.get_or_init(|| {
        let (tx, rx) = channel::<Mr>();
        let spawned = std::thread::Builder::new().name("rdev-verbs-dereg".into()).spawn(move || {
            while let Ok(mr) = rx.recv() {
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(mr))).is_err() {
                    log::error!("verbs: a deregistration panicked on rdev-verbs-dereg; the thread goes on");
                }
            }
        });
        match spawned {
            Ok(_) => Some(Mutex::new(tx)),
            Err(e) => {
                log::error!("verbs: cannot start rdev-verbs-dereg ({e}): registrations are released on the progress thread");
                None
            }
        }
    });
    let left = match q {
        Some(tx) => tx.lock().send(mr).err().map(|e| e.0),
        None => Some(mr),
    };
    if let Some(mr) = left {
        mr.release_here();
    }
}
