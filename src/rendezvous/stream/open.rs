//! A receiver's open streams from one sender, indexed for what the
//! protocol asks of them under its lock: their bytes (the node's stream
//! limit sums one number per link, not every stream) and their steps
//! (ending a step looks only at the links that have a stream in it).

use std::collections::HashMap;

use super::rx::RxStream;

#[derive(Default)]
pub(in crate::rendezvous) struct RxStreams {
    map: HashMap<u32, RxStream>,
    /// Open streams per step.
    steps: HashMap<u64, usize>,
    /// Sum of their totals.
    bytes: u64,
}

impl RxStreams {
    pub(in crate::rendezvous) fn insert(&mut self, id: u32, s: RxStream) {
        *self.steps.entry(s.step).or_insert(0) += 1;
        self.bytes = self.bytes.saturating_add(s.total);
        if let Some(old) = self.map.insert(id, s) {
            self.forget(&old);
        }
    }

    pub(in crate::rendezvous) fn remove(&mut self, id: &u32) -> Option<RxStream> {
        let s = self.map.remove(id)?;
        self.forget(&s);
        Some(s)
    }

    fn forget(&mut self, s: &RxStream) {
        self.bytes = self.bytes.saturating_sub(s.total);
        if let Some(n) = self.steps.get_mut(&s.step) {
            *n -= 1;
            if *n == 0 {
                self.steps.remove(&s.step);
            }
        }
    }

    pub(in crate::rendezvous) fn get_mut(&mut self, id: &u32) -> Option<&mut RxStream> {
        self.map.get_mut(id)
    }

    pub(in crate::rendezvous) fn len(&self) -> usize {
        self.map.len()
    }

    pub(in crate::rendezvous) fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(in crate::rendezvous) fn has_step(&self, step: u64) -> bool {
        self.steps.contains_key(&step)
    }

    /// Remove the streams of `step`, handing each id to `f`.
    pub(in crate::rendezvous) fn drain_step(&mut self, step: u64, mut f: impl FnMut(u32)) {
        if !self.has_step(step) {
            return;
        }
        let ids: Vec<u32> = self.map.iter().filter(|(_, s)| s.step == step).map(|(id, _)| *id).collect();
        for id in ids {
            self.remove(&id);
            f(id);
        }
    }

    pub(in crate::rendezvous) fn iter(&self) -> impl Iterator<Item = (&u32, &RxStream)> {
        self.map.iter()
    }
}
