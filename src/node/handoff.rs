//! The node's callback thread (`rdev-callbacks`): work that a backend's
//! event thread (shm progress and reader threads, the verbs progress
//! thread) must not do itself is handed over to it:
//! - TensorFlow's callbacks (a receive's or a send's completion), which run
//!   application code that may call back into the transport;
//! - writes started by an event (a queued send that a credit or a publish
//!   released), which copy the tensor (shm) or register its memory (verbs).
//!
//! One thread per node, a [`Pool`] (crate::pool) fed by an unbounded
//! queue of actions (handing over never blocks), so callbacks keep the
//! order in which the events produced them. Each job runs inside
//! `catch_unwind`: a panicking callback is logged and the thread goes on.
//! The thread ends when the node is gone and its queue is drained (actions
//! left for a gone node fail: `abandon`).

use std::sync::Weak;

use super::Inner;
use crate::pool::Pool;
use crate::rendezvous::{smallvec, Action};

/// Actions the queue has room for before it first grows.
const QUEUE_START: usize = 64;

pub(super) struct Handoff {
    /// The thread (none if it could not start: jobs then run on the caller).
    pool: Pool<Action>,
    node: Weak<Inner>,
}

impl Handoff {
    pub(super) fn start(node: Weak<Inner>) -> Handoff {
        // Room for bursts from the start; it grows (amortised) past that.
        let n = node.clone();
        let pool = Pool::start("rdev-callbacks", 1, QUEUE_START, move |a| run_one(&n, a));
        if pool.threads() == 0 {
            log::error!("no rdev-callbacks thread: the transport does not start");
        }
        Handoff { pool, node }
    }

    /// Did the thread start? (`Node::new` fails without it: callbacks must
    /// never run on the thread that hands them over.)
    pub(super) fn started(&self) -> bool {
        self.pool.threads() > 0
    }

    /// Queue `a` for the node's `exec`; never blocks (the queue keeps its
    /// capacity, so a steady state allocates nothing). Never runs it on
    /// the calling thread, which may hold a caller's lock that `a` takes
    /// (a TF cancellation callback's mutex): out of memory for the queue,
    /// it goes to a thread of its own (so it may run out of the queue's
    /// order; still exactly once); only if no thread can start either
    /// does it run here (logged).
    pub(super) fn run(&self, a: Action) {
        let Err(a) = self.pool.push(a) else {
            return;
        };
        if !self.started() {
            return run_one(&self.node, a);
        }
        log::error!("rdev-callbacks: a callback runs on a thread of its own");
        let slot = std::sync::Arc::new(parking_lot::Mutex::new(Some(a)));
        let (s, n) = (slot.clone(), self.node.clone());
        let spawned = std::thread::Builder::new().name("rdev-callbacks-spill".into()).spawn(move || {
            if let Some(a) = s.lock().take() {
                let _ = crate::error::catch_panic("a spilled callback", || run_one(&n, a));
            }
        });
        if spawned.is_err() {
            log::error!("rdev-callbacks: no thread for a spilled callback either; it runs on the calling thread");
            if let Some(a) = slot.lock().take() {
                run_one(&self.node, a);
            }
        }
    }
}

fn run_one(node: &Weak<Inner>, a: Action) {
    match node.upgrade() {
        Some(n) => n.exec(smallvec![a]),
        None => super::abandon(a),
    }
}
