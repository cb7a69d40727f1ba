//! The simulated tasks' callbacks and payloads: each counts its runs
//! (`Tracker`), and a payload flags a read after its send's `done`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering as AO};
use std::sync::Arc;

use parking_lot::Mutex;

use super::{flag, Violations};
use crate::completion::Complete;
use crate::error::Result;
use crate::rendezvous::{Payload, Received};

/// Counts each callback's runs: at most once as it goes, exactly once at
/// the end (unless its task crashed).
#[derive(Default)]
pub(super) struct Tracker {
    /// id → (runs, its task, what, runs expected).
    pub(super) runs: Mutex<HashMap<u64, (u32, usize, String, u32)>>,
    next: std::sync::atomic::AtomicU64,
}

impl Tracker {
    pub(super) fn register(&self, node: usize, what: String) -> u64 {
        let id = self.next.fetch_add(1, AO::Relaxed);
        self.runs.lock().insert(id, (0, node, what, 1));
        id
    }
    /// A call that did not start: its callback must never run.
    pub(super) fn never(&self, id: u64) {
        if let Some(e) = self.runs.lock().get_mut(&id) {
            e.3 = 0;
        }
    }
    pub(super) fn ran(&self, id: u64, v: &Violations) {
        let mut g = self.runs.lock();
        if let Some(e) = g.get_mut(&id) {
            e.0 += 1;
            if e.0 > e.3 {
                flag(v, format!("callback {} ran {} times (expected {})", e.2, e.0, e.3));
            }
        }
    }
    /// Node `n` crashed: its callbacks are gone with it.
    pub(super) fn forget(&self, n: usize) {
        self.runs.lock().retain(|_, e| e.1 != n);
    }
}

pub(super) struct SimPayload {
    pub(super) data: Vec<u8>,
    pub(super) freed: Arc<AtomicBool>,
    pub(super) v: Violations,
    pub(super) what: String,
}

impl Payload for SimPayload {
    fn bytes(&self) -> &[u8] {
        if self.freed.load(AO::SeqCst) {
            flag(&self.v, format!("{}: payload read after its done ran", self.what));
        }
        &self.data
    }
}

pub(super) struct SendCb {
    pub(super) id: u64,
    pub(super) t: Arc<Tracker>,
    pub(super) freed: Arc<AtomicBool>,
    pub(super) v: Violations,
}

impl Complete<Result<()>> for SendCb {
    fn complete(self: Box<Self>, _r: Result<()>) {
        self.freed.store(true, AO::SeqCst);
        self.t.ran(self.id, &self.v);
    }
}

/// Calls served and not yet answered: (handle, body).
pub(super) type Pending = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;
/// Receives completed: (node, key, step, outcome).
pub(super) type Got = Arc<Mutex<Vec<(usize, String, u64, Result<Received>)>>>;

pub(super) struct RecvCb {
    pub(super) id: u64,
    pub(super) t: Arc<Tracker>,
    pub(super) v: Violations,
    pub(super) got: Got,
    pub(super) node: usize,
    pub(super) key: String,
    pub(super) step: u64,
}

impl Complete<Result<Received>> for RecvCb {
    fn complete(self: Box<Self>, r: Result<Received>) {
        self.t.ran(self.id, &self.v);
        self.got.lock().push((self.node, self.key.clone(), self.step, r));
    }
}
