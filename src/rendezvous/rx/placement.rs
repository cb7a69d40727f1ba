//! Placing an edge's slots in the arena at the receiver: on a sender's
//! `Announce` (first use, or a new size: re-placement), one more slot
//! when all are lent to the application (`More` → `Grow`), slots the
//! sender gives back, and the least recently used idle edges reclaimed
//! when the arena is full.

use super::RxLink;
use crate::constants::{MAX_EDGES_PER_LINK, MAX_EDGES_PER_NODE};
use crate::error::{Error, Result};
use crate::rendezvous::records::{RxEdge, Token};
use crate::rendezvous::stream::STREAM_KEY;
use crate::rendezvous::wire::Msg;
use crate::rendezvous::{smallvec, Action, Actions, Data, LinkId, Received, Rendezvous};

/// Are all slots of the edge's current set with us and lent out?
fn all_lent(r: &RxLink, edge_id: u32) -> bool {
    r.edge_info.get(&edge_id).is_some_and(|e| {
        !e.set.is_empty() && e.set.iter().all(|id| r.slots.get(id).is_some_and(|s| s.token == Token::AtReceiver && s.lent))
    })
}

impl Rendezvous {
    /// Place `key` on `link` for `need` payload bytes; publish the slots.
    /// `returned`: free slots the sender gave back.
    pub(in crate::rendezvous) fn rx_announce(
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
                if step == crate::rendezvous::STEP_AHEAD {
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
    pub(super) fn lend(&mut self, r: &Received) -> Actions {
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
    pub(in crate::rendezvous) fn rx_more(&mut self, link: LinkId, edge_id: u32, need: u64) -> Result<Actions> {
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

    pub(in crate::rendezvous) fn rx_return(&mut self, link: LinkId, slot: u32, gen: u32) -> Result<Actions> {
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
    pub(in crate::rendezvous) fn reclaim_cold(&mut self, except_link: LinkId, except: u32, want: u64) -> Actions {
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
}
