//! Caller-driven progress: a thread about to wait for a receive delivers
//! the writes that land meanwhile itself, instead of parking at once and
//! being woken by an event thread that a sender's doorbell woke first.
//!
//! [`Poller::spin_until`] polls every listener (`Listener::poll`) for a
//! bounded window, with the rings marked "awake" so that senders ring no
//! doorbell while it does. A write that lands in the window costs no
//! thread wake-up at all: the waiting thread delivers it, and the receive
//! it completes is its own. What has not landed by the end of the window
//! goes the usual way (the event thread, then the waiter's condvar).
//!
//! The window: `RDMA_DEVICE_POLL_US` (0: never poll), stretched to twice
//! the last wait's length while that stays under `MAX_ADAPTIVE_SPIN_US`
//! (a steady ping-pong keeps polling across its gaps; a long wait gains
//! nothing from it). Each pass yields the core (`sched_yield`), so a
//! polling thread never holds back a runnable thread of the computation
//! on an oversubscribed host; on a host with idle cores it only uses one
//! that would idle.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use super::Inner;
use crate::constants::MAX_ADAPTIVE_SPIN_US;
use crate::fabric::Listener;
use crate::stats::Stats;

/// A node's caller-driven progress, held by a waitable receive. Keeps no
/// node alive: after the node is gone it polls nothing.
pub struct Poller {
    node: Weak<Inner>,
}

/// The current polling window of a node, in nanoseconds.
#[derive(Default)]
pub(super) struct Window(AtomicU64);

impl Poller {
    pub(super) fn new(node: &Arc<Inner>) -> Poller {
        Poller { node: Arc::downgrade(node) }
    }

    /// Poll until `done()` holds or the window passes; returns `done()`.
    /// The caller holds no lock of the node's.
    pub fn spin_until(&self, done: impl Fn() -> bool) -> bool {
        if done() {
            return true;
        }
        let Some(node) = self.node.upgrade() else { return false };
        let window = node.poll_window();
        if window.is_zero() {
            return false;
        }
        let listeners: SmallVec<[Arc<dyn Listener>; 2]> = node.listeners.lock().values().cloned().collect();
        drop(node);
        for l in &listeners {
            l.start_polling();
        }
        let start = Instant::now();
        let mut delivered = 0;
        let ok = loop {
            for l in &listeners {
                delivered += l.poll();
            }
            if done() {
                break true;
            }
            if start.elapsed() >= window {
                break false;
            }
            std::thread::yield_now();
        };
        for l in &listeners {
            l.stop_polling();
        }
        if delivered > 0 {
            Stats::global().c.polled_writes.fetch_add(delivered as u64, Relaxed);
        }
        ok || done()
    }

    /// A wait that began at `start` got its outcome now: adapt the window.
    pub fn waited(&self, start: Instant) {
        if let Some(node) = self.node.upgrade() {
            node.adapt_poll_window(start.elapsed());
        }
    }
}

impl Inner {
    fn poll_window(&self) -> Duration {
        if self.cfg.poll_us == 0 {
            return Duration::ZERO;
        }
        match self.poll_window.0.load(Relaxed) {
            0 => Duration::from_micros(self.cfg.poll_us),
            ns => Duration::from_nanos(ns),
        }
    }

    fn adapt_poll_window(&self, waited: Duration) {
        let base = Duration::from_micros(self.cfg.poll_us);
        let max = Duration::from_micros(MAX_ADAPTIVE_SPIN_US).max(base);
        let w = if waited < max { (waited * 2).clamp(base, max) } else { base };
        self.poll_window.0.store(w.as_nanos() as u64, Relaxed);
    }
}

impl super::Node {
    /// Caller-driven progress for a thread that will wait on this node.
    pub fn poller(&self) -> Poller {
        Poller::new(&self.inner)
    }
}
