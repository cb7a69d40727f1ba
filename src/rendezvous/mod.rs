//! The push rendezvous protocol, as a state machine.
//!
//! Owns: edges (a rendezvous key without its step), the receiver's slots and
//! their placement in the arena, the sender's view of free slots, matching
//! arrivals to receives on (edge, step), credits, re-placement on size
//! change, streamed tensors (see [`stream`]), aborts and generations. Must not touch:
//! memory, threads, sockets or any transport type. Every input is a method
//! call; every effect is an [`Action`] the caller executes after releasing
//! its lock (so callbacks may call back in).
//!
//! Slot ownership is a token that lives either with the sender (the slot is
//! free and the sender may write into it) or with the receiver (data arrived
//! or lent to the application). The receiver reuses slot memory only while
//! it holds the token; a slot whose token is with the sender is reclaimed
//! only after the sender returns it (`Announce.returned` or `ReturnSlot`).
//! That rule is what makes re-placement safe with one-sided writes.

pub mod alloc;
pub mod proof;
mod records;
mod rpc;
mod rx;
mod steps;
pub mod stream;
mod table;
mod tx;
pub use rx::SlotMemory;
pub use stream::{stream_chunk_bytes, ChunkSrc, PayloadRange, StreamBuf, STREAM_KEY};
pub use tx::Placement;
pub mod wire;
#[cfg(test)]
mod caps_tests;
#[cfg(test)]
mod rpc_tests;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

pub use crate::completion::Complete;
use crate::constants::FINISHED_STEPS_REMEMBERED;
use crate::error::{Error, Result};
pub use wire::{ChunkAt, Dims, Hello, Msg, MsgBytes, SlotDesc, SlotHeader, TensorMeta, FLAG_DEAD, FLAG_SERIALIZED, STEP_AHEAD};

/// A connection, as the protocol knows it (the fabric's id, opaque here).
pub type LinkId = u64;

/// The bytes of a tensor being sent. Must stay valid until the send's
/// completion runs; dropping it releases nothing by itself.
pub trait Payload: Send + Sync {
    fn bytes(&self) -> &[u8];
    /// The sender is done with the bytes (the write completed or failed):
    /// by default the payload is dropped; a recycled one goes back to its
    /// pool.
    fn release(self: Box<Self>) {}
}

impl Payload for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

pub type SendDone = Box<dyn Complete<Result<()>>>;
pub type RecvDone = Box<dyn Complete<Result<Received>>>;

/// Where a received tensor's bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Data {
    /// In place in the arena: `offset..offset+len`. Release with
    /// [`Rendezvous::release`] (`link`, `slot`, `gen`) when done.
    Slot { link: LinkId, slot: u32, gen: u32, offset: u64, len: u64 },
    /// Assembled from a stream (the tensor did not go through one slot).
    Owned(Vec<u8>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    pub meta: TensorMeta,
    pub data: Data,
}

/// The effects of one protocol input, in order: inline for the usual few
/// (no allocation on the hot path).
pub type Actions = smallvec::SmallVec<[Action; 4]>;
pub use smallvec::smallvec;

/// Effects for the caller to carry out, in order, outside its lock.
pub enum Action {
    /// One-sided write of `header` (encoded) then `payload` at `offset` of the peer's
    /// arena, then immediate `imm`. When it completes, call
    /// [`Rendezvous::write_done`] and then `done`.
    Write { link: LinkId, offset: u64, key: u32, header: SlotHeader, payload: Box<dyn Payload>, imm: u32, done: SendDone, bytes: u64 },
    /// One chunk of stream `stream`: a one-sided write like `Write`, off
    /// the caller's thread if it is large. When it completes, call
    /// [`Rendezvous::chunk_written`] with its result.
    WriteChunk { link: LinkId, stream: u32, offset: u64, key: u32, header: SlotHeader, payload: Box<dyn Payload>, imm: u32 },
    /// Last resort: send `payload` (a range of stream `stream` at `offset`)
    /// as one `Msg::StreamData` (encoded outside the lock; a failure to send
    /// fails the link, as for `Send`).
    SendChunk { link: LinkId, stream: u32, offset: u64, payload: Box<dyn Payload> },
    /// Allocate the zeroed destination of stream `stream` (`total` bytes;
    /// failure is a value, never an abort), then call
    /// [`Rendezvous::stream_alloc_done`].
    StreamAlloc { link: LinkId, stream: u32, total: u64 },
    /// Copy `len` bytes from `src` into `dst` at `at`, off any progress
    /// thread when large, drop `dst`, then call
    /// [`Rendezvous::chunk_copied`]. A slot source stays ours until then.
    CopyChunk { link: LinkId, stream: u32, src: ChunkSrc, len: u64, dst: Arc<StreamBuf>, at: u64 },
    /// Send a control message on `link`.
    Send { link: LinkId, msg: Msg },
    /// Close `link` (protocol violation).
    Close { link: LinkId, why: Error },
    /// Complete a send.
    SendDone { done: SendDone, result: Result<()> },
    /// Complete a receive.
    Deliver { done: RecvDone, result: Result<Received> },
    /// The peer on `link` asks us to place an edge as its sender (answer
    /// with `Msg::PlaceDone` on the same link). Node-level work: it blocks.
    PlaceFor { link: LinkId, req: u64, receiver: String, key: String, bytes: u64 },
    /// The answer to a placement we requested.
    PlaceDone { req: u64, outcome: u32, error: String },
    /// Free an arrival the application will never take (its step finished).
    Release { link: LinkId, slot: u32, gen: u32 },
}

impl std::fmt::Debug for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Action::Write { link, offset, imm, bytes, .. } => write!(f, "Write(link {link}, off {offset}, imm {imm}, {bytes} B)"),
            Action::WriteChunk { link, stream, offset, imm, payload, .. } => {
                write!(f, "WriteChunk(link {link}, stream {stream}, off {offset}, imm {imm}, {} B)", payload.bytes().len())
            }
            Action::SendChunk { link, stream, offset, payload } => write!(f, "SendChunk(link {link}, stream {stream}, at {offset}, {} B)", payload.bytes().len()),
            Action::StreamAlloc { link, stream, total } => write!(f, "StreamAlloc(link {link}, stream {stream}, {total} B)"),
            Action::CopyChunk { link, stream, len, at, .. } => write!(f, "CopyChunk(link {link}, stream {stream}, {len} B at {at})"),
            Action::Send { link, msg } => write!(f, "Send(link {link}, {msg:?})"),
            Action::Close { link, why } => write!(f, "Close(link {link}, {why})"),
            Action::SendDone { result, .. } => write!(f, "SendDone({result:?})"),
            Action::Deliver { result, .. } => write!(f, "Deliver({:?})", result.as_ref().map(|r| &r.meta)),
            Action::Release { link, slot, gen } => write!(f, "Release(link {link}, slot {slot}, gen {gen})"),
            Action::PlaceFor { link, req, key, .. } => write!(f, "PlaceFor(link {link}, req {req}, {key})"),
            Action::PlaceDone { req, outcome, .. } => write!(f, "PlaceDone(req {req}, {outcome})"),
        }
    }
}

/// Settings the protocol needs (a subset of `Config`).
#[derive(Debug, Clone)]
pub struct Params {
    pub slots_per_edge: usize,
    pub max_outstanding_writes: usize,
    /// Our incarnation: stamped into every header we write.
    pub incarnation: u64,
    /// `RDMA_DEVICE_MODE=rpc`: a receive requests its tensor (`Msg::Request`)
    /// and the sender writes it only then.
    pub rpc: bool,
}

/// Counters the protocol moves; the caller adds them to `Stats` (one
/// table for both: `stats.rs`).
pub use crate::stats::Tally;

enum Entry {
    Waiting { peer: Arc<str>, done: RecvDone },
    Ready(Received),
    /// The tensor will not come (its stream, from `link`, was refused or
    /// abandoned): the receive fails with `why` when it is made.
    Failed { why: Error, link: LinkId },
    /// Its receive was cancelled (`cancel_recv`): a tensor that arrives
    /// for it is released at once, a new receive waits again.
    Cancelled,
}

pub struct Rendezvous {
    params: Params,
    alloc: alloc::ArenaAlloc,
    tx: HashMap<LinkId, tx::TxLink>,
    /// Streams that failed while chunks still read their payload (see
    /// [`stream`]): their `done` waits for the last one.
    tx_ending: stream::Ending,
    rx: HashMap<LinkId, rx::RxLink>,
    /// Matching table: (key, step) → a waiting receive or an arrival.
    table: table::Table,
    /// Edges of all rx links (`MAX_EDGES_PER_NODE`).
    rx_edges: usize,
    /// Edge keys and peer names, one `Arc<str>` each (see [`Names`]).
    names: Names,
    finished: VecDeque<u64>,
    finished_set: HashSet<u64>,
    /// Peers whose connection broke, until they connect again.
    lost: HashMap<String, Error>,
    /// Steps a peer told us it aborted: receives of them from it fail.
    peer_aborts: HashMap<(Arc<str>, u64), Error>,
    peer_abort_order: VecDeque<(Arc<str>, u64)>,
    /// Steps whose abort we told our peers of (counted once each).
    propagated: HashSet<u64>,
    propagated_order: VecDeque<u64>,
    /// Slots of dead links still lent to the application: (offset, bytes).
    orphans: HashMap<(LinkId, u32, u32), (u64, u64)>,
    /// Slots the sender of a dead link held, (offset, bytes): its writes
    /// may still land there until it is known gone (`sender_gone`).
    quarantine: HashMap<LinkId, Vec<(u64, u64)>>,
    next_gen: u32,
    /// rpc mode: requests for senders not connected yet, sent when they
    /// connect: peer → (key, step).
    unsent_requests: HashMap<String, Vec<(String, u64)>>,
    /// rpc mode: links from senders that said `Ready` (requests can go
    /// out on them; a link just accepted may not carry messages yet).
    ready_links: HashSet<LinkId>,
    /// Logical clock: one tick per arrival.
    clock: u64,
    pub tally: Tally,
    /// Lets each sender write the ranges placed for it (see [`Granter`]);
    /// `None` (unit tests): every key is 0.
    granter: Option<Arc<dyn Granter>>,
    /// Links whose grant failed since the caller last looked (see
    /// `take_refused`): their Publish names a range they cannot write.
    refused: Vec<(LinkId, Error)>,
}

/// Interned names (edge keys, peer tasks): the matching table, the edges
/// and waiting receives share one `Arc<str>` per name, so matching a
/// tensor to its receive copies no string. Names only this set still holds
/// are pruned whenever it has doubled since the last pruning (amortised
/// O(1) per new name).
#[derive(Default)]
struct Names {
    set: HashSet<Arc<str>>,
    prune_at: usize,
}

impl Names {
    /// The name if it is interned (never allocates).
    fn get(&self, s: &str) -> Option<Arc<str>> {
        self.set.get(s).cloned()
    }

    fn intern(&mut self, s: &str) -> Arc<str> {
        if let Some(n) = self.set.get(s) {
            return n.clone();
        }
        if self.set.len() >= self.prune_at {
            self.set.retain(|n| Arc::strong_count(n) > 1);
            self.prune_at = (2 * self.set.len()).max(1024);
        }
        let n: Arc<str> = Arc::from(s);
        self.set.insert(n.clone());
        n
    }
}

/// Lets a sender write an arena range just placed for it (the node asks
/// its listeners: `Listener::grant`) and says with which key. Called
/// under the protocol lock, as the Publish or Grow naming the range is
/// built: a range is granted before that message can go out, and before
/// the range can be freed and placed again. Must not block (it may run on
/// a backend's event thread).
pub trait Granter: Send + Sync {
    /// The key the sender on `link` must write `off..off+len` with.
    fn grant(&self, link: LinkId, off: u64, len: u64) -> Result<u32>;
}

/// Grant `off..off+len` to the sender on `link` (the fields of a
/// [`Rendezvous`], borrowed apart from its link tables); the slot's key.
fn grant(granter: &Option<Arc<dyn Granter>>, refused: &mut Vec<(LinkId, Error)>, link: LinkId, off: u64, len: u64) -> u32 {
    let Some(g) = granter.as_ref() else { return 0 };
    match g.grant(link, off, len) {
        Ok(key) => key,
        Err(e) => {
            refused.push((link, e));
            0
        }
    }
}

impl Rendezvous {
    pub fn new(params: Params, arena_bytes: u64) -> Rendezvous {
        Rendezvous {
            params,
            alloc: alloc::ArenaAlloc::new(arena_bytes),
            tx: HashMap::new(),
            tx_ending: HashMap::new(),
            rx: HashMap::new(),
            table: table::Table::default(),
            rx_edges: 0,
            names: Names::default(),
            // Full size from the start: the steady state never grows them.
            finished: VecDeque::with_capacity(FINISHED_STEPS_REMEMBERED + 1),
            finished_set: HashSet::with_capacity(FINISHED_STEPS_REMEMBERED + 1),
            lost: HashMap::new(),
            orphans: HashMap::new(),
            quarantine: HashMap::new(),
            peer_aborts: HashMap::new(),
            peer_abort_order: VecDeque::new(),
            propagated: HashSet::new(),
            propagated_order: VecDeque::new(),
            next_gen: 1,
            unsent_requests: HashMap::new(),
            ready_links: HashSet::new(),
            clock: 0,
            tally: Tally::default(),
            granter: None,
            refused: Vec::new(),
        }
    }

    /// Who grants the ranges placed for senders (see [`Granter`]).
    pub fn set_granter(&mut self, g: Arc<dyn Granter>) {
        self.granter = Some(g);
    }

    /// The links whose grant failed since the last call: the caller fails
    /// them (outside the lock), so the Publish naming a range they cannot
    /// write is never used.
    pub fn take_refused(&mut self) -> Vec<(LinkId, Error)> {
        std::mem::take(&mut self.refused)
    }


    pub fn arena_in_use(&self) -> u64 {
        self.alloc.in_use()
    }

    /// Streams being received (their buffers allocated), over all links.
    pub fn streams_receiving(&self) -> usize {
        self.rx.values().map(|r| r.streams.len()).sum()
    }

    /// A human-readable dump of the protocol state (diagnostics).
    pub fn describe(&self) -> String {
        use std::fmt::Write as _;
        let mut o = String::new();
        for (l, t) in &self.tx {
            let _ = writeln!(o, "tx link {l} → {}: {}", t.peer, t.describe());
        }
        for ((l, id), s) in &self.tx_ending {
            let _ = writeln!(o, "tx link {l}: stream {id} ended ({:?}), waiting for its chunk writes: {}", s.failed, s.describe());
        }
        for (l, r) in &self.rx {
            let _ = writeln!(o, "rx link {l} ← {}: {}", r.peer, r.describe());
        }
        for ((k, s), e) in self.table.iter() {
            let what = match e {
                Entry::Waiting { peer, .. } => format!("waiting on {peer}"),
                Entry::Ready(_) => "ready".into(),
                Entry::Failed { why, link } => format!("failed (link {link}): {why}"),
                Entry::Cancelled => "receive cancelled".into(),
            };
            let _ = writeln!(o, "table ({k}, {s}): {what}");
        }
        let quarantined: u64 = self.quarantine.values().flatten().map(|(_, b)| b).sum();
        let _ = writeln!(o, "lost: {:?}; arena in use {}; quarantined {quarantined}", self.lost.keys().collect::<Vec<_>>(), self.alloc.in_use());
        o
    }

    /// Every link to or from `peer`.
    pub fn links_of(&self, peer: &str) -> Vec<LinkId> {
        self.tx.iter().filter(|(_, t)| t.peer == peer).map(|(l, _)| *l)
            .chain(self.rx.iter().filter(|(_, r)| r.peer == peer).map(|(l, _)| *l))
            .collect()
    }

    /// Links with work that waits on their peer: sends queued or writes
    /// outstanding on a link to it, or receives waiting for it (then every
    /// link with that peer). The caller probes them (`Msg::Ping`) now and
    /// then, so that a peer whose host vanished fails what waits on it
    /// within the transport's retry bound rather than never. Into `out`,
    /// with `peers` as scratch (both the caller's, kept between calls, so
    /// this allocates nothing in a steady state). O(links × peers waited
    /// for): the table counts waiting receives per peer, so none is
    /// scanned; nothing when idle.
    pub fn links_to_probe(&self, peers: &mut Vec<Arc<str>>, out: &mut Vec<LinkId>) {
        out.clear();
        peers.clear();
        let add = |out: &mut Vec<LinkId>, l: LinkId| {
            if !out.contains(&l) {
                out.push(l);
            }
        };
        for (l, t) in &self.tx {
            if !t.idle() || t.outstanding() > 0 {
                add(out, *l);
            }
        }
        peers.extend(self.table.waiting_peers().cloned());
        for p in peers.iter() {
            for (l, _) in self.tx.iter().filter(|(_, t)| *t.peer == **p) {
                add(out, *l);
            }
            for (l, _) in self.rx.iter().filter(|(_, r)| *r.peer == **p) {
                add(out, *l);
            }
        }
        peers.clear();
    }

    /// A control message arrived on `link` (either direction).
    pub fn on_message(&mut self, link: LinkId, bytes: &[u8]) -> Actions {
        let msg = match Msg::decode(bytes) {
            Ok(m) => m,
            Err(e) => return smallvec![Action::Close { link, why: e }],
        };
        let is_tx = self.tx.contains_key(&link);
        let is_rx = self.rx.contains_key(&link);
        let r = match (msg, is_tx, is_rx) {
            (Msg::Publish { key, edge_id, slots }, true, _) => self.tx_publish(link, key, edge_id, slots),
            (Msg::Credit { edge_id, slot, gen }, true, _) => self.tx_credit(link, edge_id, slot, gen),
            (Msg::NoSpace { key, need }, true, _) => self.tx_nospace(link, key, need),
            (Msg::Revoke { edge_id }, true, _) => self.tx_revoke(link, edge_id),
            (Msg::NoMore { edge_id }, true, _) => self.tx_nomore(link, edge_id),
            (Msg::Grow { edge_id, slot }, true, _) => self.tx_grow(link, edge_id, slot),
            (Msg::Request { key, step }, true, _) => self.tx_request(link, key, step),
            (Msg::Ready, _, true) => Ok(self.rx_ready(link)),
            (Msg::Ping, _, _) => Ok(Actions::new()),
            // Calls are the node's (`node::rpc`), never the protocol's.
            (m @ (Msg::Call { .. } | Msg::Reply { .. } | Msg::CallCancel { .. }), _, _) => Err(Error::Protocol(format!("{} reached the rendezvous", m.name()))),
            (Msg::More { edge_id, need }, _, true) => self.rx_more(link, edge_id, need),
            (Msg::Abort { step, code, reason }, _, _) => Ok(self.peer_aborted(link, step, code, reason)),
            (Msg::PlaceFor { req, receiver, key, bytes }, _, _) => Ok(smallvec![Action::PlaceFor { link, req, receiver, key, bytes }]),
            (Msg::PlaceDone { req, outcome, error }, _, _) => Ok(smallvec![Action::PlaceDone { req, outcome, error }]),
            (Msg::Announce { key, step, need, returned }, _, true) => self.rx_announce(link, key, step, need, returned),
            (Msg::ReturnSlot { slot, gen }, _, true) => self.rx_return(link, slot, gen),
            (Msg::StreamReady { stream, outcome, error }, true, _) => self.tx_stream_ready(link, stream, outcome, error),
            (Msg::StreamAck { stream }, true, _) => self.tx_stream_ack(link, stream),
            (Msg::StreamCancel { stream }, true, _) => Ok(self.tx_stream_cancel(link, stream)),
            (Msg::StreamBegin { stream, key, step, meta, total }, _, true) => self.rx_stream_begin(link, stream, key, step, meta, total),
            (Msg::StreamData { stream, offset, bytes }, _, true) => self.rx_stream_data(link, stream, offset, bytes),
            (Msg::StreamCancel { stream }, _, true) => self.rx_stream_cancel(link, stream),
            (m, _, _) => Err(Error::Protocol(format!("unexpected message on link {link}: {m:?}"))),
        };
        r.unwrap_or_else(|e| smallvec![Action::Close { link, why: e }])
    }

    /// A link to or from `peer` broke: fail what depended on it.
    pub fn on_link_lost(&mut self, link: LinkId, why: Error) -> Actions {
        let mut acts = Actions::new();
        let mut peer = None;
        if let Some(t) = self.tx.remove(&link) {
            peer = Some(t.peer.clone());
            acts.extend(t.fail_all(link, &why, &mut self.tx_ending));
        }
        self.ready_links.remove(&link);
        if let Some(r) = self.rx.remove(&link) {
            peer = Some(r.peer.clone());
            self.rx_drop_link(link, r);
        }
        if let Some(peer) = peer {
            // Any broken link marks the peer lost (reconnecting to it gets
            // a short grace only) until a new connection with it is made;
            // its waiters fail once no link with it is left.
            self.lost.insert(peer.clone(), why.clone());
            let still_up = self.tx.values().any(|t| t.peer == peer) || self.rx.values().any(|r| r.peer == peer);
            if !still_up && self.table.waits_on(&peer) {
                acts.extend(self.fail_waiters(None, |p, _| p == peer, &why));
            }
        }
        acts
    }
}
