//! Admission of incoming connections: a bound on the ones still in the
//! handshake, and a deadline for their hello.
//!
//! A CONNECT_REQUEST costs a queue pair and a registered slab, made on
//! `rdev-verbs-setup`, before the sender says who it is. So at most
//! `VerbsOptions::max_handshakes` incoming connections are brought up and
//! not yet accepted at once; further requests wait here, holding only
//! their rdma_cm id (no QP, no memory), oldest first, and are refused
//! once `MAX_WAITING` wait already. Every incoming connection must be
//! accepted (its hello checked by the node) within
//! `VerbsOptions::hello_timeout` of its request, waiting included, or it
//! is closed: a peer that connects and says nothing holds nothing for
//! long.
//!
//! All of this runs on the progress thread (`admit` from the CM event,
//! `tend` from the loop), except `done`, which any thread may call; the
//! one lock here is a leaf.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{events, kill, ListenerShared, Request, Shared};
use crate::error::Error;
use crate::fabric::verbs::cm::CmId;
use crate::fabric::verbs::conn::Phase;
use crate::fabric::ConnId;

/// Connect requests that may wait for room before more are refused.
pub(crate) const MAX_WAITING: usize = 1024;

/// How often the progress loop looks for expired handshakes.
pub(super) const TEND_EVERY: Duration = Duration::from_millis(100);

/// A connect request not yet brought up.
pub(super) struct Waiting {
    pub id: ConnId,
    pub cm: CmId,
    pub listener: Arc<ListenerShared>,
    pub private: Vec<u8>,
    pub rr: (u8, u8),
    pub deadline: Instant,
}

#[derive(Default)]
pub(crate) struct Handshakes {
    /// Incoming connections brought up (QP, slab) and not yet accepted,
    /// with the deadline for their acceptance.
    live: HashMap<ConnId, Instant>,
    waiting: VecDeque<Waiting>,
}

impl Handshakes {
    /// (brought up and not accepted, waiting for room)
    pub(crate) fn counts(&self) -> (usize, usize) {
        (self.live.len(), self.waiting.len())
    }
}

/// A new connect request: bring it up now if there is room, else let it
/// wait, else refuse it.
pub(super) fn admit(sh: &Arc<Shared>, w: Waiting) {
    let mut hs = sh.handshakes.lock();
    if hs.live.len() < sh.opts.max_handshakes.max(1) && hs.waiting.is_empty() {
        hs.live.insert(w.id, w.deadline);
        drop(hs);
        events::bring_up(sh, w);
    } else if hs.waiting.len() < MAX_WAITING {
        log::debug!("verbs: connection {} at {} waits: {} handshakes in progress", w.id, w.listener.addr, hs.live.len());
        hs.waiting.push_back(w);
    } else {
        drop(hs);
        refuse(&w, &busy(sh));
    }
}

fn busy(sh: &Shared) -> Error {
    Error::Timeout(format!(
        "the receiver has {} connections in the handshake and {MAX_WAITING} more waiting: try again later",
        sh.opts.max_handshakes
    ))
}

fn refuse(w: &Waiting, why: &Error) {
    log::warn!("verbs: refusing a connection at {}: {why}", w.listener.addr);
    events::reject(w.cm.raw, why);
}

/// The incoming connection `id` was accepted or is gone: it no longer
/// counts. Safe from any thread; the progress thread then admits the
/// next waiting request.
pub(super) fn done(sh: &Shared, id: ConnId) {
    let freed = sh.handshakes.lock().live.remove(&id).is_some();
    if freed {
        sh.request(Request::Tend);
    }
}

/// On the progress thread: close connections past their hello deadline,
/// refuse requests that waited past it, and bring up waiting ones while
/// there is room.
pub(super) fn tend(sh: &Arc<Shared>) {
    let now = Instant::now();
    let (late, expired, start) = {
        let mut hs = sh.handshakes.lock();
        let late: Vec<ConnId> = hs.live.iter().filter(|(_, d)| **d <= now).map(|(id, _)| *id).collect();
        for id in &late {
            hs.live.remove(id);
        }
        let (expired, keep): (Vec<Waiting>, Vec<Waiting>) = std::mem::take(&mut hs.waiting).into_iter().partition(|w| w.deadline <= now);
        hs.waiting = keep.into();
        let mut start = Vec::new();
        while hs.live.len() < sh.opts.max_handshakes.max(1) {
            let Some(w) = hs.waiting.pop_front() else { break };
            hs.live.insert(w.id, w.deadline);
            start.push(w);
        }
        (late, expired, start)
    };
    let timeout = sh.opts.hello_timeout;
    for id in late {
        let c = sh.conns.lock().get(&id).cloned();
        let Some(c) = c else { continue };
        let why = Error::Timeout(format!("the sender was not accepted within {timeout:?} of connecting"));
        {
            // Under the connection's lock: the setup thread brings it up
            // (and accepts it) under the same lock.
            let inner = c.inner.lock();
            match inner.phase {
                // Accepted meanwhile (its `done` is on its way): it stays.
                Phase::Ready => continue,
                // Not answered yet (the setup thread is busy): say why, or
                // the sender would read a bare reject as "nobody listens"
                // and give up on the transport.
                Phase::Connecting => {
                    if let Some(cm) = inner.cm.as_ref() {
                        events::reject(cm.raw, &why);
                    }
                }
                _ => {}
            }
        }
        log::warn!("verbs: connection {id} sent no acceptable hello within {timeout:?}: closing it");
        kill(sh, &c, why);
    }
    for w in expired {
        refuse(&w, &busy(sh));
    }
    for w in start {
        events::bring_up(sh, w);
    }
}

/// A listener closed (`Some(token)`) or the runtime shuts down (`None`):
/// refuse the connect requests still waiting for room for it.
pub(super) fn drop_waiting(sh: &Shared, token: Option<u64>) {
    let gone: Vec<Waiting> = {
        let mut hs = sh.handshakes.lock();
        let (gone, keep): (Vec<Waiting>, Vec<Waiting>) =
            std::mem::take(&mut hs.waiting).into_iter().partition(|w| match token {
                Some(t) => w.listener.token == t,
                None => true,
            });
        hs.waiting = keep.into();
        gone
    };
    for w in gone {
        refuse(&w, &Error::PeerLost(crate::fabric::LISTENER_CLOSING.into()));
    }
}
