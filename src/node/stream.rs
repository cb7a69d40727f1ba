//! The node's part of streamed tensors (see `rendezvous::stream`): the
//! memory work the protocol asks for, done outside its lock.
//!
//! - `WriteChunk`: the one-sided write of a chunk. On shm that write is a
//!   memcpy of up to 16 MiB on the calling thread, so it runs on the
//!   [`pool::STREAM`] threads, never on a progress thread (credits arrive
//!   there) or a TensorFlow thread.
//! - `CopyChunk`: the receiver's copy of a chunk from its stream slot into
//!   the tensor's buffer, on the same pool for the same reason; a chunk
//!   carried by a message (at most 64 KiB) is copied where it is handled.
//! - `StreamAlloc`: the tensor's buffer, zeroed by the allocator (calloc:
//!   fresh pages for large sizes, so no pass over the memory here), failing
//!   as a value rather than aborting the process.
//!
//! Locks: none held while copying but the destination's own (one per
//! stream, a leaf); the protocol lock only to report the result.

use std::sync::{Arc, Weak};

use super::pool;
use super::write::{TensorWrite, Then, WriteHost};
use super::Inner;
use crate::error::{Error, Result};
use crate::fabric::{ConnId, Endpoint};
use crate::rendezvous::{self, ChunkSrc, Payload, StreamBuf};

/// `n` zeroed bytes, or None if the allocator refuses.
pub(super) fn zeroed(n: u64) -> Option<Vec<u8>> {
    let n = usize::try_from(n).ok()?;
    if n == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(n).ok()?;
    // SAFETY: the layout has a non-zero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` comes from the global allocator with exactly the layout
    // of a Vec<u8> of capacity `n` (align 1), and all `n` bytes are
    // initialised (zero).
    Some(unsafe { Vec::from_raw_parts(p, n, n) })
}

/// The write of a stream chunk (an rdev-stream job): its completion, or
/// its drop unfinished, reports the chunk to `host` (`chunk_written`).
#[allow(clippy::too_many_arguments)]
pub(super) fn write_chunk_now(
    ep: &dyn Endpoint,
    host: Weak<dyn WriteHost>,
    link: ConnId,
    stream: u32,
    offset: u64,
    key: u32,
    header: rendezvous::SlotHeader,
    payload: Box<dyn Payload>,
    imm: u32,
) {
    let op = TensorWrite::new(header.encode(), payload, Then::Chunk(stream), host, link);
    ep.write(offset, key, imm, op);
}

/// The copy of a chunk from its stream slot (an rdev-stream job): `copy`
/// fills `dst`. A panic in it fails the chunk (L4: it was lost, and the
/// stream's receive waited until its step ended), and `dst` is let go
/// before the caller reports the result (`chunk_copied` of the last chunk
/// takes the buffer whole).
pub(super) fn copy_slot_chunk(dst: Arc<StreamBuf>, copy: impl FnOnce(&StreamBuf) -> Result<()>) -> Result<()> {
    let res = crate::error::catch_panic("copying a stream chunk", || copy(&dst)).and_then(|r| r);
    drop(dst);
    res
}

impl Inner {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn write_chunk(&self, link: ConnId, stream: u32, offset: u64, key: u32, header: rendezvous::SlotHeader, payload: Box<dyn Payload>, imm: u32) {
        let Some(ep) = self.endpoint(link) else {
            let acts = self.locked(|r| r.chunk_written(link, stream, Err(Error::PeerLost(format!("connection {link} is closed")))));
            self.exec(acts);
            return;
        };
        let me = self.me.clone();
        pool::STREAM.schedule(move || write_chunk_now(&*ep, me, link, stream, offset, key, header, payload, imm));
    }

    pub(super) fn send_chunk(&self, link: ConnId, stream: u32, offset: u64, payload: Box<dyn Payload>) {
        let msg = rendezvous::Msg::StreamData { stream, offset, bytes: payload.bytes().to_vec() };
        drop(payload);
        // The payload is read no more: the stream's done may run now.
        let acts = self.locked(|r| r.chunk_sent(link, stream));
        self.exec(acts);
        if let Err(e) = self.send_msg(link, &msg) {
            let why = Error::PeerLost(format!("{}: stream data on connection {link} not sent: {}", self.task, e.message()));
            self.fail_link(link, why);
        }
    }

    pub(super) fn stream_alloc(&self, link: ConnId, stream: u32, total: u64) {
        // Up to MAX_STREAM_TOTAL bytes: never on a backend's event thread
        // (exec hands it to rdev-callbacks); checked in debug builds.
        debug_assert!(!crate::fabric::on_event_thread(), "a stream's buffer allocated on an event thread");
        let buf = zeroed(total);
        let acts = self.locked(|r| r.stream_alloc_done(link, stream, buf));
        self.exec(acts);
    }

    pub(super) fn copy_chunk(&self, link: ConnId, stream: u32, src: ChunkSrc, len: u64, dst: Arc<StreamBuf>, at: u64) {
        match src {
            ChunkSrc::Bytes(b) => {
                let res = dst.write_at(at, &b);
                drop(dst);
                let acts = self.locked(|r| r.chunk_copied(link, stream, None, len, res));
                self.exec(acts);
            }
            ChunkSrc::Slot { slot, gen, offset } => {
                let me = self.me.clone();
                pool::STREAM.schedule(move || {
                    let Some(n) = me.upgrade() else { return };
                    let res = copy_slot_chunk(dst, |dst| n.copy_from_arena(offset, len, dst, at));
                    let acts = n.locked(|r| r.chunk_copied(link, stream, Some((slot, gen)), len, res));
                    n.exec(acts);
                });
            }
        }
    }

    /// Copy `len` bytes at arena `offset` (a slot the protocol gave us) to
    /// `dst` at `at`.
    fn copy_from_arena(&self, offset: u64, len: u64, dst: &StreamBuf, at: u64) -> Result<()> {
        let (Ok(off), Ok(n)) = (usize::try_from(offset), usize::try_from(len)) else {
            return Err(Error::Internal("chunk range overflows".into()));
        };
        if off.checked_add(n).map_or(true, |end| end > self.arena.len()) {
            return Err(Error::Internal(format!("chunk {off}+{n} outside the arena of {} bytes", self.arena.len())));
        }
        // SAFETY: the range lies inside the arena mapping (checked above),
        // which `self.arena` keeps alive, and its slot is ours (token with
        // the receiver) until `chunk_copied` gives it back: no writer
        // touches it meanwhile.
        let src = unsafe { std::slice::from_raw_parts(self.arena.as_ptr().add(off) as *const u8, n) };
        dst.write_at(at, src)
    }
}

#[cfg(all(test, feature = "shuttle"))]
mod sched_tests;
