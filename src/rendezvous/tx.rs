//! The sender's half: per receiver link, the published slots of each edge
//! (which are free), queued sends, and the outstanding-write budget.
//! Streamed tensors (the sender's part) are in `stream/tx.rs`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use super::records::Pending;
use super::stream::{TxStreams, STREAM_KEY};
use super::stream::Ending;
use super::{smallvec, Actions, Action, LinkId, Payload, Rendezvous, SendDone};
use crate::constants::{HEADER_BYTES, MAX_DIMS};
use crate::error::{Error, Result};
use crate::rendezvous::wire::{Msg, SlotDesc, SlotHeader, TensorMeta};

/// State of an edge's placement, seen from the sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    None,
    Pending,
    /// Placed; the largest slot holds this many bytes.
    Placed(u64),
    /// The receiver had no room: the edge's tensors are streamed.
    NoSpace,
    LinkLost,
}

#[derive(Default)]
pub(super) struct TxEdge {
    pub(super) edge_id: Option<u32>,
    /// The current set: (slot, free?). Slots not free are with the receiver.
    pub(super) slots: Vec<(SlotDesc, bool)>,
    awaiting_publish: bool,
    /// Sizes at or above this are streamed (the receiver had no room).
    stream_from: Option<u64>,
    /// A `More` request is out.
    more_pending: bool,
    /// The receiver cannot add slots: while none is free, stream.
    no_more: bool,
    pending: VecDeque<Pending>,
    /// rpc mode: steps whose receive has requested this edge's tensor.
    pub(super) requested: HashSet<u64>,
}

pub(super) struct TxLink {
    pub(super) peer: String,
    pub(super) edges: HashMap<Arc<str>, TxEdge>,
    by_id: HashMap<u32, Arc<str>>,
    outstanding: usize,
    /// Sends queued over all edges, and outstanding rpc-mode requests:
    /// when both are 0 (the steady state), ending a step need not look at
    /// any edge (no O(edges) scan per step under the protocol lock).
    queued: usize,
    pub(super) requests: usize,
    /// Streamed tensors under way.
    pub(super) streams: TxStreams,
}

impl TxLink {
    pub(super) fn describe(&self) -> String {
        let mut o = format!("outstanding {}{}", self.outstanding, self.streams.describe());
        for (k, e) in &self.edges {
            o.push_str(&format!(
                "\n  edge {k} id {:?} awaiting {} stream_from {:?} pending steps {:?} slots {:?}",
                e.edge_id,
                e.awaiting_publish,
                e.stream_from,
                e.pending.iter().map(|p| (p.step, p.payload.bytes().len())).collect::<Vec<_>>(),
                e.slots.iter().map(|(s, f)| (s.id, s.gen, s.capacity, *f)).collect::<Vec<_>>()
            ));
        }
        o
    }

    fn drain_pending(&mut self, pred: impl Fn(&Pending) -> bool, why: &Error) -> Actions {
        let mut acts = Actions::new();
        for e in self.edges.values_mut() {
            if e.pending.is_empty() {
                continue;
            }
            let (fail, keep): (VecDeque<Pending>, VecDeque<Pending>) = e.pending.drain(..).partition(|p| pred(p));
            e.pending = keep;
            self.queued = self.queued.saturating_sub(fail.len());
            acts.extend(fail.into_iter().map(|p| Action::SendDone { done: p.done, result: Err(why.clone()) }));
        }
        acts
    }

    pub(super) fn fail_all(self, link: LinkId, why: &Error, ending: &mut Ending) -> Actions {
        let mut s = self;
        s.fail_pending(link, why, ending)
    }

    /// Nothing queued, requested or streaming: ending a step has nothing
    /// to fail here.
    pub(super) fn idle(&self) -> bool {
        self.queued == 0 && self.requests == 0 && self.streams.is_empty()
    }

    /// Writes started and not completed.
    pub(super) fn outstanding(&self) -> usize {
        self.outstanding
    }

    pub(super) fn fail_pending(&mut self, link: LinkId, why: &Error, ending: &mut Ending) -> Actions {
        let mut acts = self.drain_pending(|_| true, why);
        acts.extend(self.streams.fail(link, false, |_| true, why, ending));
        acts
    }

    /// Fail the step's queued sends and its streams under way (the
    /// receiver is told, so it frees the stream's buffer).
    pub(super) fn fail_step(&mut self, link: LinkId, step: u64, why: &Error, ending: &mut Ending) -> Actions {
        let mut acts = Actions::new();
        if self.requests > 0 {
            for e in self.edges.values_mut() {
                if e.requested.remove(&step) {
                    self.requests -= 1;
                }
            }
        }
        if self.queued > 0 {
            acts.extend(self.drain_pending(|p| p.step == step, why));
        }
        acts.extend(self.streams.fail(link, true, |s| s.step == step, why, ending));
        acts
    }
}

/// Take the edge's first queued send (the caller saw one): it leaves the
/// link's count of queued sends and, in rpc mode, of requests.
fn take_front(e: &mut TxEdge, queued: &mut usize, requests: &mut usize, tally: &mut super::Tally) -> Pending {
    let p = e.pending.pop_front().expect("the caller saw a queued send");
    *queued = queued.saturating_sub(1);
    if e.requested.remove(&p.step) {
        *requests = requests.saturating_sub(1);
        tally.requests_served += 1;
    }
    p
}

impl Rendezvous {
    /// We connected to `peer` as a sender on `link`.
    pub fn add_tx_link(&mut self, link: LinkId, peer: &str) {
        self.lost.remove(peer);
        self.tx.insert(
            link,
            TxLink { peer: peer.to_string(), edges: HashMap::new(), by_id: HashMap::new(), outstanding: 0, queued: 0, requests: 0, streams: TxStreams::default() },
        );
    }

    pub fn has_tx_link(&self, link: LinkId) -> bool {
        self.tx.contains_key(&link)
    }

    /// Push a tensor for `(key, step)` to the receiver on `link`.
    pub fn send(
        &mut self,
        link: LinkId,
        key: &str,
        step: u64,
        meta: TensorMeta,
        payload: Box<dyn Payload>,
        done: SendDone,
    ) -> Actions {
        if self.finished_set.contains(&step) {
            return smallvec![Action::SendDone { done, result: Err(Error::Aborted(format!("step {step} was aborted"))) }];
        }
        if key == STREAM_KEY {
            return smallvec![Action::SendDone { done, result: Err(Error::InvalidArgument("reserved rendezvous key".into())) }];
        }
        let Some(t) = self.tx.get_mut(&link) else {
            let why = self.lost_reason(link);
            return smallvec![Action::SendDone { done, result: Err(why) }];
        };
        let p = Pending { step, meta, payload, done };
        // The edge's key is copied only the first time it is used.
        match t.edges.get_mut(key) {
            Some(e) => e.pending.push_back(p),
            None => t.edges.entry(Arc::from(key)).or_default().pending.push_back(p),
        }
        t.queued += 1;
        self.pump(link, key)
    }

    fn lost_reason(&self, link: LinkId) -> Error {
        Error::PeerLost(format!("connection {link} to the receiver is closed"))
    }

    /// Start every queued send of `key` that can start now.
    pub(super) fn pump(&mut self, link: LinkId, key: &str) -> Actions {
        if key == STREAM_KEY {
            return self.pump_streams(link);
        }
        let max = self.params.max_outstanding_writes;
        let incarnation = self.params.incarnation;
        let rpc = self.params.rpc;
        let mut acts = Actions::new();
        let Some(t) = self.tx.get_mut(&link) else { return acts };
        let Some(e) = t.edges.get_mut(key) else { return acts };
        loop {
            if rpc {
                // Only requested tensors go out, in request-arrival order
                // of their sends; the others wait for their request.
                match e.pending.iter().position(|p| e.requested.contains(&p.step)) {
                    Some(0) => {}
                    Some(i) => {
                        let p = e.pending.remove(i).expect("index from position");
                        e.pending.push_front(p);
                    }
                    None => break,
                }
            }
            let Some(front) = e.pending.front() else { break };
            if e.awaiting_publish {
                break;
            }
            let len = front.payload.bytes().len() as u64;
            let streams = front.meta.dims.len() > MAX_DIMS || e.stream_from.is_some_and(|n| len >= n);
            if streams {
                let p = take_front(e, &mut t.queued, &mut t.requests, &mut self.tally);
                acts.extend(t.streams.begin(link, key, p, &mut self.tally));
                continue;
            }
            if t.outstanding >= max {
                break;
            }
            // Smallest free slot that fits.
            let best = e
                .slots
                .iter()
                .enumerate()
                .filter(|(_, (s, free))| *free && s.capacity >= len)
                .min_by_key(|(_, (s, _))| s.capacity)
                .map(|(i, _)| i);
            if let Some(i) = best {
                let p = take_front(e, &mut t.queued, &mut t.requests, &mut self.tally);
                e.slots[i].1 = false;
                let s = e.slots[i].0;
                let header = SlotHeader {
                    edge_id: e.edge_id.unwrap_or(0),
                    slot: s.id,
                    gen: s.gen,
                    incarnation,
                    step: p.step,
                    len,
                    meta: p.meta,
                    chunk: None,
                };
                t.outstanding += 1;
                self.tally.tensors_pushed += 1;
                self.tally.bytes_pushed += len;
                acts.push(Action::Write { link, offset: s.offset, key: s.key, header, payload: p.payload, imm: s.id, done: p.done, bytes: len });
                continue;
            }
            if e.slots.iter().any(|(s, _)| s.capacity >= len) {
                // Every slot that fits is busy: with the receiver, maybe lent
                // to an application that keeps the tensor. Ask for one more
                // slot rather than count on a credit; if none can be added,
                // this tensor is streamed.
                if e.no_more {
                    let p = take_front(e, &mut t.queued, &mut t.requests, &mut self.tally);
                    acts.extend(t.streams.begin(link, key, p, &mut self.tally));
                    continue;
                }
                if !e.more_pending {
                    if let Some(edge_id) = e.edge_id {
                        e.more_pending = true;
                        self.tally.negotiation_messages += 1;
                        acts.push(Action::Send { link, msg: Msg::More { edge_id, need: len } });
                    }
                }
                break;
            }
            // Nothing fits (first use or growth): hand back what we hold and
            // ask the receiver to place the edge for this size.
            let returned: Vec<(u32, u32)> = e.slots.iter().filter(|(_, free)| *free).map(|(s, _)| (s.id, s.gen)).collect();
            e.slots.clear();
            e.awaiting_publish = true;
            self.tally.negotiation_messages += 1;
            acts.push(Action::Send { link, msg: Msg::Announce { key: key.to_string(), step: front.step, need: len, returned } });
            break;
        }
        acts
    }

    pub(super) fn tx_publish(&mut self, link: LinkId, key: String, edge_id: u32, slots: Vec<SlotDesc>) -> Result<Actions> {
        let t = self.tx.get_mut(&link).ok_or_else(|| Error::Internal("publish on unknown link".into()))?;
        let key: Arc<str> = match t.edges.get_key_value(key.as_str()) {
            Some((k, _)) => k.clone(),
            None => Arc::from(key),
        };
        let e = t.edges.entry(key.clone()).or_default();
        let mut acts = Actions::new();
        // Free slots of the old set that the new set drops go back.
        for (s, free) in e.slots.drain(..) {
            if free && !slots.iter().any(|n| n.id == s.id && n.gen == s.gen) {
                acts.push(Action::Send { link, msg: Msg::ReturnSlot { slot: s.id, gen: s.gen } });
            }
        }
        if let Some(old) = e.edge_id.replace(edge_id) {
            if old != edge_id {
                t.by_id.remove(&old);
            }
        }
        t.by_id.insert(edge_id, key.clone());
        e.slots = slots.into_iter().map(|s| (s, true)).collect();
        e.awaiting_publish = false;
        e.more_pending = false;
        e.stream_from = None;
        acts.extend(self.pump(link, &key));
        Ok(acts)
    }

    pub(super) fn tx_credit(&mut self, link: LinkId, edge_id: u32, slot: u32, gen: u32) -> Result<Actions> {
        let t = self.tx.get_mut(&link).ok_or_else(|| Error::Internal("credit on unknown link".into()))?;
        let key = t.by_id.get(&edge_id).cloned();
        let hit = key.as_ref().and_then(|k| t.edges.get_mut(k)).and_then(|e| {
            if e.awaiting_publish {
                return None;
            }
            e.slots.iter_mut().find(|(s, free)| s.id == slot && s.gen == gen && !*free)
        });
        match (hit, key) {
            (Some(entry), Some(key)) => {
                entry.1 = true;
                if let Some(e) = self.tx.get_mut(&link).and_then(|t| t.edges.get_mut(&key)) {
                    e.no_more = false;
                    e.more_pending = false;
                }
                Ok(self.pump(link, &key))
            }
            // A credit for a slot we no longer use (the edge was re-placed
            // while the credit was in flight): give it back for good.
            _ => Ok(smallvec![Action::Send { link, msg: Msg::ReturnSlot { slot, gen } }]),
        }
    }

    pub(super) fn tx_nospace(&mut self, link: LinkId, key: String, need: u64) -> Result<Actions> {
        let t = self.tx.get_mut(&link).ok_or_else(|| Error::Internal("nospace on unknown link".into()))?;
        if let Some(e) = t.edges.get_mut(key.as_str()) {
            log::info!("receiver has no arena room for {need} bytes of {key}; streaming it");
            e.awaiting_publish = false;
            e.stream_from = Some(need);
        }
        Ok(self.pump(link, &key))
    }

    /// Sender side, ahead of the first step: ask the receiver to place `key`
    /// for `need` bytes now (static placement). Nothing is sent when the
    /// edge already has a slot that fits or a placement is in flight.
    pub fn place_ahead(&mut self, link: LinkId, key: &str, need: u64) -> Actions {
        let Some(t) = self.tx.get_mut(&link) else { return Actions::new() };
        let e = t.edges.entry(Arc::from(key)).or_default();
        if e.awaiting_publish || e.slots.iter().any(|(s, _)| s.capacity >= need) {
            return Actions::new();
        }
        let returned: Vec<(u32, u32)> = e.slots.iter().filter(|(_, free)| *free).map(|(s, _)| (s.id, s.gen)).collect();
        e.slots.clear();
        e.awaiting_publish = true;
        self.tally.negotiation_messages += 1;
        smallvec![Action::Send { link, msg: Msg::Announce { key: key.to_string(), step: super::STEP_AHEAD, need, returned } }]
    }

    /// Where the placement of `key` on `link` stands.
    pub fn placement(&self, link: LinkId, key: &str) -> Placement {
        let Some(t) = self.tx.get(&link) else { return Placement::LinkLost };
        match t.edges.get(key) {
            None => Placement::None,
            Some(e) if e.awaiting_publish => Placement::Pending,
            Some(e) if e.stream_from.is_some() && e.slots.is_empty() => Placement::NoSpace,
            Some(e) => Placement::Placed(e.slots.iter().map(|(s, _)| s.capacity).max().unwrap_or(0)),
        }
    }

    /// One more slot for an edge. Taken only if the edge is still the
    /// placement it was asked for (not re-placed or revoked since);
    /// otherwise it goes straight back.
    pub(super) fn tx_grow(&mut self, link: LinkId, edge_id: u32, slot: SlotDesc) -> Result<Actions> {
        let t = self.tx.get_mut(&link).ok_or_else(|| Error::Internal("grow on unknown link".into()))?;
        let key = t.by_id.get(&edge_id).cloned();
        let e = key.as_ref().and_then(|k| t.edges.get_mut(k));
        match (e, key) {
            (Some(e), Some(key)) if e.more_pending && !e.awaiting_publish && !e.slots.is_empty() => {
                e.more_pending = false;
                e.slots.push((slot, true));
                Ok(self.pump(link, &key))
            }
            _ => Ok(smallvec![Action::Send { link, msg: Msg::ReturnSlot { slot: slot.id, gen: slot.gen } }]),
        }
    }

    pub(super) fn tx_nomore(&mut self, link: LinkId, edge_id: u32) -> Result<Actions> {
        let t = self.tx.get_mut(&link).ok_or_else(|| Error::Internal("nomore on unknown link".into()))?;
        let Some(key) = t.by_id.get(&edge_id).cloned() else { return Ok(Actions::new()) };
        if let Some(e) = t.edges.get_mut(&key) {
            e.more_pending = false;
            e.no_more = true;
        }
        Ok(self.pump(link, &key))
    }

    /// The receiver wants an idle edge's slots back (its arena is full).
    /// Hand them back if the edge is idle here too; the next send of the
    /// edge places it again.
    pub(super) fn tx_revoke(&mut self, link: LinkId, edge_id: u32) -> Result<Actions> {
        let t = self.tx.get_mut(&link).ok_or_else(|| Error::Internal("revoke on unknown link".into()))?;
        let Some(key) = t.by_id.get(&edge_id).cloned() else { return Ok(Actions::new()) };
        let Some(e) = t.edges.get_mut(&key) else { return Ok(Actions::new()) };
        if !e.pending.is_empty() || e.awaiting_publish || e.slots.iter().any(|(_, free)| !*free) {
            return Ok(Actions::new());
        }
        let acts = e.slots.drain(..).map(|(s, _)| Action::Send { link, msg: Msg::ReturnSlot { slot: s.id, gen: s.gen } }).collect();
        Ok(acts)
    }

    /// A write on `link` completed (either way): frees budget for queued sends.
    pub fn write_done(&mut self, link: LinkId) -> Actions {
        let Some(t) = self.tx.get_mut(&link) else { return Actions::new() };
        let was_full = t.outstanding >= self.params.max_outstanding_writes;
        t.outstanding = t.outstanding.saturating_sub(1);
        if !was_full {
            return Actions::new();
        }
        let keys: Vec<Arc<str>> = t.edges.iter().filter(|(_, e)| !e.pending.is_empty()).map(|(k, _)| k.clone()).collect();
        keys.iter().flat_map(|k| self.pump(link, k)).collect()
    }
}

const _: () = assert!(HEADER_BYTES % 64 == 0);
