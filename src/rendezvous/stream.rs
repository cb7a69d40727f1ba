//! Streamed tensors: the one path for every tensor that does not go through
//! a slot of its edge, whatever its size: larger than any slot the
//! receiver can place (up to larger than the arena and than 4 GiB), of rank
//! above `MAX_DIMS`, or on an edge whose slots are all lent out and that
//! cannot grow.
//!
//! Shape of the path (why, from what we measured and what broke before):
//! - One control message opens a stream: `StreamBegin { stream, key, step,
//!   meta, total }`. The receiver allocates the whole destination once
//!   (`Action::StreamAlloc`, outside the lock; a failure is an error for
//!   that receive, never an abort) and answers `StreamReady`. The sender
//!   writes nothing before that answer: shm carries messages and writes on
//!   different channels (socket, doorbell ring), so a chunk could otherwise
//!   land before the receiver knows its stream, and the answer is where a
//!   receiver without memory refuses.
//! - Bytes move in chunks by one-sided writes into a few *stream slots* per
//!   link (`STREAM_SLOTS` of up to `STREAM_CHUNK_BYTES`, at most
//!   1/`STREAM_ARENA_FRACTION` of the arena), placed by the receiver on the
//!   link's first stream and published like any edge (`Publish` of the
//!   reserved key [`STREAM_KEY`]; like every slot, each is granted to its
//!   sender's window before the Publish goes out),
//!   kept for the link's life. A chunk's header carries the stream id and
//!   the chunk's offset (`SlotHeader::chunk`); credits pace the sender, so
//!   at most `STREAM_SLOTS` chunks of a link are in flight: the working set
//!   is bounded whatever the tensor's size, and every chunk is far below
//!   the verbs backend's per-work-request limit (1 GiB).
//! - The sender never copies the payload: every chunk write references a
//!   range of one shared `Arc` of it ([`PayloadRange`]); `done` runs once,
//!   when the last chunk's write completed.
//! - Completions follow the buffer, not the error: the caller's tensor may
//!   be freed as soon as `done` runs, so `done` never runs while an action
//!   still reads it. Each stream counts its `reading` actions (a
//!   `WriteChunk` until [`Rendezvous::chunk_written`], a `SendChunk` until
//!   [`Rendezvous::chunk_sent`]); a stream that fails (cancelled by either
//!   side, its step aborted, its link lost) with chunks still reading
//!   becomes a tombstone in `Rendezvous::tx_ending`, which outlives its
//!   link, and its `done` runs with the error when the last one is back.
//! - The receiver copies each chunk from its slot into the destination
//!   (`Action::CopyChunk`, on the node's worker threads, never under the
//!   lock or on a progress thread), then credits the slot. That is the one
//!   copy of the path (on shm the sender's write is the "DMA"). When every
//!   byte is in, the tensor arrives as `Data::Owned` through the normal
//!   matching.
//! - Streams of one link share its slots round-robin, chunk by chunk, so a
//!   huge tensor does not hold a small one back for its whole transfer.
//! - Last resort, when not even stream slots fit the arena: the chunks
//!   travel as `StreamData` messages, produced one at a time from the
//!   payload and acknowledged (`StreamAck`), at most `STREAM_MSG_WINDOW`
//!   unacknowledged per stream (the old inline path built every message up
//!   front and posted them all, which on verbs overran the queue at ~1 GiB).
//!
//! Ending early: the receiver discards the streams of a finished or
//! aborted step and says `StreamCancel` (the sender fails its `done`); a
//! sender that gives up (its step failed) says `StreamCancel` too (the
//! receive fails). Chunks of a stream that ended may still land (shm orders
//! writes and messages independently): they are dropped and their slot
//! credited. Stream ids rise in the order the sender numbers them, but
//! its threads send the begins as they go, so one may overtake another:
//! the ids skipped may come later, each once (`MAX_STREAMS_OVERTAKEN`).
//! Anything else out of protocol (a chunk before `StreamReady`, of a stream
//! never begun, overlapping or duplicate, past `total`, a reused stream id)
//! closes the link.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::sync::Mutex;

use super::records::{Pending, RxEdge, Token};
use super::wire::{ChunkAt, Msg, SlotHeader, TensorMeta, STREAM_MESSAGES, STREAM_REFUSED, STREAM_SLOTS};
use super::{smallvec, Actions, Action, Data, LinkId, Payload, Received, Rendezvous, SendDone, Tally};
use crate::constants::{
    HEADER_BYTES, MAX_STREAM_TOTAL, SLOT_ALIGN, STREAM_ARENA_FRACTION, STREAM_CHUNK_BYTES, STREAM_MIN_CHUNK, STREAM_MSG_BYTES,
    STREAM_MSG_WINDOW, STREAM_SLOTS as SLOTS_PER_LINK,
};
use crate::error::{Error, Result};

/// Key of a link's stream-slot edge. TensorFlow keys start with "/job:",
/// never with a NUL; a sender may not use it.
pub const STREAM_KEY: &str = "\0rdma_device:stream";

mod open;
pub(super) use open::RxStreams;

/// Most streams one sender may have open at a receiver at once.
const MAX_STREAMS_PER_LINK: usize = 1 << 16;

/// Most stream ids of one sender whose `StreamBegin` another, later one
/// overtook and that are still to come. The sender's threads send begins
/// as they go (after the protocol lock), so a few may arrive out of order;
/// a peer that skips more is out of protocol.
pub(super) const MAX_STREAMS_OVERTAKEN: usize = 1024;

/// Stream ids run 1, 2, … and wrap past `u32::MAX` back to 1 (a link can
/// outlive 2^32 streamed tensors), so the receiver orders them as serial
/// numbers (RFC 1982): `a` comes after `b` when it is less than 2^31 ids
/// ahead of it. Only `MAX_STREAMS_OVERTAKEN` ids may be skipped anyway.
pub(super) fn after(a: u32, b: u32) -> bool {
    let d = a.wrapping_sub(b);
    d != 0 && d < 1 << 31
}

/// The ids strictly between `from` and `to` in the sender's order (0 is
/// never used); iterate only after `skipped_ids` bounded them.
fn ids_between(from: u32, to: u32) -> impl Iterator<Item = u32> {
    let n = to.wrapping_sub(from).saturating_sub(1);
    (1..=n).map(move |i| from.wrapping_add(i)).filter(|id| *id != 0)
}

/// How many ids `ids_between(from, to)` yields, in O(1).
fn skipped_ids(from: u32, to: u32) -> usize {
    let n = to.wrapping_sub(from).saturating_sub(1) as u64;
    // 0 lies between them when the walk from `from` wraps within n steps.
    let zero_inside = from != 0 && u64::from(u32::MAX - from) < n;
    (n - u64::from(zero_inside)) as usize
}

/// Payload capacity of a stream slot in an arena of `arena` bytes, or None
/// when the arena is too small for useful ones.
pub fn stream_chunk_bytes(arena: u64) -> Option<u64> {
    let share = arena / STREAM_ARENA_FRACTION / SLOTS_PER_LINK as u64 / SLOT_ALIGN as u64 * SLOT_ALIGN as u64;
    let cap = share.saturating_sub(HEADER_BYTES as u64).min(STREAM_CHUNK_BYTES);
    (cap >= STREAM_MIN_CHUNK).then_some(cap)
}

/// The destination of a streamed tensor: written by copy jobs outside the
/// rendezvous lock (each a disjoint range), then handed over whole.
pub struct StreamBuf {
    buf: Mutex<Vec<u8>>,
}

impl StreamBuf {
    pub fn new(v: Vec<u8>) -> StreamBuf {
        StreamBuf { buf: Mutex::new(v) }
    }

    pub fn len(&self) -> u64 {
        self.buf.lock().len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copy `src` to `at` (bounds-checked).
    pub fn write_at(&self, at: u64, src: &[u8]) -> Result<()> {
        let mut b = self.buf.lock();
        let at = usize::try_from(at).map_err(|_| Error::Internal("stream offset overflows".into()))?;
        let dst = at.checked_add(src.len()).and_then(|end| b.get_mut(at..end));
        let Some(dst) = dst else {
            return Err(Error::Internal(format!("stream chunk {at}+{} outside a buffer of {} bytes", src.len(), b.len())));
        };
        dst.copy_from_slice(src);
        Ok(())
    }

    fn into_vec(self) -> Vec<u8> {
        self.buf.into_inner()
    }
}

/// A streamed tensor's payload, shared by the chunks that read it. A
/// stream dropped while chunks still read it (the node shut down with a
/// tombstone, see `Rendezvous`'s `Drop`) leaves its `done` here: it runs,
/// with the stream's error, when the last chunk lets go of the bytes, so
/// every `done` runs exactly once and never while its buffer is read.
pub(super) struct SharedPayload {
    p: Option<Box<dyn Payload>>,
    on_last: Mutex<Option<(SendDone, Error)>>,
}

impl SharedPayload {
    fn new(p: Box<dyn Payload>) -> Arc<SharedPayload> {
        Arc::new(SharedPayload { p: Some(p), on_last: Mutex::new(None) })
    }

    fn bytes(&self) -> &[u8] {
        self.p.as_deref().map_or(&[], |p| p.bytes())
    }
}

impl Drop for SharedPayload {
    fn drop(&mut self) {
        if let Some(p) = self.p.take() {
            p.release();
        }
        if let Some((done, why)) = self.on_last.get_mut().take() {
            done.complete(Err(why));
        }
    }
}

/// A range of a shared payload: what one chunk writes.
pub struct PayloadRange {
    whole: Arc<SharedPayload>,
    off: usize,
    len: usize,
}

impl Payload for PayloadRange {
    fn bytes(&self) -> &[u8] {
        let b = self.whole.bytes();
        self.off.checked_add(self.len).and_then(|end| b.get(self.off..end)).unwrap_or(&[])
    }
}

/// Where a chunk to copy is.
#[derive(Debug)]
pub enum ChunkSrc {
    /// In stream slot `slot` (`gen`) of the link, at arena `offset`; ours
    /// until `chunk_copied` gives it back.
    Slot { slot: u32, gen: u32, offset: u64 },
    /// Carried by a `StreamData` message.
    Bytes(Vec<u8>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TxMode {
    /// `StreamBegin` sent, `StreamReady` not yet received.
    Waiting,
    Slots,
    Messages,
}

pub(super) struct TxStream {
    id: u32,
    key: String,
    pub(super) step: u64,
    payload: Arc<SharedPayload>,
    total: u64,
    mode: TxMode,
    /// Bytes handed to writes or messages so far.
    sent: u64,
    /// Chunk writes not completed, or messages not acknowledged.
    inflight: u32,
    /// Actions that still read `payload` (see the module docs): `done`
    /// waits for them.
    reading: u32,
    /// A tombstone's outcome (the stream failed; `done` runs with it when
    /// `reading` is 0).
    pub(super) failed: Option<Error>,
    done: Option<SendDone>,
}

/// Streams that failed while actions still read their payload, by (link,
/// stream): kept, past their link's end, until the last one is back.
pub(super) type Ending = HashMap<(LinkId, u32), TxStream>;

impl TxStream {
    /// The stream ended with `result`: its `done` now if nothing reads its
    /// payload any more, else it waits in `ending` as a tombstone.
    fn settle(mut self, link: LinkId, result: Result<()>, ending: &mut Ending) -> Option<Action> {
        if self.reading == 0 {
            return self.done.take().map(|done| Action::SendDone { done, result });
        }
        self.failed = Some(result.err().unwrap_or_else(|| Error::Internal("stream settled while still reading".into())));
        ending.insert((link, self.id), self);
        None
    }

    pub(super) fn describe(&self) -> String {
        format!(" [stream {} {} step {} {:?} {}/{} in flight {} reading {}]", self.id, self.key, self.step, self.mode, self.sent, self.total, self.inflight, self.reading)
    }

    /// Sent whole, and nothing outstanding or reading.
    fn finished(&self) -> bool {
        self.sent == self.total && self.inflight == 0 && self.reading == 0
    }
}

/// The node is gone with streams still ending: each tombstone's `done`
/// goes with its payload, to run when the last chunk that reads it lets
/// go (at once if none does any more).
pub(super) fn bury(ending: &mut Ending) {
    for (_, mut s) in ending.drain() {
        if let Some(done) = s.done.take() {
            let why = s.failed.take().unwrap_or_else(|| Error::Aborted("transport shut down".into()));
            *s.payload.on_last.lock() = Some((done, why));
        }
    }
}

/// One action that read a tombstone's payload is back: its `done`, if that
/// was the last.
fn tombstone_back(ending: &mut Ending, link: LinkId, stream: u32) -> Option<Actions> {
    let s = ending.get_mut(&(link, stream))?;
    s.reading = s.reading.saturating_sub(1);
    if s.reading > 0 {
        return Some(Actions::new());
    }
    let mut s = ending.remove(&(link, stream))?;
    let why = s.failed.take().unwrap_or_else(|| Error::Internal("stream tombstone without an error".into()));
    Some(s.done.take().map(|done| smallvec![Action::SendDone { done, result: Err(why) }]).unwrap_or_default())
}

/// A sender link's streams under way.
pub(super) struct TxStreams {
    /// Round-robin order: the first stream with work gets the next slot and
    /// goes to the back.
    list: VecDeque<TxStream>,
    next_id: u32,
}

impl TxStreams {
    pub(super) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }
}

impl Default for TxStreams {
    fn default() -> TxStreams {
        TxStreams { list: VecDeque::new(), next_id: 1 }
    }
}

impl TxStreams {
    /// Open a stream for `p` (a tensor that cannot go through a slot).
    pub(super) fn begin(&mut self, link: LinkId, key: &str, p: Pending, tally: &mut Tally) -> Actions {
        let total = p.payload.bytes().len() as u64;
        tally.inline_tensors += 1;
        tally.inline_bytes += total;
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        let begin = Action::Send { link, msg: Msg::StreamBegin { stream: id, key: key.to_string(), step: p.step, meta: p.meta, total } };
        if total == 0 {
            return smallvec![begin, Action::SendDone { done: p.done, result: Ok(()) }];
        }
        let payload = SharedPayload::new(p.payload);
        self.list.push_back(TxStream {
            id,
            key: key.to_string(),
            step: p.step,
            payload,
            total,
            mode: TxMode::Waiting,
            sent: 0,
            inflight: 0,
            reading: 0,
            failed: None,
            done: Some(p.done),
        });
        smallvec![begin]
    }

    /// Fail the streams of `link` matching `pred`; with `tell`, say so to
    /// the receiver. Those with chunks still reading wait in `ending`.
    pub(super) fn fail(&mut self, link: LinkId, tell: bool, pred: impl Fn(&TxStream) -> bool, why: &Error, ending: &mut Ending) -> Actions {
        let mut acts = Actions::new();
        let (gone, keep): (VecDeque<TxStream>, VecDeque<TxStream>) = self.list.drain(..).partition(|s| pred(s));
        self.list = keep;
        for s in gone {
            if tell {
                acts.push(Action::Send { link, msg: Msg::StreamCancel { stream: s.id } });
            }
            acts.extend(s.settle(link, Err(why.clone()), ending));
        }
        acts
    }

    fn take(&mut self, id: u32) -> Option<TxStream> {
        let i = self.list.iter().position(|s| s.id == id)?;
        self.list.remove(i)
    }

    pub(super) fn describe(&self) -> String {
        self.list.iter().map(TxStream::describe).collect()
    }
}

/// State of a stream at the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RxMode {
    /// Waiting for its buffer (`StreamAlloc`).
    Alloc,
    /// Chunks of `chunk` bytes come through the stream slots.
    Slots { chunk: u64 },
    /// Chunks come as `StreamData`, in order.
    Messages,
}

pub(super) struct RxStream {
    key: String,
    step: u64,
    meta: TensorMeta,
    total: u64,
    mode: RxMode,
    buf: Option<Arc<StreamBuf>>,
    /// Slots mode: which chunks arrived (bit per chunk index).
    seen: Vec<u64>,
    /// Bytes accepted (Messages mode: the next offset expected).
    accepted: u64,
    /// Bytes copied into `buf`.
    copied: u64,
}

impl Rendezvous {
    /// Every free stream slot gets the next chunk (round-robin over the
    /// link's streams); message-mode streams fill their window.
    pub(super) fn pump_streams(&mut self, link: LinkId) -> Actions {
        let incarnation = self.params.incarnation;
        let mut acts = Actions::new();
        let Some(t) = self.tx.get_mut(&link) else { return acts };
        let streams = &mut t.streams.list;
        if let Some(e) = t.edges.get_mut(STREAM_KEY) {
            for (d, free) in e.slots.iter_mut() {
                if !*free || d.capacity == 0 {
                    continue;
                }
                let Some(i) = streams.iter().position(|s| s.mode == TxMode::Slots && s.sent < s.total) else { break };
                let Some(mut s) = streams.remove(i) else { break };
                let len = d.capacity.min(s.total - s.sent);
                let header = SlotHeader {
                    edge_id: e.edge_id.unwrap_or(0),
                    slot: d.id,
                    gen: d.gen,
                    incarnation,
                    step: s.step,
                    len,
                    meta: TensorMeta::default(),
                    chunk: Some(ChunkAt { stream: s.id, offset: s.sent }),
                };
                let payload = Box::new(PayloadRange { whole: s.payload.clone(), off: s.sent as usize, len: len as usize });
                acts.push(Action::WriteChunk { link, stream: s.id, offset: d.offset, key: d.key, header, payload, imm: d.id });
                *free = false;
                s.sent += len;
                s.inflight += 1;
                s.reading += 1;
                self.tally.stream_chunks += 1;
                streams.push_back(s);
            }
        }
        for s in streams.iter_mut().filter(|s| s.mode == TxMode::Messages) {
            while s.inflight < STREAM_MSG_WINDOW && s.sent < s.total {
                let len = (STREAM_MSG_BYTES as u64).min(s.total - s.sent);
                let payload = Box::new(PayloadRange { whole: s.payload.clone(), off: s.sent as usize, len: len as usize });
                acts.push(Action::SendChunk { link, stream: s.id, offset: s.sent, payload });
                s.sent += len;
                s.inflight += 1;
                s.reading += 1;
                self.tally.stream_messages += 1;
            }
        }
        acts
    }

    /// A chunk write of `stream` on `link` completed with `res` (it reads
    /// the payload no more).
    pub fn chunk_written(&mut self, link: LinkId, stream: u32, res: crate::error::Result<()>) -> Actions {
        self.chunk_done(link, stream, true, res)
    }

    /// A `SendChunk` of `stream` on `link` was carried out (its bytes were
    /// copied into a message, sent or not): it reads the payload no more.
    pub fn chunk_sent(&mut self, link: LinkId, stream: u32) -> Actions {
        self.chunk_done(link, stream, false, Ok(()))
    }

    /// A chunk of `stream` reads the payload no more (`written`: it was a
    /// write, in flight until now): the send completes once nothing reads
    /// it and the stream is over; a failed write fails the stream.
    fn chunk_done(&mut self, link: LinkId, stream: u32, written: bool, res: crate::error::Result<()>) -> Actions {
        if let Some(acts) = tombstone_back(&mut self.tx_ending, link, stream) {
            return acts;
        }
        let Some(t) = self.tx.get_mut(&link) else { return Actions::new() };
        let Some(i) = t.streams.list.iter().position(|s| s.id == stream) else { return Actions::new() };
        let s = &mut t.streams.list[i];
        if written {
            s.inflight = s.inflight.saturating_sub(1);
        }
        s.reading = s.reading.saturating_sub(1);
        match res {
            Err(e) => {
                let mut acts = smallvec![Action::Send { link, msg: Msg::StreamCancel { stream } }];
                if let Some(s) = t.streams.list.remove(i) {
                    acts.extend(s.settle(link, Err(e), &mut self.tx_ending));
                }
                acts
            }
            Ok(()) if s.finished() => {
                let done = t.streams.list.remove(i).and_then(|mut s| s.done.take());
                done.map(|done| smallvec![Action::SendDone { done, result: Ok(()) }]).unwrap_or_default()
            }
            Ok(()) => Actions::new(),
        }
    }

    pub(super) fn tx_stream_ready(&mut self, link: LinkId, stream: u32, outcome: u32, error: String) -> Result<Actions> {
        let t = self.tx.get_mut(&link).ok_or_else(|| Error::Internal("stream ready on unknown link".into()))?;
        let Some(s) = t.streams.list.iter_mut().find(|s| s.id == stream) else {
            // Cancelled meanwhile: our StreamCancel may have reached the
            // receiver before its begin did, so it made room for a stream
            // nobody will send. Say it again; it frees what it holds.
            // (One answer per ready: nothing for a peer to amplify.)
            if outcome == STREAM_REFUSED {
                return Ok(Actions::new());
            }
            return Ok(smallvec![Action::Send { link, msg: Msg::StreamCancel { stream } }]);
        };
        if s.mode != TxMode::Waiting {
            return Err(Error::Protocol(format!("second StreamReady for stream {stream}")));
        }
        match outcome {
            STREAM_SLOTS => s.mode = TxMode::Slots,
            STREAM_MESSAGES => {
                log::info!("receiver {} has no room for stream slots: {} goes through control messages", t.peer, s.key);
                s.mode = TxMode::Messages;
            }
            STREAM_REFUSED => {
                let s = t.streams.take(stream).expect("found above");
                let why = Error::ResourceExhausted(format!("{} refused {} in step {} ({} bytes): {error}", t.peer, s.key, s.step, s.total));
                return Ok(s.settle(link, Err(why), &mut self.tx_ending).into_iter().collect());
            }
            o => return Err(Error::Protocol(format!("StreamReady with unknown outcome {o}"))),
        }
        Ok(self.pump_streams(link))
    }

    pub(super) fn tx_stream_ack(&mut self, link: LinkId, stream: u32) -> Result<Actions> {
        let t = self.tx.get_mut(&link).ok_or_else(|| Error::Internal("stream ack on unknown link".into()))?;
        let Some(i) = t.streams.list.iter().position(|s| s.id == stream) else { return Ok(Actions::new()) };
        let s = &mut t.streams.list[i];
        if s.mode != TxMode::Messages || s.inflight == 0 {
            return Err(Error::Protocol(format!("StreamAck for stream {stream}, which has no message unacknowledged")));
        }
        s.inflight -= 1;
        if s.finished() {
            let done = t.streams.list.remove(i).and_then(|mut s| s.done.take());
            return Ok(done.map(|done| smallvec![Action::SendDone { done, result: Ok(()) }]).unwrap_or_default());
        }
        Ok(self.pump_streams(link))
    }

    /// The receiver discarded `stream` (e.g. its step finished there).
    pub(super) fn tx_stream_cancel(&mut self, link: LinkId, stream: u32) -> Actions {
        let Some(t) = self.tx.get_mut(&link) else { return Actions::new() };
        let peer = t.peer.clone();
        let Some(s) = t.streams.take(stream) else { return Actions::new() };
        let why = Error::Aborted(format!("{peer} discarded {} in step {} (its step ended)", s.key, s.step));
        s.settle(link, Err(why), &mut self.tx_ending).into_iter().collect()
    }

    pub(super) fn rx_stream_begin(&mut self, link: LinkId, stream: u32, key: String, step: u64, meta: TensorMeta, total: u64) -> Result<Actions> {
        // The limit holds for the whole node, not per link: every sending
        // peer's open streams count (each is allocated whole), and so do
        // streamed tensors that arrived and wait for their receives.
        let open: u64 = self.rx.values().map(|r| r.streams.bytes()).fold(self.table.owned_bytes(), u64::saturating_add);
        let r = self.rx.get_mut(&link).ok_or_else(|| Error::Internal("stream on unknown link".into()))?;
        if key == STREAM_KEY {
            return Err(Error::Protocol("stream for the reserved key".into()));
        }
        if r.streams.len() >= MAX_STREAMS_PER_LINK {
            return Err(Error::Protocol(format!("more than {MAX_STREAMS_PER_LINK} streams open")));
        }
        let cancelled_early = r.cancelled_unbegun.remove(&stream);
        if stream == 0 {
            return Err(Error::Protocol("stream id 0".into()));
        }
        if !after(stream, r.last_stream) {
            // Overtaken by a later stream's begin: only an id skipped
            // then may come now, and only once.
            if !r.unbegun.remove(&stream) {
                return Err(Error::Protocol(format!("stream id {stream} reused (last begun {})", r.last_stream)));
            }
        } else {
            let skipped = skipped_ids(r.last_stream, stream);
            if skipped > MAX_STREAMS_OVERTAKEN - r.unbegun.len().min(MAX_STREAMS_OVERTAKEN) {
                return Err(Error::Protocol(format!(
                    "stream id {stream} skips {skipped} ids after {} with {} skipped before still to come; at most {MAX_STREAMS_OVERTAKEN} may be",
                    r.last_stream,
                    r.unbegun.len()
                )));
            }
            r.unbegun.extend(ids_between(r.last_stream, stream));
            r.last_stream = stream;
        }
        if cancelled_early {
            // Its sender gave it up before this begin arrived (the cancel
            // overtook it): nothing is allocated, the receive fails.
            let why = Error::Aborted(format!("{} gave up sending {key} in step {step}", r.peer));
            return Ok(self.fail_receive(link, &key, step, why));
        }
        if self.finished_set.contains(&step) {
            self.tally.dropped_late += 1;
            return Ok(smallvec![Action::Send { link, msg: Msg::StreamCancel { stream } }]);
        }
        if total > MAX_STREAM_TOTAL.saturating_sub(open) {
            let error = format!("{total} bytes (with {open} bytes of streams open, or arrived and not yet received, from all peers) exceed the receiver's limit of {MAX_STREAM_TOTAL}");
            let why = Error::ResourceExhausted(format!("{key} in step {step} from {}: {error}", r.peer));
            let mut acts = smallvec![Action::Send { link, msg: Msg::StreamReady { stream, outcome: STREAM_REFUSED, error } }];
            acts.extend(self.fail_receive(link, &key, step, why));
            return Ok(acts);
        }
        if total == 0 {
            let key = self.names.intern(&key);
            return Ok(self.arrive(key, step, Received { meta, data: Data::Owned(Vec::new()) }, link));
        }
        r.streams.insert(stream, RxStream { key, step, meta, total, mode: RxMode::Alloc, buf: None, seen: Vec::new(), accepted: 0, copied: 0 });
        Ok(smallvec![Action::StreamAlloc { link, stream, total }])
    }

    /// The destination of `stream` is allocated (`None`: no memory).
    pub fn stream_alloc_done(&mut self, link: LinkId, stream: u32, buf: Option<Vec<u8>>) -> Actions {
        let Some(r) = self.rx.get_mut(&link) else { return Actions::new() };
        let Some(s) = r.streams.get_mut(&stream).filter(|s| s.mode == RxMode::Alloc) else { return Actions::new() };
        let Some(buf) = buf.filter(|b| b.len() as u64 == s.total) else {
            let s = r.streams.remove(&stream).expect("found above");
            let error = format!("the receiver has no memory for {} bytes", s.total);
            log::warn!("{} in step {} from {}: {error}", s.key, s.step, r.peer);
            let why = Error::ResourceExhausted(format!("{} in step {} from {}: {error}", s.key, s.step, r.peer));
            let mut acts = smallvec![Action::Send { link, msg: Msg::StreamReady { stream, outcome: STREAM_REFUSED, error } }];
            acts.extend(self.fail_receive(link, &s.key, s.step, why));
            return acts;
        };
        s.buf = Some(Arc::new(StreamBuf::new(buf)));
        let (mut acts, chunk) = self.stream_slots(link);
        let Some(s) = self.rx.get_mut(&link).and_then(|r| r.streams.get_mut(&stream)) else { return acts };
        let outcome = match chunk {
            Some(chunk) => {
                s.mode = RxMode::Slots { chunk };
                s.seen = vec![0; s.total.div_ceil(chunk).div_ceil(64) as usize];
                STREAM_SLOTS
            }
            None => {
                s.mode = RxMode::Messages;
                s.seen = vec![0; s.total.div_ceil(STREAM_MSG_BYTES as u64).div_ceil(64) as usize];
                STREAM_MESSAGES
            }
        };
        acts.push(Action::Send { link, msg: Msg::StreamReady { stream, outcome, error: String::new() } });
        acts
    }

    /// The link's stream slots, placed (and published) on first need:
    /// their capacity, or None if they cannot be placed now.
    fn stream_slots(&mut self, link: LinkId) -> (Actions, Option<u64>) {
        let Some(r) = self.rx.get_mut(&link) else { return (Actions::new(), None) };
        if let Some(e) = r.stream_edge.and_then(|id| r.edge_info.get(&id)) {
            if let Some(s) = e.set.first().and_then(|id| r.slots.get(id)) {
                return (Actions::new(), Some(s.capacity));
            }
        }
        let Some(cap) = stream_chunk_bytes(self.alloc.total()) else { return (Actions::new(), None) };
        let Some(reserved) = self.alloc.slot_bytes(cap) else { return (Actions::new(), None) };
        let edge_id = match r.stream_edge {
            Some(id) => id,
            None => {
                let id = r.next_edge;
                r.next_edge += 1;
                r.edge_info.insert(id, RxEdge { key: Arc::from(STREAM_KEY), set: Vec::new(), last_used: self.clock, revoking: false, more_wanted: None });
                r.stream_edge = Some(id);
                id
            }
        };
        let mut descs = Vec::new();
        for _ in 0..SLOTS_PER_LINK {
            let Some(off) = self.alloc.alloc(reserved) else { break };
            descs.push(r.new_slot(link, edge_id, off, reserved, &mut self.next_gen, &self.granter, &mut self.refused));
        }
        if descs.is_empty() {
            log::warn!(
                "receive arena full ({} of {} bytes placed): no stream slots for {}; its large tensors go through control messages (slow); raise RDMA_DEVICE_ARENA_BYTES",
                self.alloc.in_use(),
                self.alloc.total(),
                r.peer
            );
            return (self.reclaim_cold(link, edge_id, reserved), None);
        }
        let cap = descs[0].capacity;
        if let Some(e) = r.edge_info.get_mut(&edge_id) {
            e.set = descs.iter().map(|d| d.id).collect();
        }
        self.tally.negotiation_messages += 1;
        (smallvec![Action::Send { link, msg: Msg::Publish { key: STREAM_KEY.to_string(), edge_id, slots: descs } }], Some(cap))
    }

    /// A chunk landed in stream slot `imm` (`gen`, at arena `slot_off`);
    /// the header was checked against the slot already.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rx_chunk(&mut self, link: LinkId, imm: u32, gen: u32, slot_off: u64, step: u64, len: u64, c: ChunkAt) -> Actions {
        let Some(r) = self.rx.get_mut(&link) else { return Actions::new() };
        let bad = |why: String| smallvec![Action::Close { link, why: Error::Protocol(format!("stream {}: {why}", c.stream)) }];
        let Some(s) = r.streams.get_mut(&c.stream) else {
            if c.stream == 0 || after(c.stream, r.last_stream) || r.unbegun.contains(&c.stream) {
                self.tally.rejected_writes += 1;
                return bad("chunk of a stream never begun".into());
            }
            // A stream that ended here (discarded, cancelled) while this
            // chunk was on its way: drop it, give the slot back.
            if let Some(sl) = r.slots.get_mut(&imm) {
                sl.token = Token::AtReceiver;
            }
            self.tally.dropped_late += 1;
            return self.release(link, imm, gen);
        };
        let RxMode::Slots { chunk } = s.mode else {
            self.tally.rejected_writes += 1;
            return bad("chunk before StreamReady or in message mode".into());
        };
        let idx = c.offset / chunk;
        let expect = s.total.saturating_sub(c.offset).min(chunk);
        let (word, bit) = ((idx / 64) as usize, 1u64 << (idx % 64));
        let dup = s.seen.get(word).map_or(true, |w| w & bit != 0);
        if step != s.step || c.offset % chunk != 0 || c.offset >= s.total || len != expect || dup {
            self.tally.rejected_writes += 1;
            return bad(format!(
                "bad chunk: step {step} at {} with {len} bytes (stream of step {}, {} bytes in chunks of {chunk}{})",
                c.offset,
                s.step,
                s.total,
                if dup { ", a duplicate" } else { "" }
            ));
        }
        s.seen[word] |= bit;
        s.accepted += len;
        let Some(dst) = s.buf.clone() else { return bad("no buffer".into()) };
        if let Some(sl) = r.slots.get_mut(&imm) {
            sl.token = Token::AtReceiver;
        }
        let src = ChunkSrc::Slot { slot: imm, gen, offset: slot_off + HEADER_BYTES as u64 };
        smallvec![Action::CopyChunk { link, stream: c.stream, src, len, dst, at: c.offset }]
    }

    pub(super) fn rx_stream_data(&mut self, link: LinkId, stream: u32, offset: u64, bytes: Vec<u8>) -> Result<Actions> {
        let r = self.rx.get_mut(&link).ok_or_else(|| Error::Internal("stream data on unknown link".into()))?;
        let Some(s) = r.streams.get_mut(&stream) else {
            if stream == 0 || after(stream, r.last_stream) {
                return Err(Error::Protocol(format!("data of stream {stream}, never begun")));
            }
            return Ok(Actions::new());
        };
        // Chunks come in pieces of STREAM_MSG_BYTES at their offsets, in
        // any order: the sender's pumps run on whichever thread holds the
        // protocol lock (a TF thread's send, rdev-callbacks after an ack)
        // and send after it, so two chunks can race on the socket (the
        // simulation found it). Each is taken once.
        let len = bytes.len() as u64;
        let piece = STREAM_MSG_BYTES as u64;
        let idx = offset / piece;
        let (word, bit) = ((idx / 64) as usize, 1u64 << (idx % 64));
        let dup = s.seen.get(word).map_or(true, |w| w & bit != 0);
        let expect = s.total.saturating_sub(offset).min(piece);
        if s.mode != RxMode::Messages || offset % piece != 0 || offset >= s.total || len == 0 || len != expect || dup {
            return Err(Error::Protocol(format!(
                "stream {stream}: data at {offset} with {len} bytes inconsistent or a duplicate ({} of {} bytes taken, {:?})",
                s.accepted, s.total, s.mode
            )));
        }
        s.seen[word] |= bit;
        s.accepted += len;
        let Some(dst) = s.buf.clone() else { return Err(Error::Internal("stream without a buffer".into())) };
        Ok(smallvec![Action::CopyChunk { link, stream, src: ChunkSrc::Bytes(bytes), len, dst, at: offset }])
    }

    /// A chunk of `stream` (from stream slot `slot`, or from a message when
    /// None) was copied into its buffer (`res`): give the slot back (or
    /// acknowledge the message); the tensor arrives with its last byte.
    pub fn chunk_copied(&mut self, link: LinkId, stream: u32, slot: Option<(u32, u32)>, len: u64, res: Result<()>) -> Actions {
        let mut acts = match slot {
            Some((slot, gen)) => self.release(link, slot, gen),
            None => Actions::new(),
        };
        if let Err(why) = res {
            acts.push(Action::Close { link, why });
            return acts;
        }
        let Some(r) = self.rx.get_mut(&link) else { return acts };
        let Some(s) = r.streams.get_mut(&stream) else { return acts };
        if slot.is_none() {
            acts.push(Action::Send { link, msg: Msg::StreamAck { stream } });
        }
        s.copied += len;
        if s.copied < s.total {
            return acts;
        }
        let s = r.streams.remove(&stream).expect("found above");
        let buf = s.buf.map(Arc::try_unwrap);
        match buf {
            Some(Ok(b)) => {
                let key = self.names.intern(&s.key);
                acts.extend(self.arrive(key, s.step, Received { meta: s.meta, data: Data::Owned(b.into_vec()) }, link))
            }
            _ => acts.push(Action::Close { link, why: Error::Internal(format!("stream {stream}: buffer still in use when complete")) }),
        }
        acts
    }

    /// The sender gave up `stream`: its receive fails.
    /// A cancel may overtake its stream's begin (the sender's threads send
    /// begins as they go): it is kept until the begin comes, at most
    /// `MAX_STREAMS_OVERTAKEN` at once (more is out of protocol).
    pub(super) fn rx_stream_cancel(&mut self, link: LinkId, stream: u32) -> Result<Actions> {
        let Some(r) = self.rx.get_mut(&link) else { return Ok(Actions::new()) };
        let Some(s) = r.streams.remove(&stream) else {
            let unbegun = stream != 0 && (after(stream, r.last_stream) || r.unbegun.contains(&stream));
            if unbegun && !r.cancelled_unbegun.contains(&stream) {
                if r.cancelled_unbegun.len() >= MAX_STREAMS_OVERTAKEN {
                    return Err(Error::Protocol(format!("more than {MAX_STREAMS_OVERTAKEN} streams cancelled before they began")));
                }
                r.cancelled_unbegun.insert(stream);
            }
            return Ok(Actions::new());
        };
        let why = Error::Aborted(format!("{} gave up sending {} in step {}", r.peer, s.key, s.step));
        Ok(self.fail_receive(link, &s.key, s.step, why))
    }

    /// The step ended here: drop its streams (and their buffers), telling
    /// their senders.
    pub(super) fn rx_discard_streams(&mut self, step: u64) -> Actions {
        let mut acts = Actions::new();
        for (link, r) in self.rx.iter_mut() {
            r.streams.drain_step(step, |id| acts.push(Action::Send { link: *link, msg: Msg::StreamCancel { stream: id } }));
        }
        acts
    }
}

/// For diagnostics.
pub(super) fn describe_rx(streams: &RxStreams) -> String {
    streams.iter().map(|(id, s)| format!(" [stream {id} {} step {} {:?} {}/{} copied {}]", s.key, s.step, s.mode, s.accepted, s.total, s.copied)).collect()
}
