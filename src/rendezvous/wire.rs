//! Control messages and the slot header, encoded by hand (little endian,
//! length-prefixed strings). Decoding is total: any malformed or truncated
//! input becomes `Error::Protocol`, never a panic or a huge allocation.
//!
//! Files: the control messages here; the handshake (`hello`) and the
//! slot header (`header`) apart; the unit tests in `tests`.

use crate::constants::MAX_MSG_BYTES;
use crate::codec::{Reader, Writer};
use crate::error::{Error, Result};

mod header;
mod hello;
#[cfg(test)]
mod tests;
pub use header::{ChunkAt, SlotHeader};
pub use hello::Hello;

/// dtype, flags and shape of a tensor as the protocol carries them. `dtype`
/// is TensorFlow's DataType enum value, opaque here.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TensorMeta {
    pub dtype: u32,
    pub flags: u32,
    pub dims: Dims,
}

/// A shape: up to 8 dimensions inline (no allocation per tensor).
pub type Dims = smallvec::SmallVec<[i64; 8]>;

/// An encoded control message: the usual ones fit inline.
pub type MsgBytes = smallvec::SmallVec<[u8; 64]>;

/// The tensor is dead (a not-taken branch of a cond): no payload.
pub const FLAG_DEAD: u32 = 1;
/// The payload is an opaque serialization (strings, variants).
pub const FLAG_SERIALIZED: u32 = 2;

/// One receive slot as published to the sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotDesc {
    pub id: u32,
    pub gen: u32,
    /// Offset of the slot (its header) in the receiver's arena.
    pub offset: u64,
    /// Payload bytes the slot holds (after the header).
    pub capacity: u64,
    /// The key the sender writes this slot with (`Listener::grant`'s
    /// answer: verbs, the rkey of a memory window bound to the sender's
    /// connection; shm, unused).
    pub key: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    /// Sender → receiver: place (or re-place) `key` for `need` bytes; the
    /// sender gives back the free slots it held for that edge.
    Announce { key: String, step: u64, need: u64, returned: Vec<(u32, u32)> },
    /// Receiver → sender: the slots of `key` (replaces any earlier set).
    Publish { key: String, edge_id: u32, slots: Vec<SlotDesc> },
    /// Receiver → sender: a slot is free again.
    Credit { edge_id: u32, slot: u32, gen: u32 },
    /// Sender → receiver: a slot the sender no longer uses.
    ReturnSlot { slot: u32, gen: u32 },
    /// Receiver → sender: no room to place `need` bytes; stream it.
    NoSpace { key: String, need: u64 },
    /// Sender → receiver: every slot of the edge is busy (arrived or lent
    /// to the application): add one that holds `need` bytes.
    More { edge_id: u32, need: u64 },
    /// Receiver → sender: one more slot for an edge (answer to `More`).
    Grow { edge_id: u32, slot: SlotDesc },
    /// Receiver → sender: no slot can be added (limit or arena full).
    NoMore { edge_id: u32 },
    /// Receiver → sender: give back the slots of an idle edge (arena full).
    Revoke { edge_id: u32 },
    /// Either way: this task aborted `step`; fail what waits on us for it.
    /// `code`: the TensorFlow error code of the failure that made it abort
    /// (0: none given; the peer's receives then fail as aborted).
    Abort { step: u64, code: u32, reason: String },
    /// Either way: please place, as the sender, edge `key` towards
    /// `receiver` for `bytes` (static placement requested by the task that
    /// partitioned the graph); answer with `PlaceDone { req }`.
    PlaceFor { req: u64, receiver: String, key: String, bytes: u64 },
    /// Either way: outcome of `PlaceFor { req }`: 0 placed, 1 no room,
    /// 2 failed (`error` says why).
    PlaceDone { req: u64, outcome: u32, error: String },
    /// Receiver → sender, `RDMA_DEVICE_MODE=rpc` only: the receive of
    /// `(key, step)` is running; write the tensor when it is produced.
    Request { key: String, step: u64 },
    /// Sender → receiver, `RDMA_DEVICE_MODE=rpc` only, first on a new
    /// link: the link is up, requests may use it.
    Ready,
    /// Sender → receiver: tensor `(key, step)` of `total` bytes follows as
    /// stream `stream` (the sender numbers a link's streams 1, 2, 3, ...; a begin
    /// may overtake an earlier one, whose id then comes later, once).
    /// The sender waits for `StreamReady` before it writes any chunk.
    StreamBegin { stream: u32, key: String, step: u64, meta: TensorMeta, total: u64 },
    /// Receiver → sender: the destination of `stream` is allocated.
    /// `outcome`: `STREAM_SLOTS` (write chunks into the link's stream
    /// slots, published before this), `STREAM_MESSAGES` (no room for them:
    /// send `StreamData`), `STREAM_REFUSED` (`error` says why).
    StreamReady { stream: u32, outcome: u32, error: String },
    /// Sender → receiver, last resort: `bytes` at `offset` of `stream`.
    StreamData { stream: u32, offset: u64, bytes: Vec<u8> },
    /// Receiver → sender: one `StreamData` of `stream` was consumed.
    StreamAck { stream: u32 },
    /// Either way: `stream` is abandoned (receiver: discarded, e.g. its step
    /// finished; sender: it will send no more of it).
    StreamCancel { stream: u32 },
    /// Either way, no effect: a probe on a link with work waiting on the
    /// peer, so a peer whose host vanished is noticed (the transport fails
    /// the send) instead of waited for in silence (see `node::keepalive`).
    Ping,
    /// Either way: part of call `id` (the caller's, unique per caller) of
    /// `method` (a worker RPC of the shim, see `node::rpc`); `more`: parts
    /// follow (a body larger than one message is cut in parts); `part`:
    /// this part's index from 0, so a callee never mistakes the tail of a
    /// call it dropped (cancelled) for a new call.
    Call { id: u64, method: u32, part: u32, more: bool, body: Vec<u8> },
    /// Either way: part of the answer to call `id`: `code` 0 with the
    /// response, or an error code (TensorFlow's) with its message; `part`
    /// as in `Call`.
    Reply { id: u64, code: u32, part: u32, more: bool, body: Vec<u8> },
    /// Either way: the caller gave up call `id` (cancelled, timed out).
    CallCancel { id: u64 },
}

/// `StreamReady.outcome` values.
pub const STREAM_SLOTS: u32 = 0;
pub const STREAM_MESSAGES: u32 = 1;
pub const STREAM_REFUSED: u32 = 2;

const T_ANNOUNCE: u8 = 1;
const T_PUBLISH: u8 = 2;
const T_CREDIT: u8 = 3;
const T_RETURN: u8 = 4;
const T_NOSPACE: u8 = 5;
const T_REVOKE: u8 = 7;
const T_MORE: u8 = 8;
const T_NOMORE: u8 = 9;
const T_ABORT: u8 = 10;
const T_GROW: u8 = 11;
const T_PLACE_FOR: u8 = 12;
const T_PLACE_DONE: u8 = 13;
const T_REQUEST: u8 = 14;
const T_READY: u8 = 15;
const T_STREAM_BEGIN: u8 = 16;
const T_STREAM_READY: u8 = 17;
const T_STREAM_DATA: u8 = 18;
const T_STREAM_ACK: u8 = 19;
const T_STREAM_CANCEL: u8 = 20;
const T_PING: u8 = 21;
const T_CALL: u8 = 22;
const T_REPLY: u8 = 23;
const T_CALL_CANCEL: u8 = 24;

/// Whether an encoded message is a call's (`Call`, `Reply`,
/// `CallCancel`): those go to `node::rpc`, not to the rendezvous.
pub fn is_call(msg: &[u8]) -> bool {
    matches!(msg.first(), Some(&(T_CALL | T_REPLY | T_CALL_CANCEL)))
}

/// Most body bytes one `Call` or `Reply` part carries (with room for its
/// own fields within `MAX_MSG_BYTES`).
pub const CALL_PART_BYTES: usize = MAX_MSG_BYTES - 64;

/// `Announce.step` of a placement made ahead of time (from a static shape,
/// before the first step). TensorFlow's step ids use 56 bits, so this value
/// never names a real step.
pub const STEP_AHEAD: u64 = u64::MAX;

/// Longest rendezvous key accepted (TF keys are a few hundred bytes).
pub const MAX_KEY: usize = 4096;

/// `codec::Writer` with the wire's own fields.
struct W(Writer<MsgBytes>);
impl std::ops::Deref for W {
    type Target = Writer<MsgBytes>;
    fn deref(&self) -> &Self::Target { &self.0 }
}
impl std::ops::DerefMut for W {
    fn deref_mut(&mut self) -> &mut Self::Target { &mut self.0 }
}
impl W {
    fn new() -> W { W(Writer(MsgBytes::new())) }
    fn done(self) -> MsgBytes { self.0 .0 }
    /// Free text (a reason): cut to what the peer accepts, on a char boundary.
    fn text(&mut self, s: &str) { self.bytes(truncate(s, MAX_KEY).as_bytes()) }
    fn meta(&mut self, m: &TensorMeta) {
        self.u32(m.dtype);
        self.u32(m.flags);
        self.u32(m.dims.len() as u32);
        for d in &m.dims { self.u64(*d as u64) }
    }
}

/// `codec::Reader` with the wire's own fields.
struct R<'a>(Reader<'a>);
impl<'a> std::ops::Deref for R<'a> {
    type Target = Reader<'a>;
    fn deref(&self) -> &Self::Target { &self.0 }
}
impl std::ops::DerefMut for R<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target { &mut self.0 }
}
impl<'a> R<'a> {
    fn new(b: &'a [u8]) -> R<'a> { R(Reader::new(b)) }
    fn flag(&mut self) -> Result<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(Error::Protocol(format!("flag byte {v}"))),
        }
    }
    fn string(&mut self) -> Result<String> {
        String::from_utf8(self.bytes(MAX_KEY)?.to_vec()).map_err(|_| Error::Protocol("key is not UTF-8".into()))
    }
    fn count(&mut self, elem: usize) -> Result<usize> {
        let n = self.u32()? as usize;
        // Each element needs `elem` bytes: reject counts the message can't hold.
        if n.saturating_mul(elem) > self.remaining() {
            return Err(Error::Protocol(format!("count {n} exceeds the message")));
        }
        Ok(n)
    }
    fn meta(&mut self) -> Result<TensorMeta> {
        let dtype = self.u32()?;
        let flags = self.u32()?;
        let n = self.count(8)?;
        // n is bounded by the message's length (count).
        let mut dims = Dims::with_capacity(n);
        for _ in 0..n { dims.push(self.u64()? as i64) }
        Ok(TensorMeta { dtype, flags, dims })
    }
}

/// The longest prefix of `s` of at most `max` bytes that ends on a char
/// boundary.
pub fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl Msg {
    /// The message's type, for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Msg::Announce { .. } => "Announce",
            Msg::Publish { .. } => "Publish",
            Msg::Credit { .. } => "Credit",
            Msg::ReturnSlot { .. } => "ReturnSlot",
            Msg::NoSpace { .. } => "NoSpace",
            Msg::Revoke { .. } => "Revoke",
            Msg::More { .. } => "More",
            Msg::NoMore { .. } => "NoMore",
            Msg::Grow { .. } => "Grow",
            Msg::PlaceFor { .. } => "PlaceFor",
            Msg::PlaceDone { .. } => "PlaceDone",
            Msg::Abort { .. } => "Abort",
            Msg::Request { .. } => "Request",
            Msg::Ready => "Ready",
            Msg::StreamBegin { .. } => "StreamBegin",
            Msg::StreamReady { .. } => "StreamReady",
            Msg::StreamData { .. } => "StreamData",
            Msg::StreamAck { .. } => "StreamAck",
            Msg::StreamCancel { .. } => "StreamCancel",
            Msg::Ping => "Ping",
            Msg::Call { .. } => "Call",
            Msg::Reply { .. } => "Reply",
            Msg::CallCancel { .. } => "CallCancel",
        }
    }

    /// Would the peer accept this message's fields? Keys longer than
    /// `MAX_KEY` are refused here, at the sender, rather than closing the
    /// link at the receiver (reasons are truncated by `encode` instead).
    pub fn check(&self) -> Result<()> {
        let keys: &[&str] = match self {
            Msg::Announce { key, .. } | Msg::Publish { key, .. } | Msg::NoSpace { key, .. } | Msg::StreamBegin { key, .. } | Msg::Request { key, .. } => &[key],
            Msg::PlaceFor { receiver, key, .. } => &[receiver, key],
            _ => &[],
        };
        match keys.iter().find(|k| k.len() > MAX_KEY) {
            Some(k) => Err(Error::InvalidArgument(format!("key of {} bytes exceeds {MAX_KEY}: {}...", k.len(), truncate(k, 64)))),
            None => Ok(()),
        }
    }

    pub fn encode(&self) -> MsgBytes {
        let mut w = W::new();
        match self {
            Msg::Announce { key, step, need, returned } => {
                w.u8(T_ANNOUNCE); w.bytes(key.as_bytes()); w.u64(*step); w.u64(*need);
                w.u32(returned.len() as u32);
                for (s, g) in returned { w.u32(*s); w.u32(*g) }
            }
            Msg::Publish { key, edge_id, slots } => {
                w.u8(T_PUBLISH); w.bytes(key.as_bytes()); w.u32(*edge_id);
                w.u32(slots.len() as u32);
                for s in slots { w.u32(s.id); w.u32(s.gen); w.u64(s.offset); w.u64(s.capacity); w.u32(s.key) }
            }
            Msg::Credit { edge_id, slot, gen } => { w.u8(T_CREDIT); w.u32(*edge_id); w.u32(*slot); w.u32(*gen) }
            Msg::ReturnSlot { slot, gen } => { w.u8(T_RETURN); w.u32(*slot); w.u32(*gen) }
            Msg::NoSpace { key, need } => { w.u8(T_NOSPACE); w.bytes(key.as_bytes()); w.u64(*need) }
            Msg::Revoke { edge_id } => { w.u8(T_REVOKE); w.u32(*edge_id) }
            Msg::More { edge_id, need } => { w.u8(T_MORE); w.u32(*edge_id); w.u64(*need) }
            Msg::NoMore { edge_id } => { w.u8(T_NOMORE); w.u32(*edge_id) }
            Msg::Grow { edge_id, slot: s } => { w.u8(T_GROW); w.u32(*edge_id); w.u32(s.id); w.u32(s.gen); w.u64(s.offset); w.u64(s.capacity); w.u32(s.key) }
            Msg::PlaceFor { req, receiver, key, bytes } => { w.u8(T_PLACE_FOR); w.u64(*req); w.bytes(receiver.as_bytes()); w.bytes(key.as_bytes()); w.u64(*bytes) }
            Msg::PlaceDone { req, outcome, error } => { w.u8(T_PLACE_DONE); w.u64(*req); w.u32(*outcome); w.text(error) }
            Msg::Request { key, step } => { w.u8(T_REQUEST); w.bytes(key.as_bytes()); w.u64(*step) }
            Msg::Ready => w.u8(T_READY),
            Msg::Abort { step, code, reason } => { w.u8(T_ABORT); w.u64(*step); w.u32(*code); w.text(reason) }
            Msg::StreamBegin { stream, key, step, meta, total } => {
                w.u8(T_STREAM_BEGIN); w.u32(*stream); w.bytes(key.as_bytes()); w.u64(*step); w.meta(meta); w.u64(*total)
            }
            Msg::StreamReady { stream, outcome, error } => { w.u8(T_STREAM_READY); w.u32(*stream); w.u32(*outcome); w.text(error) }
            Msg::StreamData { stream, offset, bytes } => { w.u8(T_STREAM_DATA); w.u32(*stream); w.u64(*offset); w.bytes(bytes) }
            Msg::StreamAck { stream } => { w.u8(T_STREAM_ACK); w.u32(*stream) }
            Msg::StreamCancel { stream } => { w.u8(T_STREAM_CANCEL); w.u32(*stream) }
            Msg::Ping => w.u8(T_PING),
            Msg::Call { id, method, part, more, body } => { w.u8(T_CALL); w.u64(*id); w.u32(*method); w.u32(*part); w.u8(*more as u8); w.bytes(body) }
            Msg::Reply { id, code, part, more, body } => { w.u8(T_REPLY); w.u64(*id); w.u32(*code); w.u32(*part); w.u8(*more as u8); w.bytes(body) }
            Msg::CallCancel { id } => { w.u8(T_CALL_CANCEL); w.u64(*id) }
        }
        w.done()
    }

    pub fn decode(b: &[u8]) -> Result<Msg> {
        if b.len() > MAX_MSG_BYTES {
            return Err(Error::Protocol(format!("message of {} bytes exceeds {MAX_MSG_BYTES}", b.len())));
        }
        let mut r = R::new(b);
        let m = match r.u8()? {
            T_ANNOUNCE => {
                let key = r.string()?; let step = r.u64()?; let need = r.u64()?;
                let n = r.count(8)?;
                let mut returned = Vec::with_capacity(n);
                for _ in 0..n { returned.push((r.u32()?, r.u32()?)) }
                Msg::Announce { key, step, need, returned }
            }
            T_PUBLISH => {
                let key = r.string()?; let edge_id = r.u32()?;
                let n = r.count(28)?;
                let mut slots = Vec::with_capacity(n);
                for _ in 0..n { slots.push(SlotDesc { id: r.u32()?, gen: r.u32()?, offset: r.u64()?, capacity: r.u64()?, key: r.u32()? }) }
                Msg::Publish { key, edge_id, slots }
            }
            T_CREDIT => Msg::Credit { edge_id: r.u32()?, slot: r.u32()?, gen: r.u32()? },
            T_RETURN => Msg::ReturnSlot { slot: r.u32()?, gen: r.u32()? },
            T_NOSPACE => Msg::NoSpace { key: r.string()?, need: r.u64()? },
            T_REVOKE => Msg::Revoke { edge_id: r.u32()? },
            T_MORE => Msg::More { edge_id: r.u32()?, need: r.u64()? },
            T_NOMORE => Msg::NoMore { edge_id: r.u32()? },
            T_GROW => Msg::Grow { edge_id: r.u32()?, slot: SlotDesc { id: r.u32()?, gen: r.u32()?, offset: r.u64()?, capacity: r.u64()?, key: r.u32()? } },
            T_PLACE_FOR => Msg::PlaceFor { req: r.u64()?, receiver: r.string()?, key: r.string()?, bytes: r.u64()? },
            T_PLACE_DONE => Msg::PlaceDone { req: r.u64()?, outcome: r.u32()?, error: String::from_utf8_lossy(r.bytes(MAX_KEY)?).into_owned() },
            T_REQUEST => Msg::Request { key: r.string()?, step: r.u64()? },
            T_READY => Msg::Ready,
            T_ABORT => Msg::Abort { step: r.u64()?, code: r.u32()?, reason: String::from_utf8_lossy(r.bytes(MAX_KEY)?).into_owned() },
            T_STREAM_BEGIN => {
                let stream = r.u32()?; let key = r.string()?; let step = r.u64()?; let meta = r.meta()?;
                Msg::StreamBegin { stream, key, step, meta, total: r.u64()? }
            }
            T_STREAM_READY => Msg::StreamReady { stream: r.u32()?, outcome: r.u32()?, error: String::from_utf8_lossy(r.bytes(MAX_KEY)?).into_owned() },
            T_STREAM_DATA => Msg::StreamData { stream: r.u32()?, offset: r.u64()?, bytes: r.bytes(MAX_MSG_BYTES)?.to_vec() },
            T_STREAM_ACK => Msg::StreamAck { stream: r.u32()? },
            T_STREAM_CANCEL => Msg::StreamCancel { stream: r.u32()? },
            T_PING => Msg::Ping,
            T_CALL => Msg::Call { id: r.u64()?, method: r.u32()?, part: r.u32()?, more: r.flag()?, body: r.bytes(CALL_PART_BYTES)?.to_vec() },
            T_REPLY => Msg::Reply { id: r.u64()?, code: r.u32()?, part: r.u32()?, more: r.flag()?, body: r.bytes(CALL_PART_BYTES)?.to_vec() },
            T_CALL_CANCEL => Msg::CallCancel { id: r.u64()? },
            t => return Err(Error::Protocol(format!("unknown message type {t}"))),
        };
        r.end()?;
        Ok(m)
    }
}
