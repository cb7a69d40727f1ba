//! A streamed tensor at its receiver: a stream begun, its destination
//! allocated, the link's stream slots placed on first need, each chunk
//! checked and copied, and the tensor arrived with its last byte (see the
//! module docs of `stream`).

use std::sync::Arc;

use super::{after, ids_between, skipped_ids, stream_chunk_bytes, ChunkSrc, RxStreams, StreamBuf, MAX_STREAMS_OVERTAKEN, STREAM_KEY};
use crate::constants::{HEADER_BYTES, MAX_STREAM_TOTAL, STREAM_MSG_BYTES, STREAM_SLOTS as SLOTS_PER_LINK};
use crate::error::{Error, Result};
use crate::rendezvous::records::{RxEdge, Token};
use crate::rendezvous::wire::{ChunkAt, Msg, TensorMeta, STREAM_MESSAGES, STREAM_REFUSED, STREAM_SLOTS};
use crate::rendezvous::{smallvec, Action, Actions, Data, LinkId, Received, Rendezvous};

/// Most streams one sender may have open at a receiver at once.
const MAX_STREAMS_PER_LINK: usize = 1 << 16;

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

pub(in crate::rendezvous) struct RxStream {
    key: String,
    pub(super) step: u64,
    meta: TensorMeta,
    pub(super) total: u64,
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
    pub(in crate::rendezvous) fn rx_stream_begin(&mut self, link: LinkId, stream: u32, key: String, step: u64, meta: TensorMeta, total: u64) -> Result<Actions> {
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
    pub(in crate::rendezvous) fn rx_chunk(&mut self, link: LinkId, imm: u32, gen: u32, slot_off: u64, step: u64, len: u64, c: ChunkAt) -> Actions {
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

    pub(in crate::rendezvous) fn rx_stream_data(&mut self, link: LinkId, stream: u32, offset: u64, bytes: Vec<u8>) -> Result<Actions> {
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
    pub(in crate::rendezvous) fn rx_stream_cancel(&mut self, link: LinkId, stream: u32) -> Result<Actions> {
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
    pub(in crate::rendezvous) fn rx_discard_streams(&mut self, step: u64) -> Actions {
        let mut acts = Actions::new();
        for (link, r) in self.rx.iter_mut() {
            r.streams.drain_step(step, |id| acts.push(Action::Send { link: *link, msg: Msg::StreamCancel { stream: id } }));
        }
        acts
    }
}

/// For diagnostics.
pub(in crate::rendezvous) fn describe_rx(streams: &RxStreams) -> String {
    streams.iter().map(|(id, s)| format!(" [stream {id} {} step {} {:?} {}/{} copied {}]", s.key, s.step, s.mode, s.accepted, s.total, s.copied)).collect()
}
