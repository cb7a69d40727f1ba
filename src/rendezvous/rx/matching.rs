//! Receives matched to arrivals: a receive made (before or after its
//! tensor), cancelled alone, or failed with its peer; a tensor arrived (in
//! a slot or assembled from a stream) or known never to come. What waits
//! for the other side is bounded per link and per node.

use std::sync::Arc;

use crate::constants::{MAX_FAILED_AHEAD, MAX_FAILED_AHEAD_PER_LINK, MAX_STREAMED_AHEAD, MAX_STREAMED_AHEAD_PER_LINK};
use crate::error::Error;
use crate::rendezvous::{smallvec, Action, Actions, Data, Entry, LinkId, Received, RecvDone, Rendezvous};

impl Rendezvous {
    /// Wait for the tensor `(key, step)` from `peer`.
    pub fn recv(&mut self, peer: &str, key: &str, step: u64, done: RecvDone) -> Actions {
        let k = self.names.intern(key);
        match self.table.remove(&k, step) {
            Some(Entry::Ready(r)) => {
                let mut acts = self.lend(&r);
                acts.push(Action::Deliver { done, result: Ok(r) });
                return acts;
            }
            Some(Entry::Failed { why, .. }) => {
                self.tally.waiters_failed += 1;
                return smallvec![Action::Deliver { done, result: Err(why) }];
            }
            Some(w @ Entry::Waiting { .. }) => {
                self.table.insert(k, step, w);
                return smallvec![Action::Deliver {
                    done,
                    result: Err(Error::InvalidArgument(format!("duplicate receive for {key} in step {step}"))),
                }];
            }
            // The receive made before was cancelled; its tensor may still
            // come: this one waits for it.
            Some(Entry::Cancelled) | None => {}
        }
        if self.finished_set.contains(&step) {
            return smallvec![Action::Deliver { done, result: Err(Error::Aborted(format!("step {step} was aborted"))) }];
        }
        if let Some(why) = self.names.get(peer).and_then(|p| self.peer_aborts.get(&(p, step))) {
            self.tally.waiters_failed += 1;
            return smallvec![Action::Deliver { done, result: Err(why.clone()) }];
        }
        // A lost peer does not fail new receives here: it may have
        // restarted; the caller reconnects (and fails them if it cannot).
        let waiting = Entry::Waiting { peer: self.names.intern(peer), done };
        self.table.insert(k, step, waiting);
        if self.params.rpc {
            return self.request(peer, key, step);
        }
        Actions::new()
    }

    /// Cancel the receive of `(key, step)` alone (the step goes on): it
    /// completes with `why` now, if it still waits. Its tensor, should it
    /// arrive later, is released at once. Nothing is told to the peer.
    pub fn cancel_recv(&mut self, key: &str, step: u64, why: Error) -> Actions {
        let Some(k) = self.names.get(key) else {
            return Actions::new();
        };
        match self.table.remove(&k, step) {
            Some(Entry::Waiting { done, .. }) => {
                self.tally.receives_cancelled += 1;
                self.table.insert(k, step, Entry::Cancelled);
                smallvec![Action::Deliver { done, result: Err(why) }]
            }
            // Completed already (or never made): nothing to cancel.
            Some(e) => {
                self.table.insert(k, step, e);
                Actions::new()
            }
            None => Actions::new(),
        }
    }

    /// Whether receives wait on `peer`.
    pub fn waits_on(&self, peer: &str) -> bool {
        self.table.waits_on(peer)
    }

    /// Fail the receives waiting on `peer` with `why`, remembering nothing
    /// (the peer may be reached later: a route chosen late).
    pub fn fail_waiting_on(&mut self, peer: &str, why: &Error) -> Actions {
        if !self.table.waits_on(peer) {
            return Actions::new();
        }
        self.fail_waiters(None, |p, _| p == peer, why)
    }

    /// Fail the receives waiting on `peer` (it is unreachable).
    pub fn peer_unreachable(&mut self, peer: &str, why: Error) -> Actions {
        if self.peer_connected(peer) {
            return Actions::new();
        }
        self.lost.insert(peer.to_string(), why.clone());
        self.unsent_requests.remove(peer);
        if !self.table.waits_on(peer) {
            return Actions::new();
        }
        self.fail_waiters(None, |p, _| p == peer, &why)
    }

    /// A tensor from `from` arrived. One assembled from a stream (memory
    /// of ours, filled by the peer) may wait for its receive only within
    /// `MAX_STREAMED_AHEAD_PER_LINK` per link and `MAX_STREAMED_AHEAD` in
    /// the node (and its bytes count against `MAX_STREAM_TOTAL`); the link
    /// that would pass them fails.
    pub(in crate::rendezvous) fn arrive(&mut self, key: Arc<str>, step: u64, r: Received, from: LinkId) -> Actions {
        self.tally.tensors_received += 1;
        self.tally.bytes_received += match &r.data {
            Data::Slot { len, .. } => *len,
            Data::Owned(v) => v.len() as u64,
        };
        if self.finished_set.contains(&step) {
            self.tally.dropped_late += 1;
            return match r.data {
                Data::Slot { link, slot, gen, .. } => smallvec![Action::Release { link, slot, gen }],
                Data::Owned(_) => Actions::new(),
            };
        }
        match self.table.remove(&key, step) {
            Some(Entry::Waiting { done, .. }) => {
                let mut acts = self.lend(&r);
                acts.push(Action::Deliver { done, result: Ok(r) });
                acts
            }
            Some(Entry::Ready(old)) => {
                // Two arrivals for one (edge, step): the sender is broken.
                let why = Error::Protocol(format!("second tensor for {key} in step {step}"));
                self.table.insert(key, step, Entry::Ready(old));
                let link = match r.data { Data::Slot { link, .. } => Some(link), _ => None };
                link.map(|link| smallvec![Action::Close { link, why }]).unwrap_or_default()
            }
            Some(Entry::Cancelled) => {
                // Its receive was cancelled: nobody takes it.
                self.tally.dropped_late += 1;
                match r.data {
                    Data::Slot { link, slot, gen, .. } => smallvec![Action::Release { link, slot, gen }],
                    Data::Owned(_) => Actions::new(),
                }
            }
            None | Some(Entry::Failed { .. }) => {
                if matches!(r.data, Data::Owned(_)) {
                    let (mine, all) = (self.table.owned_by(from), self.table.owned());
                    if mine >= MAX_STREAMED_AHEAD_PER_LINK || all >= MAX_STREAMED_AHEAD {
                        let why = Error::ResourceExhausted(format!(
                            "{mine} streamed tensors from this link ({all} in all) wait for receives that were not made: \
                             at most {MAX_STREAMED_AHEAD_PER_LINK} per link and {MAX_STREAMED_AHEAD} per node"
                        ));
                        return smallvec![Action::Close { link: from, why }];
                    }
                    self.table.insert_owned(key, step, r, from);
                } else {
                    self.table.insert(key, step, Entry::Ready(r));
                }
                Actions::new()
            }
        }
    }

    /// A tensor from `link` will not come (refused, abandoned): its receive
    /// fails, now or when it is made. Such failures wait for receives (of
    /// steps that may never run here) at most `MAX_FAILED_AHEAD_PER_LINK`
    /// from one link and `MAX_FAILED_AHEAD` in the node; the link that
    /// would pass either fails (so one hostile peer cannot use up the
    /// node's room and have every other peer's next refusal close its link).
    pub(in crate::rendezvous) fn fail_receive(&mut self, link: LinkId, key: &str, step: u64, why: Error) -> Actions {
        let k = self.names.intern(key);
        match self.table.remove(&k, step) {
            Some(Entry::Waiting { done, .. }) => {
                self.tally.waiters_failed += 1;
                smallvec![Action::Deliver { done, result: Err(why) }]
            }
            Some(ready @ Entry::Ready(_)) => {
                self.table.insert(k, step, ready);
                Actions::new()
            }
            // Its receive was cancelled and the tensor will not come now.
            Some(Entry::Cancelled) => Actions::new(),
            None | Some(Entry::Failed { .. }) => {
                if self.finished_set.contains(&step) {
                    return Actions::new();
                }
                let (mine, all) = (self.table.failed_by(link), self.table.failed());
                if mine >= MAX_FAILED_AHEAD_PER_LINK || all >= MAX_FAILED_AHEAD {
                    let why = Error::ResourceExhausted(format!(
                        "{mine} refused or abandoned tensors from this link ({all} in all) wait for receives that were never made: \
                         at most {MAX_FAILED_AHEAD_PER_LINK} per link and {MAX_FAILED_AHEAD} per node"
                    ));
                    return smallvec![Action::Close { link, why }];
                }
                self.table.insert(k, step, Entry::Failed { why, link });
                Actions::new()
            }
        }
    }

}
