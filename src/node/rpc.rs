//! Calls over the transport's own message channel: the per-step worker RPCs
//! of TensorFlow's distributed runtime (RunGraph, CleanupGraph), carried
//! between two tasks that already have a link instead of over gRPC. The
//! library moves opaque bodies (the shim's serialized protos) and keeps
//! the call semantics; the shim decides what to call and serves calls.
//!
//! Shape:
//! - A call is `Msg::Call` parts (bodies larger than one message are cut
//!   in parts of `CALL_PART_BYTES`) on any live link with the peer, either
//!   direction; the answer is `Msg::Reply` parts on the same link with a
//!   code: 0 and the response, or TensorFlow's error code and message.
//! - The caller's `done` runs exactly once, on `rdev-callbacks` (never an
//!   event thread): with the reply; with UNAVAILABLE when the link is lost
//!   before it; with DEADLINE_EXCEEDED at its deadline (checked every
//!   `KEEPALIVE_INTERVAL_MS` by `rdev-keepalive`, so within that of it);
//!   with CANCELLED when the caller cancels. Those last two also tell the
//!   callee (`Msg::CallCancel`), as gRPC's cancellation does.
//! - The callee's server (`Server::call`) runs on `rdev-callbacks` too and
//!   answers later, from any thread, with [`Inner::rpc_reply`]; a call whose
//!   link is lost, or that its caller cancelled, is cancelled there
//!   (`Server::cancel`) and its reply, if any, goes nowhere.
//! - Inline, one thread wake-up fewer at each end: a method the server
//!   declared fit (`rpc_serve_inline`: its `call` returns within
//!   microseconds and never waits) is handed to it on the event thread
//!   that read the call's last part; a caller that declared its `done` fit
//!   (`rpc_call(.., inline: true, ..)`) gets a successful reply of at most
//!   `INLINE_REPLY_MAX` bytes on the event thread that read it. Failures,
//!   cancellations, deadlines and larger replies still run on
//!   `rdev-callbacks`.
//! - A call that cannot start over the transport (no live link with the
//!   peer, or its first part could not be sent) is refused at once
//!   (`Err`), so the caller can make it over gRPC: nothing of it reached
//!   the peer's server (a server only sees whole calls).
//!
//! Hostile peers: parts are checked (ids, link, sizes); a body larger than
//! `MAX_CALL_BYTES`, more than `MAX_SERVED` calls in flight from one
//! link, a reply to a call never made on that link: the link fails.
//!
//! Locks: `out` and `served` are leaves, never held while sending or
//! calling back.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use super::Inner;
use crate::error::{Error, Result};
use crate::fabric::ConnId;
use crate::rendezvous::wire::CALL_PART_BYTES;
use crate::rendezvous::{Action, Msg};
use crate::stats::Stats;

/// Largest call or reply body accepted (a RunGraph response may carry
/// fetched tensors).
pub const MAX_CALL_BYTES: usize = 1 << 30;
/// Most calls one link may have being served at once.
pub const MAX_SERVED: usize = 4096;
/// Largest reply handed to an inline caller on the event thread (a larger
/// one, e.g. a RunGraph response carrying fetched tensors, is parsed on
/// `rdev-callbacks`, not on the thread that reads the link).
pub const INLINE_REPLY_MAX: usize = 64 << 10;
/// Method ids a server may declare inline (`rpc_serve_inline`): below this.
pub const INLINE_METHODS: u32 = 64;

/// TensorFlow's status codes the transport produces itself.
pub const CODE_CANCELLED: u32 = 1;
pub const CODE_DEADLINE_EXCEEDED: u32 = 4;
pub const CODE_UNIMPLEMENTED: u32 = 12;
pub const CODE_UNAVAILABLE: u32 = 14;

/// A call's outcome: `code` 0 and the response, or an error code and its
/// message (UTF-8).
pub type CallDone = Box<dyn FnOnce(u32, Vec<u8>) + Send>;

/// Serves calls from peers (the shim's worker).
pub trait Server: Send + Sync {
    /// Call `handle` of `method` with `body` arrived (on `rdev-callbacks`):
    /// answer exactly once with `rpc_reply(handle, ...)`, from any thread.
    fn call(&self, handle: u64, method: u32, body: Vec<u8>);
    /// Call `handle` was cancelled (its caller gave up, or its link was
    /// lost): stop it if it still runs; its reply goes nowhere.
    fn cancel(&self, handle: u64);
}

struct Outgoing {
    link: ConnId,
    done: CallDone,
    /// A successful reply may complete on the event thread.
    inline: bool,
    deadline: Option<Instant>,
    /// Reply parts so far.
    reply: Vec<u8>,
}

struct Incoming {
    link: ConnId,
    id: u64,
    method: u32,
    body: Vec<u8>,
    /// Whole and handed to the server.
    started: bool,
}

#[derive(Default)]
struct Served {
    /// By the handle given to the server.
    calls: HashMap<u64, Incoming>,
    /// (link, caller's id) → handle.
    by_key: HashMap<(ConnId, u64), u64>,
}

#[derive(Default)]
pub(super) struct Rpc {
    next: std::sync::atomic::AtomicU64,
    out: Mutex<HashMap<u64, Outgoing>>,
    served: Mutex<Served>,
    server: RwLock<Option<Arc<dyn Server>>>,
    /// Bit m: calls of method m are served on the event thread.
    inline_methods: std::sync::atomic::AtomicU64,
}

impl Inner {
    /// Run `f` on `rdev-callbacks` (never an event thread).
    fn later(&self, f: impl FnOnce() + Send + 'static) {
        let done: crate::rendezvous::SendDone = Box::new(move |_: Result<()>| f());
        self.handoff.run(Action::SendDone { done, result: Ok(()) });
    }

    /// A live link with `peer`, either direction.
    fn link_with(&self, peer: &str) -> Option<ConnId> {
        let links = self.locked(|r| r.links_of(peer));
        let live = self.links.lock();
        links.into_iter().find(|l| live.contains_key(l))
    }

    /// Call `method` on `peer` with `body`; `done` runs exactly once (see
    /// the module docs; `inline`: a successful small reply may run it on
    /// the event thread). `Err`: the call could not start over the
    /// transport (`done` dropped uncalled; make it another way).
    pub(super) fn rpc_call(&self, peer: &str, method: u32, body: &[u8], timeout: Option<Duration>, inline: bool, done: CallDone) -> Result<u64> {
        let Some(link) = self.link_with(peer) else {
            return Err(Error::NotViable(format!("no connection with {peer} yet")));
        };
        if body.len() > MAX_CALL_BYTES {
            return Err(Error::NotViable(format!("a call body of {} bytes exceeds {MAX_CALL_BYTES}", body.len())));
        }
        let id = self.rpc.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let deadline = timeout.map(|t| Instant::now() + t);
        self.rpc.out.lock().insert(id, Outgoing { link, done, inline, deadline, reply: Vec::new() });
        let mut parts = body.chunks(CALL_PART_BYTES).peekable();
        let mut first = true;
        loop {
            let part = parts.next().unwrap_or(&[]);
            let more = parts.peek().is_some();
            if let Err(e) = self.send_msg(link, &Msg::Call { id, method, more, body: part.to_vec() }) {
                let o = self.rpc.out.lock().remove(&id);
                let why = Error::PeerLost(format!("{}: call to {peer} on connection {link} not sent: {}", self.task, e.message()));
                self.fail_link(link, why.clone());
                if first {
                    // Nothing reached the peer's server: the caller may go
                    // another way (its `done` is dropped uncalled).
                    drop(o);
                    return Err(why);
                }
                if let Some(o) = o {
                    self.later(move || (o.done)(CODE_UNAVAILABLE, why.message().as_bytes().to_vec()));
                }
                return Ok(id);
            }
            first = false;
            if !more {
                break;
            }
        }
        Stats::add(&Stats::global().c.worker_rpcs_over_transport, 1);
        Ok(id)
    }

    /// The caller gives up call `id`: its `done` runs with CANCELLED (if it
    /// has not run), and the callee is told.
    pub(super) fn rpc_cancel(&self, id: u64) {
        let Some(o) = self.rpc.out.lock().remove(&id) else { return };
        let _ = self.send_msg(o.link, &Msg::CallCancel { id });
        self.later(move || (o.done)(CODE_CANCELLED, b"Cancelled".to_vec()));
    }

    /// Answer served call `handle` (from `Server::call`).
    pub(super) fn rpc_reply(&self, handle: u64, code: u32, body: &[u8]) {
        let call = {
            let mut s = self.rpc.served.lock();
            let c = s.calls.remove(&handle);
            if let Some(c) = &c {
                s.by_key.remove(&(c.link, c.id));
            }
            c
        };
        let Some(c) = call else { return }; // cancelled or its link lost
        let t = crate::trace::start();
        let mut parts = body.chunks(CALL_PART_BYTES).peekable();
        loop {
            let part = parts.next().unwrap_or(&[]);
            let more = parts.peek().is_some();
            if let Err(e) = self.send_msg(c.link, &Msg::Reply { id: c.id, code, more, body: part.to_vec() }) {
                self.fail_link(c.link, Error::PeerLost(format!("{}: reply on connection {} not sent: {}", self.task, c.link, e.message())));
                return;
            }
            if !more {
                crate::trace::end("reply", t, 0, body.len() as u64, None);
                return;
            }
        }
    }

    pub(super) fn rpc_serve(&self, server: Option<Arc<dyn Server>>) {
        *self.rpc.server.write() = server;
    }

    /// Serve calls of `method` on the event thread that read them (the
    /// server promises its `call` for it returns within microseconds and
    /// never waits).
    pub(super) fn rpc_serve_inline(&self, method: u32) -> Result<()> {
        if method >= INLINE_METHODS {
            return Err(Error::InvalidArgument(format!("method {method}: only methods below {INLINE_METHODS} can be served inline")));
        }
        self.rpc.inline_methods.fetch_or(1 << method, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn served_inline(&self, method: u32) -> bool {
        method < INLINE_METHODS && self.rpc.inline_methods.load(std::sync::atomic::Ordering::Relaxed) & (1 << method) != 0
    }

    /// A `Call`, `Reply` or `CallCancel` arrived on `link` (an event
    /// thread): `Err` fails the link.
    pub(super) fn on_call_msg(&self, link: ConnId, msg: &[u8]) -> Result<()> {
        let t = crate::trace::start();
        match Msg::decode(msg)? {
            Msg::Call { id, method, more, body } => {
                let r = self.call_part(link, id, method, more, body);
                crate::trace::end("call in", t, 0, msg.len() as u64, None);
                r
            }
            Msg::Reply { id, code, more, body } => {
                let r = self.reply_part(link, id, code, more, body);
                crate::trace::end("reply in", t, 0, msg.len() as u64, None);
                r
            }
            Msg::CallCancel { id } => {
                let handle = self.rpc.served.lock().by_key.get(&(link, id)).copied();
                if let Some(h) = handle {
                    self.cancel_served(h);
                }
                Ok(())
            }
            m => Err(Error::Internal(format!("{} is not a call's message", m.name()))),
        }
    }

    fn call_part(&self, link: ConnId, id: u64, method: u32, more: bool, body: Vec<u8>) -> Result<()> {
        let whole = {
            let mut s = self.rpc.served.lock();
            let handle = match s.by_key.get(&(link, id)) {
                Some(h) => *h,
                None => {
                    if s.calls.values().filter(|c| c.link == link).count() >= MAX_SERVED {
                        return Err(Error::Protocol(format!("more than {MAX_SERVED} calls in flight from one connection")));
                    }
                    let h = self.rpc.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                    s.by_key.insert((link, id), h);
                    s.calls.insert(h, Incoming { link, id, method, body: Vec::new(), started: false });
                    h
                }
            };
            let c = s.calls.get_mut(&handle).ok_or_else(|| Error::Internal("served call vanished".into()))?;
            if c.started || c.method != method {
                return Err(Error::Protocol(format!("call {id}: a part after its last, or of another method")));
            }
            if c.body.len() + body.len() > MAX_CALL_BYTES || c.body.try_reserve(body.len()).is_err() {
                return Err(Error::Protocol(format!("call {id}: body larger than {MAX_CALL_BYTES} bytes")));
            }
            c.body.extend_from_slice(&body);
            if more {
                None
            } else {
                c.started = true;
                Some((handle, std::mem::take(&mut c.body)))
            }
        };
        let Some((handle, body)) = whole else { return Ok(()) };
        let server = self.rpc.server.read().clone();
        match server {
            Some(srv) => {
                let serve = move || {
                    let (t, n) = (crate::trace::start(), body.len() as u64);
                    srv.call(handle, method, body);
                    crate::trace::end("serve", t, 0, n, None);
                };
                if self.served_inline(method) {
                    serve();
                } else {
                    self.later(serve);
                }
            }
            None => self.rpc_reply(handle, CODE_UNIMPLEMENTED, b"this task serves no calls over the transport"),
        }
        Ok(())
    }

    fn reply_part(&self, link: ConnId, id: u64, code: u32, more: bool, body: Vec<u8>) -> Result<()> {
        let mut out = self.rpc.out.lock();
        let Some(o) = out.get_mut(&id) else {
            // Cancelled or timed out meanwhile (its reply may still come).
            return if id <= self.rpc.next.load(std::sync::atomic::Ordering::Relaxed) { Ok(()) } else { Err(Error::Protocol(format!("reply to call {id}, never made"))) };
        };
        if o.link != link {
            return Err(Error::Protocol(format!("reply to call {id} on another connection")));
        }
        if o.reply.len() + body.len() > MAX_CALL_BYTES || o.reply.try_reserve(body.len()).is_err() {
            return Err(Error::Protocol(format!("reply to call {id} larger than {MAX_CALL_BYTES} bytes")));
        }
        o.reply.extend_from_slice(&body);
        if more {
            return Ok(());
        }
        let o = out.remove(&id).expect("found above");
        drop(out);
        let inline = o.inline && code == 0 && o.reply.len() <= INLINE_REPLY_MAX;
        let done = move || {
            let (t, n) = (crate::trace::start(), o.reply.len() as u64);
            (o.done)(code, o.reply);
            crate::trace::end("call done", t, 0, n, None);
        };
        if inline {
            done();
        } else {
            self.later(done);
        }
        Ok(())
    }

    fn cancel_served(&self, handle: u64) {
        let c = {
            let mut s = self.rpc.served.lock();
            let c = s.calls.remove(&handle);
            if let Some(c) = &c {
                s.by_key.remove(&(c.link, c.id));
            }
            c
        };
        let Some(c) = c else { return };
        if c.started {
            if let Some(srv) = self.rpc.server.read().clone() {
                self.later(move || srv.cancel(handle));
            }
        }
    }

    /// `link` is gone: its calls fail (UNAVAILABLE), the calls it brought
    /// are cancelled.
    pub(super) fn rpc_link_lost(&self, link: ConnId, why: &Error) {
        let failed: Vec<Outgoing> = {
            let mut out = self.rpc.out.lock();
            let ids: Vec<u64> = out.iter().filter(|(_, o)| o.link == link).map(|(id, _)| *id).collect();
            ids.into_iter().filter_map(|id| out.remove(&id)).collect()
        };
        for o in failed {
            let msg = why.message().as_bytes().to_vec();
            self.later(move || (o.done)(CODE_UNAVAILABLE, msg));
        }
        let handles: Vec<u64> = self.rpc.served.lock().calls.iter().filter(|(_, c)| c.link == link).map(|(h, _)| *h).collect();
        for h in handles {
            self.cancel_served(h);
        }
    }

    /// Calls past their deadline fail (DEADLINE_EXCEEDED); the callee is
    /// told (`rdev-keepalive`, every `KEEPALIVE_INTERVAL_MS`).
    pub(super) fn rpc_expire(&self, now: Instant) {
        let late: Vec<(u64, Outgoing)> = {
            let mut out = self.rpc.out.lock();
            let ids: Vec<u64> = out.iter().filter(|(_, o)| o.deadline.is_some_and(|d| d <= now)).map(|(id, _)| *id).collect();
            ids.into_iter().filter_map(|id| out.remove(&id).map(|o| (id, o))).collect()
        };
        for (id, o) in late {
            let _ = self.send_msg(o.link, &Msg::CallCancel { id });
            self.later(move || (o.done)(CODE_DEADLINE_EXCEEDED, b"Deadline Exceeded".to_vec()));
        }
    }

    /// The node goes: every call still waiting fails.
    pub(super) fn rpc_fail_all(&self) {
        let all: Vec<Outgoing> = self.rpc.out.lock().drain().map(|(_, o)| o).collect();
        for o in all {
            self.later(move || (o.done)(CODE_UNAVAILABLE, b"transport shut down".to_vec()));
        }
    }
}
