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
//!   unacknowledged per stream (the `Inline` messages of protocol version
//!   2, which streams replaced, were all built up front and posted at once,
//!   which on verbs overran the queue at ~1 GiB).
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
//!
//! Files: what both ends share here (stream ids, the destination buffer,
//! the shared payload and its ranges); the sender's side in `tx`, the
//! receiver's in `rx`, its index of open streams in `open`.
//!
//! [`Rendezvous::chunk_written`]: super::Rendezvous::chunk_written
//! [`Rendezvous::chunk_sent`]: super::Rendezvous::chunk_sent

use std::sync::Arc;

use crate::sync::Mutex;

use super::{Payload, SendDone};
use crate::constants::{HEADER_BYTES, SLOT_ALIGN, STREAM_ARENA_FRACTION, STREAM_CHUNK_BYTES, STREAM_MIN_CHUNK, STREAM_SLOTS as SLOTS_PER_LINK};
use crate::error::{Error, Result};


/// Key of a link's stream-slot edge. TensorFlow keys start with "/job:",
/// never with a NUL; a sender may not use it.
pub const STREAM_KEY: &str = "\0rdma_device:stream";

mod open;
pub(super) use open::RxStreams;
mod rx;
mod tx;
pub(super) use rx::describe_rx;
pub(super) use tx::{bury, Ending, TxStreams};

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
