//! The receiver's half: per sender link, edges and their slots in the
//! arena; arrivals matched to receives; credits; re-placement. Streamed
//! tensors (the receiver's part) are in `stream/rx.rs`.
//!
//! Files: the links, the writes that land in their slots and the slots'
//! release here; receives matched to arrivals in `matching`; placing
//! edges' slots in the arena (and growing, returning, reclaiming them) in
//! `placement`.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::records::{RxEdge, RxSlot, Token};
use super::stream::RxStreams;
use super::{smallvec, Actions, Action, Data, LinkId, Received, Rendezvous};
use crate::constants::HEADER_BYTES;
use crate::error::{Error, Result};
use crate::rendezvous::wire::{Msg, SlotDesc, SlotHeader};

mod matching;
mod placement;

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

    /// Did a connection with `peer` break since the last one was made?
    pub fn is_lost(&self, peer: &str) -> bool {
        self.lost.contains_key(peer)
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
