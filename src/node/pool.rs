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
//! Each pool is a fixed number of named threads, started on first use and
//! kept for the process's life, with an unbounded queue in front: queueing
//! never blocks. Every job runs inside `catch_unwind`, so a panicking job is
//! logged and the thread goes on serving. Jobs bound their own waits (every
//! connect and placement has a deadline), so a queue always drains. Two
//! pools rather than one: a burst of placements (up to one per edge of a
//! graph) never delays a connect that queued sends wait for.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

pub(super) type Job = Box<dyn FnOnce() + Send>;

/// A fixed set of named threads with a queue (see the module docs).
pub(super) struct Pool {
    name: &'static str,
    threads: usize,
    tx: OnceLock<Mutex<Sender<Job>>>,
}

/// Connects (and the sends queued behind them) and peer watches.
pub(super) static CONNECT: Pool = Pool::new("rdev-connect", 4);
/// Choosing peers' routes (routes.rs): a name lookup and a probe each,
/// every peer of a cluster at once. Apart from `CONNECT`, whose connects
/// wait for routes being chosen.
pub(super) static ROUTE: Pool = Pool::new("rdev-route", 8);
/// Placements on another task's behalf.
pub(super) static PLACE: Pool = Pool::new("rdev-place", 4);
/// Chunk writes and copies of streamed tensors: at most STREAM_SLOTS of
/// each per link are queued at once.
pub(super) static STREAM: Pool = Pool::new("rdev-stream", 4);

impl Pool {
    const fn new(name: &'static str, threads: usize) -> Pool {
        Pool { name, threads, tx: OnceLock::new() }
    }

    fn sender(&self) -> &Mutex<Sender<Job>> {
        self.tx.get_or_init(|| {
            let (tx, rx) = channel::<Job>();
            let rx = Arc::new(Mutex::new(rx));
            for i in 0..self.threads {
                let rx = rx.clone();
                let name = self.name;
                if let Err(e) = std::thread::Builder::new().name(format!("{name}-{i}")).spawn(move || serve(name, rx)) {
                    log::error!("cannot start a {name} thread: {e}");
                }
            }
            Mutex::new(tx)
        })
    }

    /// Queue `job`; never blocks. If no thread of the pool could be
    /// started at all, the job runs on the caller's thread (logged).
    pub(super) fn schedule(&self, job: impl FnOnce() + Send + 'static) {
        let job: Job = Box::new(job);
        let refused = self.sender().lock().send(job);
        if let Err(e) = refused {
            log::error!("{} has no thread; running a job on the caller's thread", self.name);
            run_one(self.name, e.0);
        }
    }
}

/// One job on a pool thread: a panic is caught and logged, the thread
/// goes on.
pub(super) fn run_one(name: &str, job: Job) {
    if catch_unwind(AssertUnwindSafe(job)).is_err() {
        log::error!("a {name} job panicked (its waiters fail by their deadlines)");
    }
}

fn serve(name: &'static str, rx: Arc<Mutex<Receiver<Job>>>) {
    loop {
        // Only the thread taking the next job holds the lock.
        let next = rx.lock().recv();
        match next {
            Ok(job) => run_one(name, job),
            Err(_) => return,
        }
    }
}
