//! Placing edges ahead of their first tensor: a sender asks its receiver
//! to place an edge (`place_ahead`), or asks another task to do so on its
//! behalf (`request_placement`, for graphs partitioned in one process and
//! run in others), and serves such requests from peers (`place_for`).
//!
//! Threads and waits: `place_ahead` and `request_placement` block their
//! caller up to the connect timeout plus the given timeout (the shim calls
//! them from its own pool only); a peer not yet added, or whose route is
//! being chosen, is waited for within the same deadline (peers.rs:
//! `ensure_tx`). `place_for` runs `place_ahead` on the bounded `rdev-place`
//! pool, never on the progress thread that read the request.

use std::time::Duration;

use super::Inner;
use crate::error::{Error, Result};
use crate::fabric::ConnId;

impl Inner {
    /// Sender side: have `peer` place `key` for `bytes` now, before the
    /// first step, and wait (up to `timeout`) until it has. Returns whether
    /// the edge is placed (false: the receiver had no room; the edge will
    /// use the slower path).
    pub(super) fn place_ahead(&self, peer: &str, key: &str, bytes: u64, timeout: Duration) -> Result<bool> {
        use crate::rendezvous::Placement;
        let deadline = std::time::Instant::now() + timeout;
        let link = self.ensure_tx(peer, Some(deadline))?;
        let mut seen = *self.progress.0.lock();
        let acts = self.locked(|r| r.place_ahead(link, key, bytes));
        self.exec(acts);
        loop {
            match self.locked(|r| r.placement(link, key)) {
                Placement::Placed(cap) if cap >= bytes => return Ok(true),
                Placement::NoSpace => return Ok(false),
                Placement::LinkLost => return Err(Error::PeerLost(format!("connection to {peer} lost while placing {key}"))),
                _ if std::time::Instant::now() >= deadline => {
                    return Err(Error::Timeout(format!("{peer} did not place {key} within {timeout:?}")))
                }
                _ => seen = self.wait_progress(seen, deadline),
            }
        }
    }

    pub(super) fn request_placement(&self, sender: &str, receiver: &str, key: &str, bytes: u64, timeout: Duration) -> Result<bool> {
        if sender == self.task {
            return self.place_ahead(receiver, key, bytes, timeout);
        }
        let link = self.ensure_tx(sender, Some(std::time::Instant::now() + timeout))?;
        static NEXT_REQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let req = NEXT_REQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = std::sync::mpsc::channel();
        self.placing.lock().insert(req, tx);
        let msg = crate::rendezvous::Msg::PlaceFor { req, receiver: receiver.to_string(), key: key.to_string(), bytes };
        if let Err(e) = self.send_msg(link, &msg) {
            self.placing.lock().remove(&req);
            return Err(e);
        }
        let answer = rx.recv_timeout(timeout);
        self.placing.lock().remove(&req);
        match answer {
            Ok((0, _)) => Ok(true),
            Ok((1, _)) => Ok(false),
            Ok((_, e)) => Err(Error::NotViable(format!("{sender} could not place {key} towards {receiver}: {e}"))),
            Err(_) => Err(Error::Timeout(format!("{sender} did not place {key} within {timeout:?}"))),
        }
    }

    /// A peer asks us to place an edge we send: do it on the `rdev-place`
    /// pool (it waits for the receiver) and answer on the same link.
    ///
    /// A peer may have at most `MAX_PLACEMENTS_PER_LINK` of them queued or
    /// running: one asking for more fails its link (each may wait for a
    /// connect, and the pool is shared). A job whose link has failed since
    /// it was queued is skipped, so a failed link's requests drain at once.
    pub(super) fn place_for(&self, link: ConnId, req: u64, receiver: String, key: String, bytes: u64) {
        {
            let mut q = self.placing_for.lock();
            use crate::constants::{MAX_PLACEMENTS_PER_LINK, MAX_PLACEMENTS_PER_NODE};
            let all: usize = q.values().sum();
            let n = q.entry(link).or_insert(0);
            if *n >= MAX_PLACEMENTS_PER_LINK || all >= MAX_PLACEMENTS_PER_NODE {
                let error = format!(
                    "{}: {} placements asked by this peer ({all} by all) are under way; at most {MAX_PLACEMENTS_PER_LINK} per peer \
                     and {MAX_PLACEMENTS_PER_NODE} in all: {key} is placed on first use instead",
                    self.task, *n
                );
                if *n == 0 {
                    q.remove(&link);
                }
                drop(q);
                log::warn!("{error}");
                if let Err(e) = self.send_msg(link, &crate::rendezvous::Msg::PlaceDone { req, outcome: 2, error }) {
                    self.fail_link(link, Error::PeerLost(format!("{}: placement refusal not sent: {}", self.task, e.message())));
                }
                return;
            }
            *n += 1;
        }
        let me = self.me.clone();
        super::pool::PLACE.schedule(move || {
            let Some(n) = me.upgrade() else { return };
            let _done = PlacedFor { node: &n, link };
            if !n.links.lock().contains_key(&link) {
                return;
            }
            let timeout = Duration::from_millis(n.cfg.connect_timeout_ms);
            // The task that asks may know `receiver` before this one has
            // been told of it (tasks add their peers as they start): wait
            // for it, within the same bound, rather than fail at random.
            let placed = crate::error::catch_panic("rdev-place", || {
                let deadline = std::time::Instant::now() + timeout;
                n.wait_for_peer(&receiver, deadline)?;
                n.place_ahead(&receiver, &key, bytes, deadline.saturating_duration_since(std::time::Instant::now()))
            })
            .and_then(|r| r);
            let (outcome, error) = match placed {
                Ok(true) => (0, String::new()),
                Ok(false) => (1, String::new()),
                Err(e) => (2, e.to_string()),
            };
            if let Err(e) = n.send_msg(link, &crate::rendezvous::Msg::PlaceDone { req, outcome, error }) {
                log::debug!("{}: placement answer not sent: {e}", n.task);
            }
        });
    }

    /// Wait until `peer` has been added (`add_peer`), at most until
    /// `deadline` (on the `rdev-place` pool only).
    fn wait_for_peer(&self, peer: &str, deadline: std::time::Instant) -> Result<()> {
        // At most half the pool waits for peers not yet added: requests
        // naming a task this one is never told of cannot hold every
        // rdev-place thread for the connect timeout each.
        static WAITING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        const MAX_WAITING: usize = 2;
        struct Slot;
        impl Drop for Slot {
            fn drop(&mut self) {
                WAITING.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
        if self.peers.table.lock().contains_key(peer) {
            return Ok(());
        }
        if WAITING.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= MAX_WAITING {
            WAITING.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            return Err(Error::InvalidArgument(format!(
                "{}: asked to place an edge towards {peer}, which this task was not told of (add_peer), \
                 while {MAX_WAITING} other placements already wait for their receivers",
                self.task
            )));
        }
        let _slot = Slot;
        let mut t = self.peers.table.lock();
        while !t.contains_key(peer) {
            if self.peers.added.wait_until(&mut t, deadline).timed_out() && !t.contains_key(peer) {
                return Err(Error::InvalidArgument(format!(
                    "{}: asked to place an edge towards {peer}, which this task was not told of (add_peer) in time",
                    self.task
                )));
            }
        }
        Ok(())
    }

    pub(super) fn placement_answered(&self, req: u64, outcome: u32, error: String) {
        if let Some(tx) = self.placing.lock().remove(&req) {
            let _ = tx.send((outcome, error));
        }
    }
}

/// One `place_for` job's share of its link's count, given back when the
/// job ends however it ends.
struct PlacedFor<'a> {
    node: &'a Inner,
    link: ConnId,
}

impl Drop for PlacedFor<'_> {
    fn drop(&mut self) {
        let mut q = self.node.placing_for.lock();
        if let Some(n) = q.get_mut(&self.link) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                q.remove(&self.link);
            }
        }
    }
}
