//! The pacing thread (`rdev-rpc-pace`, one per node, started by the first
//! large body): sends the parts of call and reply bodies past their first
//! `rpc::DIRECT_PARTS`, each only while its link's backlog is under
//! `rpc::PACE_BACKLOG` (rpc.rs). It waits for nothing but room: while a
//! body is stalled behind a full link it looks again every millisecond,
//! and a link that takes none of a body's parts for `rpc::PACE_TIMEOUT`
//! fails. Idle, it sleeps until the next body comes.

use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::rpc::Pace;
use super::Inner;

#[derive(Default)]
struct State {
    /// A thread runs (it ends only with the node).
    running: bool,
    /// Bodies were deferred since the thread last looked.
    kicked: bool,
}

#[derive(Default)]
pub(super) struct Pacer {
    state: Arc<(Mutex<State>, Condvar)>,
}

/// How long a stalled round waits before it looks again.
const STALLED_WAIT: Duration = Duration::from_millis(1);
/// How long an idle thread sleeps between checks that its node still
/// exists (a deferred body wakes it at once).
const IDLE_WAIT: Duration = Duration::from_secs(1);

impl Pacer {
    /// A body was deferred: wake the thread, starting it the first time.
    pub(super) fn kick(&self, node: &Weak<Inner>) {
        let mut g = self.state.0.lock();
        g.kicked = true;
        self.state.1.notify_one();
        if g.running {
            return;
        }
        let (state, weak) = (self.state.clone(), node.clone());
        let spawned = std::thread::Builder::new().name("rdev-rpc-pace".into()).spawn(move || run(&state, &weak));
        match spawned {
            Ok(_) => g.running = true,
            Err(e) => {
                // Nothing sends the deferred parts: fail what waits for them.
                drop(g);
                log::error!("cannot start the rdev-rpc-pace thread ({e}): large calls and replies fail");
                if let Some(n) = node.upgrade() {
                    n.rpc_fail_paced();
                }
            }
        }
    }
}

fn run(state: &(Mutex<State>, Condvar), node: &Weak<Inner>) {
    loop {
        let Some(n) = node.upgrade() else { return };
        let round = crate::error::catch_panic("pacing large bodies", || n.rpc_pace());
        drop(n);
        let wait = match round {
            Ok(Pace::Progress) => continue,
            Ok(Pace::Stalled) => STALLED_WAIT,
            Ok(Pace::Idle) => IDLE_WAIT,
            Err(_) => {
                log::error!("pacing large bodies panicked; pacing goes on");
                STALLED_WAIT
            }
        };
        let mut g = state.0.lock();
        if !g.kicked {
            state.1.wait_for(&mut g, wait);
        }
        g.kicked = false;
    }
}
