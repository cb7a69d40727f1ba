//! The receiver's half: per sender link, edges and their slots in the
//! arena; arrivals matched to receives; credits; re-placement. Streamed
//! tensors (the receiver's part) are in `stream.rs`.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::records::{RxEdge, RxSlot, Token};
use super::stream::{RxStreams, STREAM_KEY};
use super::{smallvec, Actions, Action, Data, Entry, LinkId, Received, RecvDone, Rendezvous};
use crate::constants::{
    HEADER_BYTES, MAX_EDGES_PER_LINK, MAX_EDGES_PER_NODE, MAX_FAILED_AHEAD, MAX_FAILED_AHEAD_PER_LINK, MAX_STREAMED_AHEAD, MAX_STREAMED_AHEAD_PER_LINK,
};
use crate::error::{Error, Result};
use crate::rendezvous::wire::{Msg, SlotDesc, SlotHeader};

/// Read access to slot headers in the arena (the caller owns the memory).
pub trait SlotMemory {
    /// The `HEADER_BYTES` at `offset` (zeros, which fail to decode, when
    /// the range is outside the memory).
    fn header(&self, offset: u64) -> [u8; HEADER_BYTES];
}

pub(super) struct RxLink {
    pub(super) peer: String,
    incarnation: u64,
    edges: HashMap<String, u32>,
    pub(super) edge_info: HashMap<u32, RxEdge>,
    pub(super) slots: HashMap<u32, RxSlot>,
    pub(super) next_slot: u32,
    pub(super) next_edge: u32,
    /// Streams under way from this sender, by id.
    pub(super) streams: RxStreams,
    /// The highest stream id begun. The sender numbers its streams in
    /// order, but its threads send their `StreamBegin`s as they go, so one
    /// may overtake another: the ids it skipped wait in `unbegun` and may
    /// each be begun once, later (at most `MAX_STREAMS_OVERTAKEN`).
    pub(super) last_stream: u32,
    pub(super) unbegun: HashSet<u32>,
    /// Ids whose `StreamCancel` overtook their `StreamBegin` (not yet
    /// begun): the begin, when it comes, allocates nothing and fails its
    /// receive (at most `MAX_STREAMS_OVERTAKEN`).
    pub(super) cancelled_unbegun: HashSet<u32>,
    /// The edge holding this link's stream slots (not in `edges`: no key
    /// of the sender's can name it).
    pub(super) stream_edge: Option<u32>,
}

impl RxLink {
    pub(super) fn describe(&self) -> String {
        let mut o = String::new();
        for (id, e) in &self.edge_info {
            o.push_str(&format!("\n  edge {id} {} set {:?}", e.key, e.set));
        }
        let mut ids: Vec<_> = self.slots.keys().collect();
        ids.sort();
        for id in ids {
            let s = &self.slots[id];
            o.push_str(&format!("\n  slot {id} edge {} gen {} cap {} {:?} retired {}", s.edge_id, s.gen, s.capacity, s.token, s.retired));
        }
        o.push_str(&super::stream::describe_rx(&self.streams));
        o
    }
}

impl RxLink {
    /// A new slot of `edge_id` at `off` (`reserved` bytes, header
    /// included), its token with the sender, granted to the sender on
    /// `link` (before the Publish or Grow naming it goes out; see
    /// `Granter`). Returns what that message names.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new_slot(
        &mut self,
        link: LinkId,
        edge_id: u32,
        off: u64,
        reserved: u64,
        next_gen: &mut u32,
        granter: &Option<std::sync::Arc<dyn super::Granter>>,
        refused: &mut Vec<(LinkId, Error)>,
    ) -> SlotDesc {
        let id = self.next_slot;
        self.next_slot = self.next_slot.wrapping_add(1).max(1);
        let gen = *next_gen;
        *next_gen = next_gen.wrapping_add(1).max(1);
        let capacity = reserved - HEADER_BYTES as u64;
        self.slots.insert(id, RxSlot { edge_id, gen, offset: off, reserved, capacity, token: Token::AtSender, retired: false, lent: false });
        let key = super::grant(granter, refused, link, off, reserved);
        SlotDesc { id, gen, offset: off, capacity, key }
    }
}

/// Are all slots of the edge's current set with us and lent out?
fn all_lent(r: &RxLink, edge_id: u32) -> bool {
    r.edge_info.get(&edge_id).is_some_and(|e| {
        !e.set.is_empty() && e.set.iter().all(|id| r.slots.get(id).is_some_and(|s| s.token == Token::AtReceiver && s.lent))
    })
}

impl Rendezvous {
    /// May a sender calling itself `peer` open one more incoming link? At
    /// most `MAX_RX_LINKS_PER_PEER` from one task, all its lives together
    /// (a sender chooses the incarnation its hello claims, so counting per
    /// life would let it open two links per made-up life), and
    /// `MAX_RX_LINKS` from all (L3: many links must not take a node-wide
    /// budget). Check and `add_rx_link` under one lock.
    pub fn admit_rx_link(&self, peer: &str) -> Result<()> {
        use crate::constants::{MAX_RX_LINKS, MAX_RX_LINKS_PER_PEER};
        let from_peer = self.rx.values().filter(|r| r.peer == peer).count();
        if from_peer >= MAX_RX_LINKS_PER_PEER {
            return Err(Error::ResourceExhausted(format!(
                "{peer} already has {from_peer} connections to this task (at most {MAX_RX_LINKS_PER_PEER}); \
                 its earlier ones must end first"
            )));
        }
        if self.rx.len() >= MAX_RX_LINKS {
            return Err(Error::ResourceExhausted(format!("this task has {} incoming connections (at most {MAX_RX_LINKS})", self.rx.len())));
        }
        Ok(())
    }

    /// A sender `peer` (in life `incarnation`) connected to us on `link`.
    pub fn add_rx_link(&mut self, link: LinkId, peer: &str, incarnation: u64) {
        self.lost.remove(peer);
        self.rx.insert(
            link,
            RxLink {
                peer: peer.to_string(),
                incarnation,
                edges: HashMap::new(),
                edge_info: HashMap::new(),
                slots: HashMap::new(),
                next_slot: 1,
                next_edge: 1,
                streams: RxStreams::default(),
                last_stream: 0,
                unbegun: HashSet::new(),
                cancelled_unbegun: HashSet::new(),
                stream_edge: None,
            },
        );
    }

    /// Is some link to or from `peer` up?
    pub fn peer_connected(&self, peer: &str) -> bool {
        self.rx.values().any(|r| r.peer == peer) || self.tx.values().any(|t| t.peer == peer)
    }

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

    /// Did a connection with `peer` break since the last one was made?
    pub fn is_lost(&self, peer: &str) -> bool {
        self.lost.contains_key(peer)
    }

    /// Fail the receives waiting on `peer` (it is unreachable).
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
    pub(super) fn arrive(&mut self, key: Arc<str>, step: u64, r: Received, from: LinkId) -> Actions {
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
    pub(super) fn fail_receive(&mut self, link: LinkId, key: &str, step: u64, why: Error) -> Actions {
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

    /// A write landed in slot `imm` of `link`.
    pub fn on_write_imm(&mut self, link: LinkId, imm: u32, mem: &dyn SlotMemory) -> Actions {
        let Some(r) = self.rx.get_mut(&link) else {
            self.tally.rejected_writes += 1;
            return Actions::new();
        };
        let Some(s) = r.slots.get_mut(&imm) else {
            self.tally.rejected_writes += 1;
            let why = Error::Protocol(format!("write into unknown slot {imm}"));
            return smallvec![Action::Close { link, why }];
        };
        if s.token != Token::AtSender {
            self.tally.rejected_writes += 1;
            let why = Error::Protocol(format!("write into slot {imm}, which the sender does not own"));
            return smallvec![Action::Close { link, why }];
        }
        let h = match SlotHeader::decode(&mem.header(s.offset)) {
            Ok(h) => h,
            Err(e) => {
                self.tally.rejected_writes += 1;
                return smallvec![Action::Close { link, why: e }];
            }
        };
        if h.incarnation != r.incarnation || h.gen != s.gen {
            // A write stamped with another life of the peer or an earlier
            // placement of the slot: the writer does not follow the
            // protocol, so nothing else it writes can be trusted either.
            self.tally.rejected_writes += 1;
            let why = Error::Protocol(format!(
                "stale write into slot {imm} (generation {} vs {}, incarnation {:#x} vs {:#x})",
                h.gen, s.gen, h.incarnation, r.incarnation
            ));
            return smallvec![Action::Close { link, why }];
        }
        if h.slot != imm || h.edge_id != s.edge_id || h.len > s.capacity || h.chunk.is_some() != (r.stream_edge == Some(s.edge_id)) {
            self.tally.rejected_writes += 1;
            let why = Error::Protocol(format!(
                "slot {imm}: header names slot {} edge {} with {} bytes{} (slot has edge {}, {} bytes{})",
                h.slot, h.edge_id, h.len, if h.chunk.is_some() { ", a stream chunk" } else { "" },
                s.edge_id, s.capacity, if r.stream_edge == Some(s.edge_id) { ", a stream slot" } else { "" }
            ));
            return smallvec![Action::Close { link, why }];
        }
        if let Some(c) = h.chunk {
            let (gen, offset) = (s.gen, s.offset);
            return self.rx_chunk(link, imm, gen, offset, h.step, h.len, c);
        }
        s.token = Token::AtReceiver;
        self.clock += 1;
        let key = match r.edge_info.get_mut(&s.edge_id) {
            Some(e) => {
                e.last_used = self.clock;
                e.key.clone()
            }
            None => Arc::from(""),
        };
        let data = Data::Slot { link, slot: imm, gen: s.gen, offset: s.offset + HEADER_BYTES as u64, len: h.len };
        self.arrive(key, h.step, Received { meta: h.meta, data }, link)
    }

    /// The application is done with an arrival: the slot goes back to the
    /// sender (credit), or to the arena if the edge was re-placed.
    pub fn release(&mut self, link: LinkId, slot: u32, gen: u32) -> Actions {
        let Some(r) = self.rx.get_mut(&link) else {
            // The link is gone; its slots were freed except this one.
            if let Some((off, reserved)) = self.orphans.remove(&(link, slot, gen)) {
                self.alloc.free(off, reserved);
            }
            return Actions::new();
        };
        let Some(s) = r.slots.get_mut(&slot) else { return Actions::new() };
        if s.gen != gen || s.token != Token::AtReceiver {
            return Actions::new();
        }
        if s.retired {
            let s = r.slots.remove(&slot).expect("present");
            self.alloc.free(s.offset, s.reserved);
            return Actions::new();
        }
        s.token = Token::AtSender;
        s.lent = false;
        self.tally.credits_sent += 1;
        smallvec![Action::Send { link, msg: Msg::Credit { edge_id: s.edge_id, slot, gen } }]
    }

    /// Place `key` on `link` for `need` payload bytes; publish the slots.
    /// `returned`: free slots the sender gave back.
    pub(super) fn rx_announce(
        &mut self,
        link: LinkId,
        key: String,
        step: u64,
        need: u64,
        returned: Vec<(u32, u32)>,
    ) -> Result<Actions> {
        let n = self.params.slots_per_edge;
        if key == STREAM_KEY {
            return Err(Error::Protocol("Announce for the reserved stream edge".into()));
        }
        let r = self.rx.get_mut(&link).ok_or_else(|| Error::Internal("announce on unknown link".into()))?;
        for (id, gen) in returned {
            if r.slots.get(&id).is_some_and(|s| s.gen == gen && s.token == Token::AtSender) {
                let s = r.slots.remove(&id).expect("present");
                self.alloc.free(s.offset, s.reserved);
            }
        }
        let edge_id = match r.edges.get(&key) {
            Some(id) => {
                self.tally.replacements += 1;
                *id
            }
            None if self.alloc.slot_bytes(need).is_none() => {
                // Nothing to place, so no edge to remember (a peer cannot
                // grow our edges and names with refused Announces).
                log::warn!("{key}: {need} bytes cannot fit a receive arena of {} bytes; it is streamed through the link's stream slots", self.alloc.total());
                return Ok(smallvec![Action::Send { link, msg: Msg::NoSpace { key, need } }]);
            }
            None => {
                let all = self.rx_edges.saturating_add(1);
                if r.edges.len() >= MAX_EDGES_PER_LINK || all > MAX_EDGES_PER_NODE {
                    return Err(Error::ResourceExhausted(format!(
                        "{} announced edge {} ({key}); at most {MAX_EDGES_PER_LINK} per sender and {MAX_EDGES_PER_NODE} in all ({} now) are kept",
                        r.peer,
                        r.edges.len() + 1,
                        self.rx_edges
                    )));
                }
                self.rx_edges = all;
                if step == super::STEP_AHEAD {
                    self.tally.edges_static += 1;
                } else {
                    self.tally.edges_traced += 1;
                }
                let id = r.next_edge;
                r.next_edge += 1;
                r.edges.insert(key.clone(), id);
                r.edge_info.insert(id, RxEdge { key: self.names.intern(&key), set: Vec::new(), last_used: self.clock, revoking: false, more_wanted: None });
                id
            }
        };
        // Whatever remains of the old set is retired: slots with us are
        // freed on release, slots with the sender when it returns them.
        let old = std::mem::take(&mut r.edge_info.get_mut(&edge_id).expect("edge").set);
        for id in old {
            if let Some(s) = r.slots.get_mut(&id) {
                s.retired = true;
            }
        }
        // `need` is the peer's: a size that cannot fit the arena at all
        // (or overflows with the header) is refused like a full arena.
        let Some(reserved) = self.alloc.slot_bytes(need) else {
            log::warn!("{key}: {need} bytes cannot fit a receive arena of {} bytes; it is streamed through the link's stream slots", self.alloc.total());
            return Ok(smallvec![Action::Send { link, msg: Msg::NoSpace { key, need } }]);
        };
        let mut placed = Vec::new();
        for _ in 0..n {
            match self.alloc.alloc(reserved) {
                Some(off) => placed.push(off),
                None => break,
            }
        }
        if placed.is_empty() {
            let mut acts = self.reclaim_cold(link, edge_id, reserved);
            log::warn!(
                "receive arena full ({} of {} bytes placed): {key} ({need} bytes) is streamed through the link's stream slots; raise RDMA_DEVICE_ARENA_BYTES to avoid this",
                self.alloc.in_use(),
                self.alloc.total()
            );
            acts.push(Action::Send { link, msg: Msg::NoSpace { key, need } });
            return Ok(acts);
        }
        let mut descs = Vec::new();
        for off in placed {
            descs.push(r.new_slot(link, edge_id, off, reserved, &mut self.next_gen, &self.granter, &mut self.refused));
        }
        r.edge_info.get_mut(&edge_id).expect("edge").set = descs.iter().map(|d| d.id).collect();
        self.tally.negotiation_messages += 1;
        Ok(smallvec![Action::Send { link, msg: Msg::Publish { key, edge_id, slots: descs } }])
    }

    /// An arrival goes to the application: its slot is lent. If the sender
    /// wanted another slot and now every slot of the edge is lent, add it.
    fn lend(&mut self, r: &Received) -> Actions {
        let Data::Slot { link, slot, .. } = r.data else { return Actions::new() };
        let Some(rx) = self.rx.get_mut(&link) else { return Actions::new() };
        let Some(s) = rx.slots.get_mut(&slot) else { return Actions::new() };
        s.lent = true;
        let edge_id = s.edge_id;
        let Some(e) = rx.edge_info.get(&edge_id) else { return Actions::new() };
        match e.more_wanted {
            Some(need) if all_lent(rx, edge_id) => {
                rx.edge_info.get_mut(&edge_id).expect("edge").more_wanted = None;
                self.rx_more(link, edge_id, need).unwrap_or_default()
            }
            _ => Actions::new(),
        }
    }

    /// Every slot of `edge_id` is busy at our end. If they are all lent to
    /// the application (which may keep them indefinitely), add one for
    /// `need` bytes; if some merely wait to be taken, we are just behind:
    /// the sender gets a credit soon, or the slot once they are all lent.
    pub(super) fn rx_more(&mut self, link: LinkId, edge_id: u32, need: u64) -> Result<Actions> {
        let r = self.rx.get_mut(&link).ok_or_else(|| Error::Internal("more on unknown link".into()))?;
        if !r.edge_info.contains_key(&edge_id) || r.stream_edge == Some(edge_id) {
            return Err(Error::Protocol(format!("More for unknown edge {edge_id}")));
        }
        if !all_lent(r, edge_id) {
            r.edge_info.get_mut(&edge_id).expect("edge").more_wanted = Some(need);
            return Ok(Actions::new());
        }
        let e = r.edge_info.get(&edge_id).expect("edge");
        let cap = e.set.iter().filter_map(|id| r.slots.get(id)).map(|s| s.capacity).max().unwrap_or(0).max(need);
        let Some(reserved) = self.alloc.slot_bytes(cap) else {
            return Ok(smallvec![Action::Send { link, msg: Msg::NoMore { edge_id } }]);
        };
        let off = if e.set.len() < crate::constants::MAX_SLOTS_PER_EDGE { self.alloc.alloc(reserved) } else { None };
        let Some(off) = off else {
            let mut acts = self.reclaim_cold(link, edge_id, reserved);
            acts.push(Action::Send { link, msg: Msg::NoMore { edge_id } });
            return Ok(acts);
        };
        let slot = r.new_slot(link, edge_id, off, reserved, &mut self.next_gen, &self.granter, &mut self.refused);
        r.edge_info.get_mut(&edge_id).expect("edge exists").set.push(slot.id);
        self.tally.negotiation_messages += 1;
        Ok(smallvec![Action::Send { link, msg: Msg::Grow { edge_id, slot } }])
    }

    pub(super) fn rx_return(&mut self, link: LinkId, slot: u32, gen: u32) -> Result<Actions> {
        let r = self.rx.get_mut(&link).ok_or_else(|| Error::Internal("return on unknown link".into()))?;
        if r.slots.get(&slot).is_some_and(|s| s.gen == gen && s.token == Token::AtSender) {
            let s = r.slots.remove(&slot).expect("present");
            if let Some(e) = r.edge_info.get_mut(&s.edge_id) {
                e.set.retain(|id| *id != slot);
                if e.revoking {
                    self.tally.slots_reclaimed += 1;
                    if e.set.is_empty() {
                        e.revoking = false;
                    }
                }
            }
            self.alloc.free(s.offset, s.reserved);
        }
        Ok(Actions::new())
    }

    /// The arena is full: ask senders to give back the slots of the
    /// least recently used idle edges (all slots with the sender), enough
    /// to hold `want` bytes, never `except` on `except_link`.
    /// Stream slots are never reclaimed (a stream may need them at once).
    pub(super) fn reclaim_cold(&mut self, except_link: LinkId, except: u32, want: u64) -> Actions {
        let mut cands: Vec<(u64, LinkId, u32, u64)> = Vec::new();
        for (l, r) in &self.rx {
            for (id, e) in &r.edge_info {
                if (*l == except_link && *id == except) || e.revoking || e.set.is_empty() || r.stream_edge == Some(*id) {
                    continue;
                }
                let idle = e.set.iter().all(|s| r.slots.get(s).is_some_and(|s| s.token == Token::AtSender && !s.retired));
                if idle {
                    let bytes = e.set.iter().filter_map(|s| r.slots.get(s)).map(|s| s.reserved).sum();
                    cands.push((e.last_used, *l, *id, bytes));
                }
            }
        }
        cands.sort();
        let mut acts = Actions::new();
        let mut got = 0;
        for (_, l, id, bytes) in cands {
            if got >= want {
                break;
            }
            if let Some(e) = self.rx.get_mut(&l).and_then(|r| r.edge_info.get_mut(&id)) {
                e.revoking = true;
            }
            got += bytes;
            acts.push(Action::Send { link: l, msg: Msg::Revoke { edge_id: id } });
        }
        acts
    }

    /// The sender of the dead `link` can no longer write into our arena:
    /// free the slots it held.
    pub fn sender_gone(&mut self, link: LinkId) {
        for (off, reserved) in self.quarantine.remove(&link).unwrap_or_default() {
            self.alloc.free(off, reserved);
        }
    }

    /// Forget a broken sender link: slots the sender held are quarantined
    /// until `sender_gone` (it may be inside a copy into them right now);
    /// slots we hold (lent to the application) are freed on release.
    pub(super) fn rx_drop_link(&mut self, link: LinkId, r: RxLink) {
        self.rx_edges = self.rx_edges.saturating_sub(r.edges.len());
        for (id, s) in r.slots {
            match s.token {
                Token::AtSender => self.quarantine.entry(link).or_default().push((s.offset, s.reserved)),
                Token::AtReceiver => {
                    self.orphans.insert((link, id, s.gen), (s.offset, s.reserved));
                }
            }
        }
    }
}
