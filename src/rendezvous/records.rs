//! The records both halves and the streams share: a receiver's slots and
//! edges (`rx.rs` keeps them per link, `stream/rx.rs` borrows stream
//! slots from them) and a send waiting for room (`tx.rs` queues it,
//! `stream/tx.rs` streams it). Here so that neither half imports the streams' module and
//! the streams' module imports neither half.

use std::sync::Arc;

use super::wire::TensorMeta;
use super::{Payload, SendDone};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Token {
    AtSender,
    AtReceiver,
}

pub(super) struct RxSlot {
    pub(super) edge_id: u32,
    pub(super) gen: u32,
    pub(super) offset: u64,
    /// Bytes reserved in the arena (header + payload capacity).
    pub(super) reserved: u64,
    pub(super) capacity: u64,
    pub(super) token: Token,
    /// No longer in the edge's current set: free it when we get the token.
    pub(super) retired: bool,
    /// With us and handed to the application (not merely arrived).
    pub(super) lent: bool,
}

pub(super) struct RxEdge {
    pub(super) key: Arc<str>,
    pub(super) set: Vec<u32>,
    /// Logical time of the last arrival (for choosing cold edges).
    pub(super) last_used: u64,
    /// A Revoke is out for this edge's slots.
    pub(super) revoking: bool,
    /// The sender asked for one more slot of this size while we were
    /// merely behind (arrivals not yet taken); granted once all are lent.
    pub(super) more_wanted: Option<u64>,
}

/// A send waiting for a slot, or for its edge to be placed.
pub(super) struct Pending {
    pub(super) step: u64,
    pub(super) meta: TensorMeta,
    pub(super) payload: Box<dyn Payload>,
    pub(super) done: SendDone,
}

