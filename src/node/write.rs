//! A tensor write in flight, as the fabric sees it ([`WriteOp`]): the
//! encoded slot header, the payload, and what to do when the write
//! completes. Boxes are recycled (see `completion`), so a steady stream of
//! writes allocates nothing.

use std::sync::Weak;

use super::Inner;
use crate::completion::Recycler;
use crate::constants::HEADER_BYTES;
use crate::error::Result;
use crate::fabric::{ConnId, Segs, WriteOp};
use crate::rendezvous::{Action, Payload, SendDone};

/// What the completion of a write leads to.
pub(super) enum Then {
    /// A tensor's write: complete the send, then free the link's budget.
    Send(SendDone),
    /// A chunk of stream `stream`.
    Chunk(u32),
    /// Nothing (the box is waiting in the recycler).
    Nothing,
}

pub(super) struct TensorWrite {
    header: [u8; HEADER_BYTES],
    payload: Option<Box<dyn Payload>>,
    then: Then,
    node: Weak<Inner>,
    link: ConnId,
}

static WRITES: Recycler<TensorWrite> = Recycler::new(crate::completion::KEPT);

impl TensorWrite {
    pub(super) fn new(header: [u8; HEADER_BYTES], payload: Box<dyn Payload>, then: Then, node: Weak<Inner>, link: ConnId) -> Box<TensorWrite> {
        WRITES.boxed(TensorWrite { header, payload: Some(payload), then, node, link })
    }
}

impl WriteOp for TensorWrite {
    fn segments(&self) -> Segs<'_> {
        let mut s = Segs::new();
        s.push(&self.header[..]);
        if let Some(p) = &self.payload {
            s.push(p.bytes());
        }
        s
    }

    fn complete(mut self: Box<Self>, r: Result<()>) {
        // Our reference to the tensor goes here, on whichever thread the
        // write completed (a verbs progress thread included): dropping a
        // reference runs no application code.
        if let Some(p) = self.payload.take() {
            p.release();
        }
        let then = std::mem::replace(&mut self.then, Then::Nothing);
        let node = std::mem::take(&mut self.node);
        let link = self.link;
        WRITES.recycle(self);
        match then {
            Then::Send(done) => {
                let n = node.upgrade();
                match &n {
                    // A verbs write completes on the backend's progress
                    // thread: TensorFlow's callback goes to rdev-callbacks.
                    Some(n) if crate::fabric::on_event_thread() => n.handoff.run(Action::SendDone { done, result: r }),
                    _ => {
                        let t = crate::trace::start();
                        done.complete(r);
                        crate::trace::end("send_done", t, 0, 0, None);
                    }
                }
                if let Some(n) = n {
                    let acts = n.locked(|rdv| rdv.write_done(link));
                    n.exec(acts);
                }
            }
            Then::Chunk(stream) => {
                if let Some(n) = node.upgrade() {
                    let acts = n.locked(|rdv| rdv.chunk_written(link, stream, r));
                    n.exec(acts);
                }
            }
            Then::Nothing => {}
        }
    }
}
