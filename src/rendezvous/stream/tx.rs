//! A streamed tensor at its sender: its streams per link, the chunks they
//! write or send (round-robin over the link's stream slots), and the
//! tombstones of streams that failed while chunks still read their
//! payload (see the module docs of `stream`).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use super::{PayloadRange, SharedPayload, STREAM_KEY};
use crate::constants::{STREAM_MSG_BYTES, STREAM_MSG_WINDOW};
use crate::error::{Error, Result};
use crate::rendezvous::records::Pending;
use crate::rendezvous::wire::{ChunkAt, Msg, SlotHeader, TensorMeta, STREAM_MESSAGES, STREAM_REFUSED, STREAM_SLOTS};
use crate::rendezvous::{smallvec, Action, Actions, LinkId, Rendezvous, SendDone, Tally};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TxMode {
    /// `StreamBegin` sent, `StreamReady` not yet received.
    Waiting,
    Slots,
    Messages,
}

pub(in crate::rendezvous) struct TxStream {
    id: u32,
    key: String,
    pub(in crate::rendezvous) step: u64,
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
    pub(in crate::rendezvous) failed: Option<Error>,
    done: Option<SendDone>,
}

/// Streams that failed while actions still read their payload, by (link,
/// stream): kept, past their link's end, until the last one is back.
pub(in crate::rendezvous) type Ending = HashMap<(LinkId, u32), TxStream>;

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

    pub(in crate::rendezvous) fn describe(&self) -> String {
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
pub(in crate::rendezvous) fn bury(ending: &mut Ending) {
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
pub(in crate::rendezvous) struct TxStreams {
    /// Round-robin order: the first stream with work gets the next slot and
    /// goes to the back.
    list: VecDeque<TxStream>,
    next_id: u32,
}

impl TxStreams {
    pub(in crate::rendezvous) fn is_empty(&self) -> bool {
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
    pub(in crate::rendezvous) fn begin(&mut self, link: LinkId, key: &str, p: Pending, tally: &mut Tally) -> Actions {
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
    pub(in crate::rendezvous) fn fail(&mut self, link: LinkId, tell: bool, pred: impl Fn(&TxStream) -> bool, why: &Error, ending: &mut Ending) -> Actions {
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

    pub(in crate::rendezvous) fn describe(&self) -> String {
        self.list.iter().map(TxStream::describe).collect()
    }
}

impl Rendezvous {
    /// Every free stream slot gets the next chunk (round-robin over the
    /// link's streams); message-mode streams fill their window.
    pub(in crate::rendezvous) fn pump_streams(&mut self, link: LinkId) -> Actions {
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

    pub(in crate::rendezvous) fn tx_stream_ready(&mut self, link: LinkId, stream: u32, outcome: u32, error: String) -> Result<Actions> {
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

    pub(in crate::rendezvous) fn tx_stream_ack(&mut self, link: LinkId, stream: u32) -> Result<Actions> {
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
    pub(in crate::rendezvous) fn tx_stream_cancel(&mut self, link: LinkId, stream: u32) -> Actions {
        let Some(t) = self.tx.get_mut(&link) else { return Actions::new() };
        let peer = t.peer.clone();
        let Some(s) = t.streams.take(stream) else { return Actions::new() };
        let why = Error::Aborted(format!("{peer} discarded {} in step {} (its step ended)", s.key, s.step));
        s.settle(link, Err(why), &mut self.tx_ending).into_iter().collect()
    }
}
