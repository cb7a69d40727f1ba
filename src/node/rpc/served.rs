//! Calls being served (see rpc.rs): parts gathered into whole calls, in
//! order from part 0, under the caps on what calls still arriving may
//! hold, and the handles given to the server.

use std::collections::HashMap;
use std::time::Instant;

use super::{CALL_PART_BYTES, MAX_CALL_BYTES, MAX_PARTIAL_BYTES, MAX_PARTIAL_BYTES_PER_LINK, MAX_SERVED};
use crate::error::{Error, Result};
use crate::fabric::ConnId;

pub(super) struct Incoming {
    pub(super) link: ConnId,
    pub(super) id: u64,
    pub(super) method: u32,
    pub(super) body: Vec<u8>,
    /// Parts so far (the index the next part must carry), and when the
    /// last came.
    pub(super) parts: u32,
    pub(super) last_part: Instant,
    /// Whole and handed to the server.
    pub(super) started: bool,
}

pub(super) struct Served {
    /// By the handle given to the server.
    pub(super) calls: HashMap<u64, Incoming>,
    /// (link, caller's id) → handle.
    pub(super) by_key: HashMap<(ConnId, u64), u64>,
    /// Per link: calls in `calls`, and the highest call id begun on it (a
    /// later part of a call at or below it that is not in `by_key` belongs
    /// to a call that was cancelled: dropped; above it: never begun).
    pub(super) links: HashMap<ConnId, LinkCalls>,
    /// Bytes of calls still arriving, node-wide, and the caps on them
    /// (per link, node-wide).
    pub(super) partial: usize,
    pub(super) caps: (usize, usize),
}

impl Default for Served {
    fn default() -> Served {
        Served {
            calls: HashMap::new(),
            by_key: HashMap::new(),
            links: HashMap::new(),
            partial: 0,
            caps: (MAX_PARTIAL_BYTES_PER_LINK, MAX_PARTIAL_BYTES),
        }
    }
}

#[derive(Default, Clone, Copy)]
pub(super) struct LinkCalls {
    pub(super) open: usize,
    pub(super) highest: u64,
    /// Bytes of this link's calls still arriving.
    pub(super) partial: usize,
}

/// A whole call to hand to the server.
pub(super) struct Whole {
    pub(super) handle: u64,
    pub(super) method: u32,
    pub(super) body: Vec<u8>,
}

impl Served {
    /// Take call `handle` out (answered, cancelled, its link lost).
    pub(super) fn remove(&mut self, handle: u64) -> Option<Incoming> {
        let c = self.calls.remove(&handle)?;
        self.by_key.remove(&(c.link, c.id));
        self.partial = self.partial.saturating_sub(c.body.capacity());
        if let Some(l) = self.links.get_mut(&c.link) {
            l.open = l.open.saturating_sub(1);
            l.partial = l.partial.saturating_sub(c.body.capacity());
        }
        Some(c)
    }

    /// Part `part` of call `id` from `link`: `Some` when it made the call
    /// whole; `Err` fails the link.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn take_part(&mut self, new_handle: impl FnOnce() -> u64, link: ConnId, id: u64, method: u32, part: u32, more: bool, body: Vec<u8>) -> Result<Option<Whole>> {
        let handle = match self.by_key.get(&(link, id)) {
            Some(h) => *h,
            None => {
                let lc = self.links.entry(link).or_default();
                if part != 0 {
                    // The rest of a call cancelled meanwhile (its parts
                    // were already on their way): dropped, never served.
                    return if id <= lc.highest { Ok(None) } else { Err(Error::Protocol(format!("call {id}: part {part} of a call never begun"))) };
                }
                if lc.open >= MAX_SERVED {
                    return Err(Error::Protocol(format!("more than {MAX_SERVED} calls in flight from one connection")));
                }
                if lc.partial + body.len() > self.caps.0 || self.partial + body.len() > self.caps.1 {
                    return Err(Error::ResourceExhausted(format!("call {id}: calls still arriving would hold more than {} bytes from this connection or {} from all", self.caps.0, self.caps.1)));
                }
                lc.open += 1;
                lc.highest = lc.highest.max(id);
                let h = new_handle();
                self.by_key.insert((link, id), h);
                self.calls.insert(h, Incoming { link, id, method, body: Vec::new(), parts: 0, last_part: Instant::now(), started: false });
                h
            }
        };
        let c = self.calls.get_mut(&handle).ok_or_else(|| Error::Internal("served call vanished".into()))?;
        if c.started || c.method != method || c.parts != part {
            return Err(Error::Protocol(format!("call {id}: part {part} out of order, after its last, or of another method")));
        }
        if more && body.len() != CALL_PART_BYTES {
            // `call` cuts every part but the last at CALL_PART_BYTES: short
            // ones would let a peer hold a call open for ever (each part
            // restarts the stall clock) within the caps.
            return Err(Error::Protocol(format!("call {id}: part {part} of {} bytes before its last (parts are {CALL_PART_BYTES})", body.len())));
        }
        let len = c.body.len();
        if len + body.len() > MAX_CALL_BYTES {
            return Err(Error::Protocol(format!("call {id}: body larger than {MAX_CALL_BYTES} bytes")));
        }
        // What a call holds is its buffer's capacity, which grows by
        // doubling (capped at the largest call): that is what is charged.
        let have = c.body.capacity();
        let grow_to = if len + body.len() <= have { have } else { (len + body.len()).max(have.saturating_mul(2).min(MAX_CALL_BYTES)) };
        let charge = grow_to - have;
        let lc = self.links.entry(link).or_default();
        let (link_cap, node_cap) = self.caps;
        if charge > 0 && (lc.partial.saturating_add(charge) > link_cap || self.partial.saturating_add(charge) > node_cap) {
            return Err(Error::ResourceExhausted(format!(
                "call {id}: calls still arriving would hold more than {link_cap} bytes from this connection \
                 or {node_cap} from all ({} and {} now)",
                lc.partial, self.partial
            )));
        }
        if c.body.try_reserve_exact(grow_to - len).is_err() {
            return Err(Error::ResourceExhausted(format!("call {id}: no memory for {} more bytes", body.len())));
        }
        // The allocator may give more than asked: charge what it gave.
        let charge = c.body.capacity() - have;
        c.body.extend_from_slice(&body);
        c.parts += 1;
        c.last_part = Instant::now();
        lc.partial += charge;
        self.partial += charge;
        if more {
            return Ok(None);
        }
        c.started = true;
        let whole = std::mem::take(&mut c.body);
        let held = whole.capacity();
        lc.partial = lc.partial.saturating_sub(held);
        self.partial = self.partial.saturating_sub(held);
        Ok(Some(Whole { handle, method, body: whole }))
    }

    /// Links with a call still arriving whose last part came before
    /// `stale` (they fail: the caller stopped in the middle of a call).
    pub(super) fn stalled_links(&self, stale: Instant) -> Vec<ConnId> {
        let mut out: Vec<ConnId> = self.calls.values().filter(|c| !c.started && c.last_part < stale).map(|c| c.link).collect();
        out.sort_unstable();
        out.dedup();
        out
    }
}
