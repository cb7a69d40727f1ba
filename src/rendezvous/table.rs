//! The matching table: (edge key, step) → a waiting receive, an arrival,
//! or a failure waiting for its receive.
//!
//! Indexed by step, so that ending a step touches only that step's
//! entries, however many other steps have entries (a peer can leave
//! failures for steps that never run here); and it counts what callers
//! must not scan for under the protocol lock: waiting receives per peer
//! (probing), failures per link and in all, and streamed tensors that
//! arrived before their receives, per link, in all and in bytes (their
//! caps). A step's map is
//! kept for reuse when the step empties, so a steady state allocates
//! nothing.

use std::collections::HashMap;
use std::sync::Arc;

use super::{Data, Entry, LinkId, Received};

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
    /// Arrivals assembled from streams (`Data::Owned`, memory of ours a
    /// peer filled) waiting for their receives: the link each came from,
    /// their count per link, in all, and their bytes.
    owned_from: HashMap<(Arc<str>, u64), LinkId>,
    owned_by_link: HashMap<LinkId, usize>,
    owned: usize,
    owned_bytes: u64,
}

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

impl Table {
    /// Count `e` at `(key, step)` in or out.
    fn count(&mut self, key: &Arc<str>, step: u64, e: &Entry, add: bool) {
        if let Entry::Ready(Received { data: Data::Owned(v), .. }) = e {
            if !add {
                if let Some(link) = self.owned_from.remove(&(key.clone(), step)) {
                    bump(&mut self.owned_by_link, link, false);
                    self.owned -= 1;
                    self.owned_bytes = self.owned_bytes.saturating_sub(v.len() as u64);
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
            Entry::Ready(_) | Entry::Cancelled => {}
        }
    }

    pub(super) fn remove(&mut self, key: &Arc<str>, step: u64) -> Option<Entry> {
        let m = self.steps.get_mut(&step)?;
        let e = m.remove(key)?;
        if m.is_empty() {
            self.recycle(step);
        }
        self.count(key, step, &e, false);
        Some(e)
    }

    /// Put `e` at `(key, step)` (the caller removed what was there).
    pub(super) fn insert(&mut self, key: Arc<str>, step: u64, e: Entry) {
        self.count(&key, step, &e, true);
        let spare = &mut self.spare;
        let m = self.steps.entry(step).or_insert_with(|| spare.pop().unwrap_or_default());
        if let Some(old) = m.insert(key.clone(), e) {
            self.count(&key, step, &old, false);
        }
    }

    /// Put a streamed arrival from `link` at `(key, step)` (the caller
    /// removed what was there and checked the caps).
    pub(super) fn insert_owned(&mut self, key: Arc<str>, step: u64, r: Received, link: LinkId) {
        let bytes = match &r.data {
            Data::Owned(v) => Some(v.len() as u64),
            Data::Slot { .. } => None,
        };
        self.insert(key.clone(), step, Entry::Ready(r));
        if let Some(bytes) = bytes {
            self.owned_from.insert((key, step), link);
            bump(&mut self.owned_by_link, link, true);
            self.owned += 1;
            self.owned_bytes = self.owned_bytes.saturating_add(bytes);
        }
    }

    /// Streamed arrivals waiting for receives: from `link`, in all, and
    /// their bytes.
    pub(super) fn owned_by(&self, link: LinkId) -> usize {
        self.owned_by_link.get(&link).copied().unwrap_or(0)
    }

    pub(super) fn owned(&self) -> usize {
        self.owned
    }

    pub(super) fn owned_bytes(&self) -> u64 {
        self.owned_bytes
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
            self.count(&k, step, &e, false);
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
