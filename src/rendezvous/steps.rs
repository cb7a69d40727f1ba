//! How steps end: done here (TensorFlow cleaned the step up), aborted
//! here (told to the peers or not), aborted by a peer, and everything
//! aborted at shutdown. Each fails the step's waiting receives and queued
//! sends, releases its unclaimed arrivals and discards its streams; the
//! last steps ended are remembered (`FINISHED_STEPS_REMEMBERED`), so late
//! pushes for them are dropped.

use super::{stream, Action, Actions, Data, Entry, LinkId, Msg, Rendezvous};
use crate::constants::FINISHED_STEPS_REMEMBERED;
use crate::error::Error;

impl Rendezvous {
    /// Fail every waiting receive matching `pred(peer, step)`, of step
    /// `only_step` if given (then only that step's entries are looked at).
    pub(super) fn fail_waiters(&mut self, only_step: Option<u64>, pred: impl Fn(&str, u64) -> bool, why: &Error) -> Actions {
        let mut acts = Actions::new();
        let tally = &mut self.tally;
        self.table.drain_waiting(only_step, pred, |e| {
            if let Entry::Waiting { done, .. } = e {
                tally.waiters_failed += 1;
                acts.push(Action::Deliver { done, result: Err(why.clone()) });
            }
        });
        acts
    }

    fn mark_finished(&mut self, step: u64) {
        if self.finished_set.insert(step) {
            self.finished.push_back(step);
            while self.finished.len() > FINISHED_STEPS_REMEMBERED {
                if let Some(old) = self.finished.pop_front() {
                    self.finished_set.remove(&old);
                }
            }
        }
    }

    /// Drop the step's unclaimed arrivals and pending work; fail its
    /// waiters and queued sends with `why`, which is built only when
    /// something fails: ending a step with nothing pending (the steady
    /// state) allocates nothing.
    fn end_step(&mut self, step: u64, why: &dyn Fn() -> Error) -> Actions {
        self.mark_finished(step);
        let mut acts = Actions::new();
        if self.table.has_step(step) {
            acts.extend(self.end_step_entries(step, &why()));
        }
        if self.tx.values().any(|t| !t.idle()) {
            let why = why();
            for (link, t) in self.tx.iter_mut() {
                acts.extend(t.fail_step(*link, step, &why, &mut self.tx_ending));
            }
        }
        acts.extend(self.rx_discard_streams(step));
        for reqs in self.unsent_requests.values_mut() {
            reqs.retain(|(_, s)| *s != step);
        }
        acts
    }

    /// `end_step` for the step's entries of the matching table (only
    /// those: the table is indexed by step): waiters fail, unclaimed
    /// arrivals are released, failures waiting for a receive go.
    fn end_step_entries(&mut self, step: u64, why: &Error) -> Actions {
        let mut acts = Actions::new();
        let tally = &mut self.tally;
        self.table.drain_step(step, |_, e| match e {
            Entry::Waiting { done, .. } => {
                tally.waiters_failed += 1;
                acts.push(Action::Deliver { done, result: Err(why.clone()) });
            }
            Entry::Ready(r) => {
                if let Data::Slot { link, slot, gen, .. } = r.data {
                    acts.push(Action::Release { link, slot, gen });
                }
            }
            Entry::Failed { .. } | Entry::Cancelled => {}
        });
        acts
    }

    /// Whether `step` ended here (among the last `FINISHED_STEPS_REMEMBERED`).
    pub fn step_finished(&self, step: u64) -> bool {
        self.finished_set.contains(&step)
    }

    /// The step is over (TF cleaned it up): late pushes for it are dropped.
    pub fn step_done(&mut self, step: u64) -> Actions {
        self.end_step(step, &|| Error::Aborted(format!("step {step} finished before this tensor was received")))
    }

    /// Abort one step: its waiters and queued sends fail with `why`. With
    /// `propagate`, every connected peer is told, so that what it waits on
    /// from us for this step fails too (a push never comes once we abort;
    /// with pulls, the peer's pull would have failed). TensorFlow's normal
    /// end-of-step cleanup must not propagate. Counted once per step
    /// (`aborts_propagated`), however often it is told.
    pub fn abort_step(&mut self, step: u64, why: Error, propagate: bool) -> Actions {
        self.abort_step_caused(step, 0, why, propagate)
    }

    /// `abort_step`, telling peers the TensorFlow error code of the failure
    /// that caused it (`cause`, 0: none): what they wait on from us for the
    /// step then fails with `Error::PeerFailed` of that code.
    pub fn abort_step_caused(&mut self, step: u64, cause: u32, why: Error, propagate: bool) -> Actions {
        let mut acts = Actions::new();
        if propagate {
            if self.propagated.insert(step) {
                self.tally.aborts_propagated += 1;
                self.propagated_order.push_back(step);
                while self.propagated_order.len() > FINISHED_STEPS_REMEMBERED {
                    if let Some(old) = self.propagated_order.pop_front() {
                        self.propagated.remove(&old);
                    }
                }
            }
            let reason = why.to_string();
            for link in self.tx.keys().chain(self.rx.keys()) {
                acts.push(Action::Send { link: *link, msg: Msg::Abort { step, code: cause, reason: reason.clone() } });
            }
        }
        acts.extend(self.end_step(step, &|| why.clone()));
        acts
    }

    /// The peer on `link` aborted `step`: fail our receives of that step
    /// from it (now and later) and our queued sends of it to it.
    pub(super) fn peer_aborted(&mut self, link: LinkId, step: u64, code: u32, reason: String) -> Actions {
        let Some(peer) = self.tx.get(&link).map(|t| t.peer.clone()).or_else(|| self.rx.get(&link).map(|r| r.peer.clone())) else {
            return Actions::new();
        };
        let text = format!("{peer} aborted step {step}: {reason}");
        let why = if code == 0 { Error::Aborted(text) } else { Error::PeerFailed(code, text) };
        let mut acts = self.fail_waiters(Some(step), |p, _| p == peer, &why);
        if let Some(t) = self.tx.get_mut(&link) {
            acts.extend(t.fail_step(link, step, &why, &mut self.tx_ending));
        }
        let k = (self.names.intern(&peer), step);
        if self.peer_aborts.insert(k.clone(), why).is_none() {
            self.tally.aborts_received += 1;
            self.peer_abort_order.push_back(k);
            while self.peer_abort_order.len() > FINISHED_STEPS_REMEMBERED {
                if let Some(old) = self.peer_abort_order.pop_front() {
                    self.peer_aborts.remove(&old);
                }
            }
        }
        acts
    }

    /// Streams that ended with chunks still reading their payload
    /// (tombstones) when the node goes: their `done` runs once the last
    /// chunk lets go (L1: they were dropped unrun).
    fn bury_tombstones(&mut self) {
        stream::bury(&mut self.tx_ending);
    }

    /// Abort everything (server shutdown): every waiter and queued send.
    pub fn abort_all(&mut self, why: Error) -> Actions {
        let mut acts = self.fail_waiters(None, |_, _| true, &why);
        for (link, t) in self.tx.iter_mut() {
            acts.extend(t.fail_pending(*link, &why, &mut self.tx_ending));
        }
        acts
    }
}

impl Drop for Rendezvous {
    fn drop(&mut self) {
        self.bury_tombstones();
    }
}
