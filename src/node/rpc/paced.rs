//! Pacing (see rpc.rs): the rest of a large body, past its first
//! `DIRECT_PARTS` parts, goes out from the node's pacing thread
//! (`rdev-rpc-pace`, pace.rs), each part only while fewer than
//! `PACE_BACKLOG` messages wait on its link.

use std::time::Instant;

use super::{part_index, Rpc, Wire, CALL_PART_BYTES, CODE_RESOURCE_EXHAUSTED, PACE_BACKLOG, PACE_TIMEOUT};
use crate::error::Error;
use crate::fabric::ConnId;
use crate::rendezvous::Msg;

/// What a paced body is.
#[derive(Clone, Copy)]
pub(super) enum PacedKind {
    Call { id: u64, method: u32 },
    Reply { id: u64, code: u32 },
}

/// The rest of a body whose first `DIRECT_PARTS` parts went out from the
/// thread that made it: sent by the pacing thread.
pub(super) struct Paced {
    link: ConnId,
    kind: PacedKind,
    /// The body from part `first` on.
    rest: Vec<u8>,
    first: usize,
    /// The next part to send.
    next: usize,
    last_progress: Instant,
    /// The reply's trace span (replies only).
    trace: Option<i64>,
    len: usize,
}

/// What one round of pacing did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Pace {
    /// Nothing left to send.
    Idle,
    /// Some part went out: go again at once.
    Progress,
    /// Every link with a paced body is full: try again shortly.
    Stalled,
}

impl Rpc {
    /// Hand the rest of a body, from part `first` on, to the pacing thread.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn defer(&self, w: &dyn Wire, link: ConnId, kind: PacedKind, rest: &[u8], first: usize, trace: Option<i64>) {
        let mut owned = Vec::new();
        if owned.try_reserve_exact(rest.len()).is_err() {
            let why = format!("{}: no memory for the {} bytes left to send of a body", w.task(), rest.len());
            log::error!("{why}");
            match kind {
                // The callee drops what it holds of the call; the caller
                // gets the error.
                PacedKind::Call { id, .. } => {
                    let _ = w.send(link, &Msg::CallCancel { id });
                    if let Some(o) = self.out.lock().remove(&id) {
                        w.later(Box::new(move || (o.done)(CODE_RESOURCE_EXHAUSTED, why.into_bytes())));
                    }
                }
                // Half a reply cannot be taken back.
                PacedKind::Reply { .. } => w.fail_link(link, Error::ResourceExhausted(why)),
            }
            return;
        }
        owned.extend_from_slice(rest);
        let len = first * CALL_PART_BYTES + rest.len();
        self.paced.lock().push(Paced { link, kind, rest: owned, first, next: first, last_progress: Instant::now(), trace, len });
        w.start_pacing();
    }

    /// One round of the pacing thread: each paced body sends its next parts
    /// while its link's backlog is under `PACE_BACKLOG`.
    pub(crate) fn pace(&self, w: &dyn Wire) -> Pace {
        let mut work = std::mem::take(&mut *self.paced.lock());
        if work.is_empty() {
            return Pace::Idle;
        }
        let now = Instant::now();
        let mut progress = false;
        work.retain_mut(|p| {
            let (done, sent) = self.pace_one(w, p, now);
            progress |= sent;
            !done
        });
        let mut paced = self.paced.lock();
        // Bodies deferred meanwhile go after these (each body's parts stay
        // in order: one entry per body).
        work.append(&mut paced);
        *paced = work;
        if progress {
            Pace::Progress
        } else if paced.is_empty() {
            Pace::Idle
        } else {
            Pace::Stalled
        }
    }

    /// Send what fits of one paced body: (finished, sent anything).
    fn pace_one(&self, w: &dyn Wire, p: &mut Paced, now: Instant) -> (bool, bool) {
        let mut sent = false;
        loop {
            if let PacedKind::Call { id, .. } = p.kind {
                if !self.out.lock().contains_key(&id) {
                    // Taken meanwhile (cancelled, expired, its link lost):
                    // the callee drops what it holds of the call.
                    let _ = w.send(p.link, &Msg::CallCancel { id });
                    return (true, sent);
                }
            }
            if w.backlog(p.link) >= PACE_BACKLOG {
                break;
            }
            let off = (p.next - p.first) * CALL_PART_BYTES;
            let end = (off + CALL_PART_BYTES).min(p.rest.len());
            let more = end < p.rest.len();
            let Ok(part) = part_index(p.next) else {
                w.fail_link(p.link, Error::Internal(format!("{}: a body of more than 2^32 parts", w.task())));
                return (true, sent);
            };
            let body = p.rest[off..end].to_vec();
            let msg = match p.kind {
                PacedKind::Call { id, method } => Msg::Call { id, method, part, more, body },
                PacedKind::Reply { id, code } => Msg::Reply { id, code, part, more, body },
            };
            if let Err(e) = w.send(p.link, &msg) {
                // Failing the link fails its calls (this one included).
                w.fail_link(p.link, Error::PeerLost(format!("{}: part {part} of a body on connection {} not sent: {}", w.task(), p.link, e.message())));
                return (true, sent);
            }
            sent = true;
            p.next += 1;
            p.last_progress = now;
            if !more {
                match p.kind {
                    PacedKind::Call { id, .. } => {
                        if !self.out.lock().contains_key(&id) {
                            // See `send_parts`: a cancel may have overtaken
                            // the last part.
                            let _ = w.send(p.link, &Msg::CallCancel { id });
                        }
                    }
                    PacedKind::Reply { .. } => {
                        if let Some(t) = p.trace.take() {
                            crate::trace::end("reply", t, 0, p.len as u64, None);
                        }
                    }
                }
                return (true, sent);
            }
        }
        if !sent && now.duration_since(p.last_progress) > PACE_TIMEOUT {
            w.fail_link(p.link, Error::Timeout(format!("{}: connection {} took no part of a body for {:?}", w.task(), p.link, PACE_TIMEOUT)));
            return (true, false);
        }
        (false, sent)
    }

    /// No thread can send the paced bodies: fail their links (and with
    /// them their calls).
    pub(crate) fn fail_paced(&self, w: &dyn Wire) {
        let all = std::mem::take(&mut *self.paced.lock());
        for p in all {
            w.fail_link(p.link, Error::Internal(format!("{}: the rest of a large body cannot be sent (no pacing thread)", w.task())));
        }
    }
}
