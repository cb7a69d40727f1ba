//! The deregistration thread (`rdev-verbs-dereg`): writes sent from
//! registered user memory finish here when their completion arrives on the
//! progress thread, because `ibv_dereg_mr` unpins every page of the region
//! and can take long for a large one. One thread for the process, fed by an
//! unbounded queue (handing over never blocks); it unpins, drops the
//! write's memory and then runs its callback, in completion order.

use std::sync::mpsc::{channel, Sender};
use std::sync::OnceLock;

use parking_lot::Mutex;

use super::super::conn::Finished;

static QUEUE: OnceLock<Option<Mutex<Sender<Finished>>>> = OnceLock::new();

/// Finish `f` on the deregistration thread (here if it cannot start).
pub(crate) fn later(f: Finished) {
    let q = QUEUE.get_or_init(|| {
        let (tx, rx) = channel::<Finished>();
        let spawned = std::thread::Builder::new().name("rdev-verbs-dereg".into()).spawn(move || {
            while let Ok(f) = rx.recv() {
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f.run())).is_err() {
                    log::error!("verbs: a write's completion panicked on rdev-verbs-dereg; the thread goes on");
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
        Some(tx) => tx.lock().send(f).err().map(|e| e.0),
        None => Some(f),
    };
    if let Some(f) = left {
        f.run();
    }
}
