//! The setup thread (`rdev-verbs-setup`): work that pins memory or may
//! otherwise take long, handed over by threads that must not do it: the
//! progress thread (which must never block) and `Listener::grant` (which
//! runs under the node's protocol lock). Its jobs: a connection's bring-up
//! on either side (opening the device, which registers its shared receive
//! buffers; the connection's own buffers; without memory windows, the
//! whole arena), and registering a chunk of an arena on the first grant
//! in it. One thread for the process, FIFO, fed by an unbounded queue
//! (handing over never blocks); each job runs inside `catch_unwind`.

use std::sync::mpsc::{channel, Sender};
use std::sync::OnceLock;

use parking_lot::Mutex;

type Job = Box<dyn FnOnce() + Send>;

static QUEUE: OnceLock<Option<Mutex<Sender<Job>>>> = OnceLock::new();

/// Run `job` on the setup thread (here, logged, if it cannot start).
pub(crate) fn spawn(job: impl FnOnce() + Send + 'static) {
    let q = QUEUE.get_or_init(|| {
        let (tx, rx) = channel::<Job>();
        let spawned = std::thread::Builder::new().name("rdev-verbs-setup".into()).spawn(move || {
            while let Ok(job) = rx.recv() {
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                    log::error!("verbs: a job panicked on rdev-verbs-setup; the thread goes on");
                }
            }
        });
        match spawned {
            Ok(_) => Some(Mutex::new(tx)),
            Err(e) => {
                log::error!("verbs: cannot start rdev-verbs-setup ({e}): registrations run on the caller's thread");
                None
            }
        }
    });
    let left = match q {
        Some(tx) => tx.lock().send(Box::new(job)).err().map(|e| e.0),
        None => Some(Box::new(job) as Job),
    };
    if let Some(job) = left {
        job();
    }
}
