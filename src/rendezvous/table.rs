//! The matching table: (edge key, step) → a waiting receive, an arrival,
//! or a failure waiting for its receive.
//!
//! Indexed by step, so that ending a step touches only that step's
//! entries, however many other steps have entries (a peer can leave
//! failures for steps that never run here); and it counts what callers
//! must not scan for under the protocol lock: waiting receives per peer
//! (probing), failures per link and in all (their caps). A step's map is
//! kept for reuse when the step empties, so a steady state allocates
//! nothing.

use std::collections::HashMap;
use std::sync::Arc;

use super::{Entry, LinkId};

/// Emptied per-step maps kept for reuse (steps in flight at once, at most).
const SPARE_MAPS: usize = 64;

#[derive(Default)]
pub(super) struct Table {
    steps: HashMap<u64, HashMap<Arc<str>, Entry>>,
    spare: Vec<HashMap<Arc<str>, Entry>>,
    /// Waiting receives by the peer they wait on.
    waiting: HashMap<Arc<str>, usize>,
    /// `Entry::Failed`s by the link whose tensor failed.
    failed_by_link: HashMap<LinkId, usize>,
    failed: usize,
}

impl Table {
    fn count(&mut self, e: &Entry, add: bool) {
        fn bump<K: std::hash::Hash + Eq>(m: &mut HashMap<K, usize>, k: K, add: bool) {
            if add {
                *m.entry(k).or_insert(0) += 1;
            } else if let Some(n) = m.get_mut(&k) {
                *n -= 1;
                if *n == 0 {
                    m.remove(&k);
                }
            }
        }
        match e {
            Entry::Waiting { peer, .. } => bump(&mut self.waiting, peer.clone(), add),
            Entry::Failed { link, .. } => {
                bump(&mut self.failed_by_link, *link, add);
                if add {
                    self.failed += 1;
                } else {
                    self.failed -= 1;
                }
            }
            Entry::Ready(_) => {}
        }
    }

    pub(super) fn remove(&mut self, key: &Arc<str>, step: u64) -> Option<Entry> {
        let m = self.steps.get_mut(&step)?;
        let e = m.remove(key)?;
        if m.is_empty() {
            self.recycle(step);
        }
        self.count(&e, false);
        Some(e)
    }

    /// Put `e` at `(key, step)` (the caller removed what was there).
    pub(super) fn insert(&mut self, key: Arc<str>, step: u64, e: Entry) {
        self.count(&e, true);
        let spare = &mut self.spare;
        let m = self.steps.entry(step).or_insert_with(|| spare.pop().unwrap_or_default());
        if let Some(old) = m.insert(key, e) {
            self.count(&old, false);
        }
    }

    fn recycle(&mut self, step: u64) {
        if let Some(m) = self.steps.remove(&step) {
            if self.spare.len() < SPARE_MAPS && m.is_empty() {
                self.spare.push(m);
            }
        }
    }

    pub(super) fn has_step(&self, step: u64) -> bool {
        self.steps.contains_key(&step)
    }

    /// Remove every entry of `step`, handing each to `f`.
    pub(super) fn drain_step(&mut self, step: u64, mut f: impl FnMut(Arc<str>, Entry)) {
        let Some(mut m) = self.steps.remove(&step) else { return };
        for (k, e) in m.drain() {
            self.count(&e, false);
            f(k, e);
        }
        if self.spare.len() < SPARE_MAPS {
            self.spare.push(m);
        }
    }

    /// Remove the waiting receives for which `pred(peer, step)` holds, in
    /// `only_step` if given (else all steps), handing each to `f`.
    pub(super) fn drain_waiting(&mut self, only_step: Option<u64>, pred: impl Fn(&str, u64) -> bool, mut f: impl FnMut(Entry)) {
        let steps: Vec<u64> = match only_step {
            Some(s) => vec![s],
            None if self.waiting.is_empty() => return,
            None => self.steps.keys().copied().collect(),
        };
        for step in steps {
            let Some(m) = self.steps.get_mut(&step) else { continue };
            let keys: Vec<Arc<str>> = m.iter().filter(|(_, e)| matches!(e, Entry::Waiting { peer, .. } if pred(peer, step))).map(|(k, _)| k.clone()).collect();
            for k in keys {
                if let Some(e) = self.remove(&k, step) {
                    f(e);
                }
            }
        }
    }

    /// Does some receive wait on `peer`?
    pub(super) fn waits_on(&self, peer: &str) -> bool {
        self.waiting.contains_key(peer)
    }

    /// Peers some receive waits on (interned: one `Arc` per name).
    pub(super) fn waiting_peers(&self) -> impl Iterator<Item = &Arc<str>> {
        self.waiting.keys()
    }

    /// `Entry::Failed`s in all, and those `link` left.
    pub(super) fn failed(&self) -> usize {
        self.failed
    }

    pub(super) fn failed_by(&self, link: LinkId) -> usize {
        self.failed_by_link.get(&link).copied().unwrap_or(0)
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = ((&Arc<str>, u64), &Entry)> {
        self.steps.iter().flat_map(|(s, m)| m.iter().map(move |(k, e)| ((k, *s), e)))
    }
}
