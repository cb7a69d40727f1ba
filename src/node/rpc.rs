//! Calls over the transport's own message channel: the per-step worker RPCs
//! of TensorFlow's distributed runtime (RunGraph, CleanupGraph), carried
//! between two tasks that already have a link instead of over gRPC. The
//! library moves opaque bodies (the shim's serialized protos) and keeps
//! the call semantics; the shim decides what to call and serves calls.
//!
//! Shape:
//! - A call is `Msg::Call` parts (bodies larger than one message are cut
//!   in parts of `CALL_PART_BYTES`, each with its index) on a live link
//!   this node dialled at the peer's address in the cluster spec, never on
//!   a link the peer opened (a process that connects first could claim to
//!   be any task: it would receive the master's RunGraph). The answer is
//!   `Msg::Reply` parts on the same link with a code: 0 and the response,
//!   or TensorFlow's error code and message. A callee serves a call only
//!   when every part arrived in order from part 0: the tail of a call it
//!   dropped (cancelled) is dropped too, never served as a call of its own.
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
//! - Pacing: a body's first `DIRECT_PARTS` parts leave from the thread
//!   that makes the call or the reply; the rest from the node's pacing
//!   thread (pace.rs), each only while fewer than `PACE_BACKLOG` messages
//!   wait on the link, so one large body never fills a connection's queue
//!   (verbs fails sends past `MAX_QUEUED_WORK`) nor holds up the link's
//!   tensors behind all of it.
//! - A call that cannot start over the transport (no live link with the
//!   peer, or its first part could not be sent) is refused at once
//!   (`Err`), so the caller can make it over gRPC: nothing of it reached
//!   the peer's server (a server only sees whole calls).
//!
//! Hostile peers: parts are checked (ids, link, sizes); a body larger than
//! `MAX_CALL_BYTES`, more than `MAX_SERVED` calls in flight from one
//! link, a reply to a call never made on that link: the link fails.
//!
//! Ownership: whoever takes a call out of `out` runs its `done` (a reply,
//! a cancel, a deadline, the loss of its link, shutdown, or `call` itself
//! when its first part could not be sent, and only then returns `Err`).
//!
//! Locks: `out` and `served` are leaves, never held while sending or
//! calling back. Schedule tests (`--features shuttle`, sched_tests.rs) run
//! this code under explored interleavings of callers, link loss, deadlines
//! and cancels.

use super::Inner;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::fabric::ConnId;
use crate::rendezvous::wire::CALL_PART_BYTES;
use crate::rendezvous::Msg;
use crate::stats::Stats;
use crate::sync::{AtomicU64, Mutex, Ordering, RwLock};

/// Largest call or reply body (a RunGraph response may carry fetched
/// tensors): protobuf's own limit, so anything TF can serialize goes.
pub const MAX_CALL_BYTES: usize = i32::MAX as usize;
/// TensorFlow's RESOURCE_EXHAUSTED: a reply too large to carry.
pub const CODE_RESOURCE_EXHAUSTED: u32 = 8;
/// Most calls one link may have being served at once.
pub const MAX_SERVED: usize = 4096;
/// Most bytes of calls still arriving (parts received, not yet whole) that
/// one link, and the whole node, may hold: a peer cannot make us buffer
/// 4096 calls of `MAX_CALL_BYTES` each. Past either, the link that sent
/// the part fails.
pub const MAX_PARTIAL_BYTES_PER_LINK: usize = 2 * MAX_CALL_BYTES;
pub const MAX_PARTIAL_BYTES: usize = 4 * MAX_CALL_BYTES;
/// A call still arriving whose next part has not come for this long fails
/// its link (a caller sends its parts back to back; checked by
/// `rdev-keepalive` with the deadlines).
pub const PARTIAL_CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Largest reply handed to an inline caller on the event thread (a larger
/// one, e.g. a RunGraph response carrying fetched tensors, is parsed on
/// `rdev-callbacks`, not on the thread that reads the link).
pub const INLINE_REPLY_MAX: usize = 64 << 10;
/// Method ids a server may declare inline (`rpc_serve_inline`): below this.
pub const INLINE_METHODS: u32 = 64;
/// Parts of one body (a call's or a reply's) sent on the thread that makes
/// the call or the reply; the rest go from the node's pacing thread
/// (`rdev-rpc-pace`), as the link's backlog allows.
pub const DIRECT_PARTS: usize = 64;
/// The pacing thread sends a body's next part only while fewer than this
/// many messages wait on its link for the peer: a 1.5 GiB reply never takes
/// every entry of a connection's queue (verbs caps it at
/// `MAX_QUEUED_WORK`, past which sends fail), and tensors and other calls
/// on the link wait behind at most this many parts.
pub const PACE_BACKLOG: usize = 256;
/// A paced body whose link took none of its parts for this long fails the
/// link (its peer stopped consuming).
pub const PACE_TIMEOUT: Duration = PARTIAL_CALL_TIMEOUT;

/// TensorFlow's status codes the transport produces itself.
pub const CODE_CANCELLED: u32 = 1;
pub const CODE_UNKNOWN: u32 = 2;
pub const CODE_INTERNAL: u32 = 13;
/// The largest status code TensorFlow knows (UNAUTHENTICATED).
pub const CODE_MAX: u32 = 16;
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

/// What the channel needs of the node around it: links to send on, a way
/// to fail one, and a thread for callbacks. The node implements it over
/// its fabrics (mod.rs); the schedule tests over threads and queues.
pub(crate) trait Wire: Send + Sync {
    /// This task's name (for messages).
    fn task(&self) -> &str;
    /// A live link to `peer` that calls may go over: one this node dialled
    /// at the peer's address in the cluster spec, never a link a peer
    /// opened to us (it could claim any task's name).
    fn call_link(&self, peer: &str) -> Option<ConnId>;
    /// Send one message on `link` (never waits for the peer).
    fn send(&self, link: ConnId, msg: &Msg) -> Result<()>;
    /// Close `link`, failing what depends on it (calls included: it calls
    /// back `Rpc::link_lost`).
    fn fail_link(&self, link: ConnId, why: Error);
    /// Run `f` later on a thread of the node's (`rdev-callbacks`), never on
    /// the calling thread.
    fn later(&self, f: Box<dyn FnOnce() + Send>);
    /// Messages queued on `link` that wait for the peer (0 where the
    /// backend does not count them).
    fn backlog(&self, link: ConnId) -> usize;
    /// Make sure the node's pacing thread runs `Rpc::pace` until it has no
    /// paced body left.
    fn start_pacing(&self);
}

/// What a paced body is.
#[derive(Clone, Copy)]
enum PacedKind {
    Call { id: u64, method: u32 },
    Reply { id: u64, code: u32 },
}

/// The rest of a body whose first `DIRECT_PARTS` parts went out from the
/// thread that made it: sent by the pacing thread.
struct Paced {
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

struct Outgoing {
    link: ConnId,
    done: CallDone,
    /// A successful reply may complete on the event thread.
    inline: bool,
    deadline: Option<Instant>,
    /// Reply parts so far, and how many.
    reply: Vec<u8>,
    reply_parts: u32,
}

struct Incoming {
    link: ConnId,
    id: u64,
    method: u32,
    body: Vec<u8>,
    /// Parts so far (the index the next part must carry), and when the
    /// last came.
    parts: u32,
    last_part: Instant,
    /// Whole and handed to the server.
    started: bool,
}

struct Served {
    /// By the handle given to the server.
    calls: HashMap<u64, Incoming>,
    /// (link, caller's id) → handle.
    by_key: HashMap<(ConnId, u64), u64>,
    /// Per link: calls in `calls`, and the highest call id begun on it (a
    /// later part of a call at or below it that is not in `by_key` belongs
    /// to a call that was cancelled: dropped; above it: never begun).
    links: HashMap<ConnId, LinkCalls>,
    /// Bytes of calls still arriving, node-wide, and the caps on them
    /// (per link, node-wide).
    partial: usize,
    caps: (usize, usize),
}

impl Default for Served {
    fn default() -> Served {
        Served {
            calls: HashMap::new(),
            by_key: HashMap::new(),
            links: HashMap::new(),
            partial: 0,
            caps: (MAX_PARTIAL_BYTES_PER_LINK, MAX_PARTIAL_BYTES),
        }
    }
}

#[derive(Default, Clone, Copy)]
struct LinkCalls {
    open: usize,
    highest: u64,
    /// Bytes of this link's calls still arriving.
    partial: usize,
}

/// A whole call to hand to the server.
struct Whole {
    handle: u64,
    method: u32,
    body: Vec<u8>,
}

/// The call channel's state (one per node). Every method takes the node
/// around it as a `Wire`.
#[derive(Default)]
pub(crate) struct Rpc {
    next: AtomicU64,
    out: Mutex<HashMap<u64, Outgoing>>,
    served: Mutex<Served>,
    server: RwLock<Option<Arc<dyn Server>>>,
    /// Bit m: calls of method m are served on the event thread.
    inline_methods: AtomicU64,
    /// Bodies whose remaining parts the pacing thread sends.
    paced: Mutex<Vec<Paced>>,
}

fn part_index(i: usize) -> Result<u32> {
    u32::try_from(i).map_err(|_| Error::InvalidArgument("a call body of more than 2^32 parts".into()))
}

impl Rpc {
    fn new_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Call `method` on `peer` with `body`; `done` runs exactly once (see
    /// the module docs; `inline`: a successful small reply may run it on
    /// the event thread). `Err`: the call could not start over the
    /// transport (`done` dropped uncalled; make it another way). `Ok`:
    /// `done` runs, even when the link is lost while the parts go out.
    ///
    /// Whoever removes the call from `out` owns its `done`: this function
    /// (its first part not sent), a reply, `cancel`, `expire`, `link_lost`
    /// or `fail_all`. Only when this function removed it before any part
    /// left may it return `Err`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn call(&self, w: &dyn Wire, peer: &str, method: u32, body: &[u8], timeout: Option<Duration>, inline: bool, done: CallDone) -> Result<u64> {
        let Some(link) = w.call_link(peer) else {
            return Err(Error::NotViable(format!("no connection with {peer} yet")));
        };
        if body.len() > MAX_CALL_BYTES {
            return Err(Error::NotViable(format!("a call body of {} bytes exceeds {MAX_CALL_BYTES}", body.len())));
        }
        part_index(body.len() / CALL_PART_BYTES.max(1))?;
        let id = self.new_id();
        let deadline = timeout.map(|t| Instant::now() + t);
        self.out.lock().insert(id, Outgoing { link, done, inline, deadline, reply: Vec::new(), reply_parts: 0 });
        // From here `done` is registered: a panic must not unwind past this
        // function with it there (the caller would take the error as "not
        // started", free what `done` uses and go another way).
        let sent = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.send_parts(w, peer, link, id, method, body)));
        sent.unwrap_or_else(|_| {
            let why = format!("{}: a call to {peer} failed as it started (a panic in the transport; see the log)", w.task());
            log::error!("{why}");
            if let Some(o) = self.out.lock().remove(&id) {
                w.later(Box::new(move || (o.done)(CODE_INTERNAL, why.into_bytes())));
            }
            // Parts may have gone out: the callee drops what it holds of
            // the call rather than wait for the rest (best effort).
            let _ = crate::error::catch_panic("cancelling a call that failed as it started", || w.send(link, &Msg::CallCancel { id }));
            Ok(id)
        })
    }

    /// `call`'s parts, once registered as `id` (see `call`).
    fn send_parts(&self, w: &dyn Wire, peer: &str, link: ConnId, id: u64, method: u32, body: &[u8]) -> Result<u64> {
        let mut parts = body.chunks(CALL_PART_BYTES).peekable();
        let mut index = 0usize;
        loop {
            let part = parts.next().unwrap_or(&[]);
            let more = parts.peek().is_some();
            if index > 0 && !self.out.lock().contains_key(&id) {
                // Taken meanwhile (cancelled, expired, its link lost): its
                // taker runs `done` and told the callee, but that cancel
                // may have overtaken the parts sent so far; this one
                // follows them, so the callee drops what it holds of the call.
                let _ = w.send(link, &Msg::CallCancel { id });
                return Ok(id);
            }
            if more && index == DIRECT_PARTS {
                // The rest goes from the pacing thread, as the link's
                // backlog allows (the caller's thread never waits on it).
                let offset = index * CALL_PART_BYTES;
                self.defer(w, link, PacedKind::Call { id, method }, &body[offset..], index, None);
                break;
            }
            // Fits: checked before the call was registered.
            let msg = Msg::Call { id, method, part: index as u32, more, body: part.to_vec() };
            if let Err(e) = w.send(link, &msg) {
                let mine = self.out.lock().remove(&id);
                let why = Error::PeerLost(format!("{}: call to {peer} on connection {link} not sent: {}", w.task(), e.message()));
                // Whatever failing the link does (it runs other code), the
                // call taken out just above is answered below.
                let _ = crate::error::catch_panic("failing a link whose call could not be sent", || w.fail_link(link, why.clone()));
                return match mine {
                    // Nothing reached the peer's server: the caller may go
                    // another way (its `done` is dropped uncalled).
                    Some(_) if index == 0 => Err(why),
                    Some(o) => {
                        w.later(Box::new(move || (o.done)(CODE_UNAVAILABLE, why.message().as_bytes().to_vec())));
                        Ok(id)
                    }
                    // Another thread took it (the link's loss, a deadline)
                    // and runs its `done`: the call did start.
                    None => Ok(id),
                };
            }
            if !more {
                break;
            }
            index += 1;
        }
        if !self.out.lock().contains_key(&id) {
            // Taken while its last part went out (a deadline, a cancel):
            // that cancel may have reached the callee before the part did,
            // and been ignored there; this one follows every part. (A
            // reply that came first makes it a no-op at the callee.)
            let _ = w.send(link, &Msg::CallCancel { id });
        }
        Stats::add(&Stats::global().c.worker_rpcs_over_transport, 1);
        Ok(id)
    }

    /// The caller gives up call `id`: its `done` runs with CANCELLED (if it
    /// has not run), and the callee is told.
    pub(crate) fn cancel(&self, w: &dyn Wire, id: u64) {
        let Some(o) = self.out.lock().remove(&id) else { return };
        let _ = w.send(o.link, &Msg::CallCancel { id });
        w.later(Box::new(move || (o.done)(CODE_CANCELLED, b"Cancelled".to_vec())));
    }

    /// Answer served call `handle` (from `Server::call`).
    pub(crate) fn reply(&self, w: &dyn Wire, handle: u64, code: u32, body: &[u8]) {
        let Some(c) = self.served.lock().remove(handle) else { return }; // cancelled or its link lost
        let too_large;
        let (code, body) = if body.len() > MAX_CALL_BYTES {
            // The caller would take it for a protocol error and fail the
            // link; the call fails instead, and the link stays up.
            too_large = format!("{}: a reply of {} bytes exceeds the largest a call carries ({MAX_CALL_BYTES})", w.task(), body.len());
            (CODE_RESOURCE_EXHAUSTED, too_large.as_bytes())
        } else {
            (code, body)
        };
        let t = crate::trace::start();
        let mut parts = body.chunks(CALL_PART_BYTES).peekable();
        let mut index = 0usize;
        loop {
            let part = parts.next().unwrap_or(&[]);
            let more = parts.peek().is_some();
            let Ok(p) = part_index(index) else {
                w.fail_link(c.link, Error::Internal(format!("{}: a reply of more than 2^32 parts", w.task())));
                return;
            };
            if more && index == DIRECT_PARTS {
                // The rest goes from the pacing thread (see `send_parts`).
                let offset = index * CALL_PART_BYTES;
                self.defer(w, c.link, PacedKind::Reply { id: c.id, code }, &body[offset..], index, Some(t));
                return;
            }
            if let Err(e) = w.send(c.link, &Msg::Reply { id: c.id, code, part: p, more, body: part.to_vec() }) {
                w.fail_link(c.link, Error::PeerLost(format!("{}: reply on connection {} not sent: {}", w.task(), c.link, e.message())));
                return;
            }
            if !more {
                crate::trace::end("reply", t, 0, body.len() as u64, None);
                return;
            }
            index += 1;
        }
    }

    pub(crate) fn serve(&self, server: Option<Arc<dyn Server>>) {
        *self.server.write() = server;
    }

    /// Serve calls of `method` on the event thread that read them (the
    /// server promises its `call` for it returns within microseconds and
    /// never waits).
    pub(crate) fn serve_inline(&self, method: u32) -> Result<()> {
        if method >= INLINE_METHODS {
            return Err(Error::InvalidArgument(format!("method {method}: only methods below {INLINE_METHODS} can be served inline")));
        }
        self.inline_methods.fetch_or(1 << method, Ordering::Relaxed);
        Ok(())
    }

    fn served_inline(&self, method: u32) -> bool {
        method < INLINE_METHODS && self.inline_methods.load(Ordering::Relaxed) & (1 << method) != 0
    }

    /// A `Call`, `Reply` or `CallCancel` arrived on `link` (an event
    /// thread): `Err` fails the link.
    pub(crate) fn on_msg(&self, w: &dyn Wire, link: ConnId, msg: &[u8]) -> Result<()> {
        let t = crate::trace::start();
        match Msg::decode(msg)? {
            Msg::Call { id, method, part, more, body } => {
                let r = self.call_part(w, link, id, method, part, more, body);
                crate::trace::end("call in", t, 0, msg.len() as u64, None);
                r
            }
            Msg::Reply { id, code, part, more, body } => {
                let r = self.reply_part(w, link, id, code, part, more, body);
                crate::trace::end("reply in", t, 0, msg.len() as u64, None);
                r
            }
            Msg::CallCancel { id } => {
                let handle = self.served.lock().by_key.get(&(link, id)).copied();
                if let Some(h) = handle {
                    self.cancel_served(w, h);
                }
                Ok(())
            }
            m => Err(Error::Internal(format!("{} is not a call's message", m.name()))),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn call_part(&self, w: &dyn Wire, link: ConnId, id: u64, method: u32, part: u32, more: bool, body: Vec<u8>) -> Result<()> {
        let Some(whole) = self.served.lock().take_part(|| self.new_id(), link, id, method, part, more, body)? else { return Ok(()) };
        let server = self.server.read().clone();
        match server {
            Some(srv) => {
                let Whole { handle, method, body } = whole;
                let serve = move || {
                    let (t, n) = (crate::trace::start(), body.len() as u64);
                    srv.call(handle, method, body);
                    crate::trace::end("serve", t, 0, n, None);
                };
                if self.served_inline(method) {
                    serve();
                } else {
                    w.later(Box::new(serve));
                }
            }
            None => self.reply(w, whole.handle, CODE_UNIMPLEMENTED, b"this task serves no calls over the transport"),
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn reply_part(&self, w: &dyn Wire, link: ConnId, id: u64, code: u32, part: u32, more: bool, body: Vec<u8>) -> Result<()> {
        let mut out = self.out.lock();
        let Some(o) = out.get_mut(&id) else {
            // Cancelled or timed out meanwhile (its reply may still come).
            return if id <= self.next.load(Ordering::Relaxed) { Ok(()) } else { Err(Error::Protocol(format!("reply to call {id}, never made"))) };
        };
        if o.link != link {
            return Err(Error::Protocol(format!("reply to call {id} on another connection")));
        }
        if part != o.reply_parts {
            return Err(Error::Protocol(format!("reply to call {id}: part {part} where part {} was due", o.reply_parts)));
        }
        if more && body.len() != CALL_PART_BYTES {
            return Err(Error::Protocol(format!("reply to call {id}: part {part} of {} bytes before its last (parts are {CALL_PART_BYTES})", body.len())));
        }
        // The peer's code: one TensorFlow does not know is UNKNOWN.
        let code = if code > CODE_MAX { CODE_UNKNOWN } else { code };
        if o.reply.len() + body.len() > MAX_CALL_BYTES || o.reply.try_reserve(body.len()).is_err() {
            return Err(Error::Protocol(format!("reply to call {id} larger than {MAX_CALL_BYTES} bytes")));
        }
        o.reply.extend_from_slice(&body);
        o.reply_parts += 1;
        if more {
            return Ok(());
        }
        let Some(o) = out.remove(&id) else { return Ok(()) };
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
            w.later(Box::new(done));
        }
        Ok(())
    }

    fn cancel_served(&self, w: &dyn Wire, handle: u64) {
        let Some(c) = self.served.lock().remove(handle) else { return };
        if c.started {
            if let Some(srv) = self.server.read().clone() {
                w.later(Box::new(move || srv.cancel(handle)));
            }
        }
    }

    /// `link` is gone: its calls fail (UNAVAILABLE), the calls it brought
    /// are cancelled.
    pub(crate) fn link_lost(&self, w: &dyn Wire, link: ConnId, why: &Error) {
        let failed: Vec<Outgoing> = {
            let mut out = self.out.lock();
            let ids: Vec<u64> = out.iter().filter(|(_, o)| o.link == link).map(|(id, _)| *id).collect();
            ids.into_iter().filter_map(|id| out.remove(&id)).collect()
        };
        for o in failed {
            let msg = why.message().as_bytes().to_vec();
            w.later(Box::new(move || (o.done)(CODE_UNAVAILABLE, msg)));
        }
        let handles: Vec<u64> = {
            let mut s = self.served.lock();
            s.links.remove(&link);
            s.calls.iter().filter(|(_, c)| c.link == link).map(|(h, _)| *h).collect()
        };
        for h in handles {
            self.cancel_served(w, h);
        }
    }

    /// Calls past their deadline fail (DEADLINE_EXCEEDED); the callee is
    /// told (`rdev-keepalive`, every `KEEPALIVE_INTERVAL_MS`).
    pub(crate) fn expire(&self, w: &dyn Wire, now: Instant) {
        let late: Vec<(u64, Outgoing)> = {
            let mut out = self.out.lock();
            let ids: Vec<u64> = out.iter().filter(|(_, o)| o.deadline.is_some_and(|d| d <= now)).map(|(id, _)| *id).collect();
            ids.into_iter().filter_map(|id| out.remove(&id).map(|o| (id, o))).collect()
        };
        for (id, o) in late {
            let _ = w.send(o.link, &Msg::CallCancel { id });
            w.later(Box::new(move || (o.done)(CODE_DEADLINE_EXCEEDED, b"Deadline Exceeded".to_vec())));
        }
        let stalled = now.checked_sub(PARTIAL_CALL_TIMEOUT).map(|stale| self.served.lock().stalled_links(stale)).unwrap_or_default();
        for link in stalled {
            w.fail_link(link, Error::Timeout(format!("{}: a call from connection {link} stopped arriving ({:?} without its next part)", w.task(), PARTIAL_CALL_TIMEOUT)));
        }
    }

    /// Hand the rest of a body, from part `first` on, to the pacing thread.
    #[allow(clippy::too_many_arguments)]
    fn defer(&self, w: &dyn Wire, link: ConnId, kind: PacedKind, rest: &[u8], first: usize, trace: Option<i64>) {
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

    /// The node goes: every call still waiting fails.
    pub(crate) fn fail_all(&self, w: &dyn Wire) {
        let all: Vec<Outgoing> = self.out.lock().drain().map(|(_, o)| o).collect();
        for o in all {
            w.later(Box::new(move || (o.done)(CODE_UNAVAILABLE, b"transport shut down".to_vec())));
        }
    }
}

impl Served {
    /// Take call `handle` out (answered, cancelled, its link lost).
    fn remove(&mut self, handle: u64) -> Option<Incoming> {
        let c = self.calls.remove(&handle)?;
        self.by_key.remove(&(c.link, c.id));
        self.partial = self.partial.saturating_sub(c.body.capacity());
        if let Some(l) = self.links.get_mut(&c.link) {
            l.open = l.open.saturating_sub(1);
            l.partial = l.partial.saturating_sub(c.body.capacity());
        }
        Some(c)
    }

    /// Part `part` of call `id` from `link`: `Some` when it made the call
    /// whole; `Err` fails the link.
    #[allow(clippy::too_many_arguments)]
    fn take_part(&mut self, new_handle: impl FnOnce() -> u64, link: ConnId, id: u64, method: u32, part: u32, more: bool, body: Vec<u8>) -> Result<Option<Whole>> {
        let handle = match self.by_key.get(&(link, id)) {
            Some(h) => *h,
            None => {
                let lc = self.links.entry(link).or_default();
                if part != 0 {
                    // The rest of a call cancelled meanwhile (its parts
                    // were already on their way): dropped, never served.
                    return if id <= lc.highest { Ok(None) } else { Err(Error::Protocol(format!("call {id}: part {part} of a call never begun"))) };
                }
                if lc.open >= MAX_SERVED {
                    return Err(Error::Protocol(format!("more than {MAX_SERVED} calls in flight from one connection")));
                }
                if lc.partial + body.len() > self.caps.0 || self.partial + body.len() > self.caps.1 {
                    return Err(Error::ResourceExhausted(format!("call {id}: calls still arriving would hold more than {} bytes from this connection or {} from all", self.caps.0, self.caps.1)));
                }
                lc.open += 1;
                lc.highest = lc.highest.max(id);
                let h = new_handle();
                self.by_key.insert((link, id), h);
                self.calls.insert(h, Incoming { link, id, method, body: Vec::new(), parts: 0, last_part: Instant::now(), started: false });
                h
            }
        };
        let c = self.calls.get_mut(&handle).ok_or_else(|| Error::Internal("served call vanished".into()))?;
        if c.started || c.method != method || c.parts != part {
            return Err(Error::Protocol(format!("call {id}: part {part} out of order, after its last, or of another method")));
        }
        if more && body.len() != CALL_PART_BYTES {
            // `call` cuts every part but the last at CALL_PART_BYTES: short
            // ones would let a peer hold a call open for ever (each part
            // restarts the stall clock) within the caps.
            return Err(Error::Protocol(format!("call {id}: part {part} of {} bytes before its last (parts are {CALL_PART_BYTES})", body.len())));
        }
        let len = c.body.len();
        if len + body.len() > MAX_CALL_BYTES {
            return Err(Error::Protocol(format!("call {id}: body larger than {MAX_CALL_BYTES} bytes")));
        }
        // What a call holds is its buffer's capacity, which grows by
        // doubling (capped at the largest call): that is what is charged.
        let have = c.body.capacity();
        let grow_to = if len + body.len() <= have { have } else { (len + body.len()).max(have.saturating_mul(2).min(MAX_CALL_BYTES)) };
        let charge = grow_to - have;
        let lc = self.links.entry(link).or_default();
        let (link_cap, node_cap) = self.caps;
        if charge > 0 && (lc.partial.saturating_add(charge) > link_cap || self.partial.saturating_add(charge) > node_cap) {
            return Err(Error::ResourceExhausted(format!(
                "call {id}: calls still arriving would hold more than {link_cap} bytes from this connection \
                 or {node_cap} from all ({} and {} now)",
                lc.partial, self.partial
            )));
        }
        if c.body.try_reserve_exact(grow_to - len).is_err() {
            return Err(Error::ResourceExhausted(format!("call {id}: no memory for {} more bytes", body.len())));
        }
        // The allocator may give more than asked: charge what it gave.
        let charge = c.body.capacity() - have;
        c.body.extend_from_slice(&body);
        c.parts += 1;
        c.last_part = Instant::now();
        lc.partial += charge;
        self.partial += charge;
        if more {
            return Ok(None);
        }
        c.started = true;
        let whole = std::mem::take(&mut c.body);
        let held = whole.capacity();
        lc.partial = lc.partial.saturating_sub(held);
        self.partial = self.partial.saturating_sub(held);
        Ok(Some(Whole { handle, method, body: whole }))
    }

    /// Links with a call still arriving whose last part came before
    /// `stale` (they fail: the caller stopped in the middle of a call).
    fn stalled_links(&self, stale: Instant) -> Vec<ConnId> {
        let mut out: Vec<ConnId> = self.calls.values().filter(|c| !c.started && c.last_part < stale).map(|c| c.link).collect();
        out.sort_unstable();
        out.dedup();
        out
    }
}

/// The node as the channel's `Wire`.
impl Wire for Inner {
    fn task(&self) -> &str {
        &self.task
    }

    fn call_link(&self, peer: &str) -> Option<ConnId> {
        let links = self.locked(|r| r.links_of(peer));
        let live = self.links.lock();
        // Only a link this node dialled (`LinkRef::Tx`): it went to the
        // address the cluster spec gives for `peer`. A link `peer` opened
        // to us carries a name it chose (H2: an impostor would get calls).
        links.into_iter().find(|l| matches!(live.get(l), Some(super::LinkRef::Tx(_))))
    }

    fn send(&self, link: ConnId, msg: &Msg) -> Result<()> {
        self.send_msg(link, msg)
    }

    fn fail_link(&self, link: ConnId, why: Error) {
        Inner::fail_link(self, link, why)
    }

    fn later(&self, f: Box<dyn FnOnce() + Send>) {
        let done: crate::rendezvous::SendDone = Box::new(move |_: Result<()>| f());
        self.handoff.run(crate::rendezvous::Action::SendDone { done, result: Ok(()) });
    }

    fn backlog(&self, link: ConnId) -> usize {
        self.link_backlog(link)
    }

    fn start_pacing(&self) {
        self.pacer.kick(&self.me);
    }
}

impl Inner {
    pub(super) fn rpc_pace(&self) -> Pace {
        self.rpc.pace(self)
    }
    pub(super) fn rpc_fail_paced(&self) {
        self.rpc.fail_paced(self)
    }
    pub(super) fn rpc_call(&self, peer: &str, method: u32, body: &[u8], timeout: Option<Duration>, inline: bool, done: CallDone) -> Result<u64> {
        self.rpc.call(self, peer, method, body, timeout, inline, done)
    }
    pub(super) fn rpc_cancel(&self, id: u64) {
        self.rpc.cancel(self, id)
    }
    pub(super) fn rpc_reply(&self, handle: u64, code: u32, body: &[u8]) {
        self.rpc.reply(self, handle, code, body)
    }
    pub(super) fn rpc_serve(&self, server: Option<Arc<dyn Server>>) {
        self.rpc.serve(server)
    }
    pub(super) fn rpc_serve_inline(&self, method: u32) -> Result<()> {
        self.rpc.serve_inline(method)
    }
    pub(super) fn on_call_msg(&self, link: ConnId, msg: &[u8]) -> Result<()> {
        self.rpc.on_msg(self, link, msg)
    }
    pub(super) fn rpc_link_lost(&self, link: ConnId, why: &Error) {
        self.rpc.link_lost(self, link, why)
    }
    pub(super) fn rpc_expire(&self, now: Instant) {
        self.rpc.expire(self, now)
    }
    pub(super) fn rpc_fail_all(&self) {
        self.rpc.fail_all(self)
    }
}

#[cfg(all(test, feature = "shuttle"))]
mod sched_tests;

#[cfg(all(test, not(feature = "shuttle")))]
mod tests {
    use super::*;

    fn part(s: &mut Served, link: ConnId, id: u64, part: u32, more: bool, len: usize) -> Result<Option<Whole>> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1000);
        s.take_part(|| NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed), link, id, 1, part, more, vec![part as u8; len])
    }

    /// M3: calls still arriving are capped per link and node-wide (a link
    /// that goes past fails; finished and dropped calls give their room
    /// back), and one that stops arriving is found by the keepalive.
    #[test]
    fn calls_still_arriving_are_capped_per_link_and_per_node_and_expire() {
        const P: usize = CALL_PART_BYTES;
        let mut s = Served { caps: (2 * P, 3 * P), ..Served::default() };
        assert!(part(&mut s, 1, 1, 0, true, P).unwrap().is_none());
        assert!(part(&mut s, 1, 2, 0, true, P).unwrap().is_none());
        assert!(matches!(part(&mut s, 1, 3, 0, true, P), Err(Error::ResourceExhausted(_))), "past the link's cap");
        assert!(part(&mut s, 2, 1, 0, true, P).unwrap().is_none());
        assert!(matches!(part(&mut s, 2, 2, 0, true, P), Err(Error::ResourceExhausted(_))), "past the node's cap");
        // A call dropped (cancelled) gives its room back.
        let h = s.by_key[&(1, 2)];
        s.remove(h);
        assert_eq!((s.links[&1].partial, s.partial), (P, 2 * P));
        // Call 1 of link 1 made whole (its last part grows its buffer to
        // 2P, which fits both caps): its bytes leave the budget.
        let w = part(&mut s, 1, 1, 1, false, 5).unwrap().expect("whole");
        assert_eq!(w.body.len(), P + 5);
        assert_eq!((s.links[&1].partial, s.partial), (0, P));
        // Only link 2's call is still arriving: it stalls.
        let later = Instant::now() + Duration::from_secs(1);
        assert_eq!(s.stalled_links(later), vec![2]);
        assert!(s.stalled_links(Instant::now() - Duration::from_secs(1)).is_empty());
    }

    /// A `Wire` over nothing: sends are recorded (or panic, for the test
    /// that needs it), `later` runs at once on the test thread.
    #[derive(Default)]
    struct Loopback {
        sent: Mutex<Vec<Msg>>,
        panic_on_send: bool,
        /// Refuse sends of a call's part of this index (and later ones).
        fail_part: Option<u32>,
        panic_on_fail_link: bool,
        failed: Mutex<Vec<ConnId>>,
        /// What `backlog` answers, and how often pacing was asked for.
        backlog: std::sync::atomic::AtomicUsize,
        pacing: std::sync::atomic::AtomicUsize,
    }

    impl Wire for Loopback {
        fn task(&self) -> &str {
            "/job:test/task:0"
        }
        fn call_link(&self, _peer: &str) -> Option<ConnId> {
            Some(1)
        }
        fn send(&self, _link: ConnId, msg: &Msg) -> Result<()> {
            if self.panic_on_send && matches!(msg, Msg::Call { .. }) {
                panic!("a send that panics");
            }
            if let (Some(k), Msg::Call { part, .. }) = (self.fail_part, msg) {
                if *part >= k {
                    return Err(Error::PeerLost("closed".into()));
                }
            }
            self.sent.lock().push(msg.clone());
            Ok(())
        }
        fn fail_link(&self, link: ConnId, _why: Error) {
            self.failed.lock().push(link);
            if self.panic_on_fail_link {
                panic!("failing the link panics");
            }
        }
        fn later(&self, f: Box<dyn FnOnce() + Send>) {
            f()
        }
        fn backlog(&self, _link: ConnId) -> usize {
            self.backlog.load(std::sync::atomic::Ordering::SeqCst)
        }
        fn start_pacing(&self) {
            self.pacing.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// The bodies of the `Call` parts sent, in order, checking their
    /// indices run 0, 1, 2, ... and only the last says no more.
    fn call_parts(sent: &[Msg]) -> (Vec<u8>, bool) {
        let mut body = Vec::new();
        let mut last = false;
        for (i, m) in sent.iter().filter(|m| matches!(m, Msg::Call { .. })).enumerate() {
            let Msg::Call { part, more, body: b, .. } = m else { unreachable!() };
            assert_eq!(*part as usize, i, "parts out of order");
            assert!(!last, "a part after the last");
            last = !more;
            body.extend_from_slice(b);
        }
        (body, last)
    }

    /// A body of more than `DIRECT_PARTS` parts: its first parts leave on
    /// the caller's thread, the rest from the pacing thread and only while
    /// the link's backlog is under `PACE_BACKLOG` (verbs fails a send past
    /// its queue's cap: a 1.2 GB call took every entry and failed its link).
    #[test]
    fn a_large_body_sends_its_first_parts_then_paces_the_rest_by_the_links_backlog() {
        use std::sync::atomic::Ordering::SeqCst;
        let w = Loopback::default();
        let rpc = Rpc::default();
        let body: Vec<u8> = (0..(DIRECT_PARTS + 10) * CALL_PART_BYTES + 5).map(|i| (i % 251) as u8).collect();
        let (got, done) = recorder();
        rpc.call(&w, "/job:ps/task:0", 1, &body, None, false, done).unwrap();
        assert_eq!(w.sent.lock().len(), DIRECT_PARTS, "the parts sent before pacing");
        assert_eq!(w.pacing.load(SeqCst), 1);
        // A full link: nothing more goes.
        w.backlog.store(PACE_BACKLOG, SeqCst);
        assert_eq!(rpc.pace(&w), Pace::Stalled);
        assert_eq!(w.sent.lock().len(), DIRECT_PARTS);
        // Room: the rest, in order, whole.
        w.backlog.store(0, SeqCst);
        assert_eq!(rpc.pace(&w), Pace::Progress);
        let (sent, last) = call_parts(&w.sent.lock());
        assert!(last && sent == body, "the parts do not make the body");
        assert_eq!(rpc.pace(&w), Pace::Idle);
        assert!(got.lock().is_empty() && w.failed.lock().is_empty());
    }

    /// A paced call taken meanwhile (here cancelled) sends no more parts,
    /// and the callee is told to drop what it holds.
    #[test]
    fn a_paced_call_cancelled_midway_stops_and_tells_the_callee() {
        let w = Loopback::default();
        let rpc = Rpc::default();
        let body = vec![7u8; (DIRECT_PARTS + 3) * CALL_PART_BYTES];
        let (got, done) = recorder();
        let id = rpc.call(&w, "/job:ps/task:0", 1, &body, None, false, done).unwrap();
        rpc.cancel(&w, id);
        assert_eq!(got.lock()[0].0, CODE_CANCELLED);
        w.sent.lock().clear();
        assert_eq!(rpc.pace(&w), Pace::Idle);
        let sent = w.sent.lock();
        assert!(matches!(sent[..], [Msg::CallCancel { id: i }] if i == id), "{:?}", sent.iter().map(|m| m.name()).collect::<Vec<_>>());
    }

    type Outcomes = Arc<Mutex<Vec<(u32, Vec<u8>)>>>;

    fn recorder() -> (Outcomes, CallDone) {
        let got: Outcomes = Arc::default();
        let g = got.clone();
        (got, Box::new(move |code, body| g.lock().push((code, body))))
    }

    /// Review finding: a panic after the call was registered (here in the
    /// send of its first part) used to unwind out of `call` while `done`
    /// stayed in `out`; the C ABI turned the panic into an error, the shim
    /// freed the call's state and went to gRPC, and a later `fail_all` ran
    /// `done` on freed memory. Now the call ends there: `Ok`, and `done`
    /// runs once with an error.
    #[test]
    fn a_panic_while_a_call_starts_still_runs_its_done_exactly_once() {
        let w = Loopback { panic_on_send: true, ..Loopback::default() };
        let rpc = Rpc::default();
        let (got, done) = recorder();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rpc.call(&w, "/job:peer/task:0", 1, b"body", None, false, done)));
        let r = r.expect("the panic unwound out of Rpc::call with its done still registered");
        assert!(r.is_ok(), "{r:?}");
        assert!(rpc.out.lock().is_empty(), "the call is still registered");
        rpc.fail_all(&w);
        let got = got.lock();
        assert_eq!(got.len(), 1, "done ran {} times", got.len());
        assert_eq!(got[0].0, CODE_INTERNAL);
    }

    /// Review finding: a send failing in the middle of a call took the
    /// call out of `out` and then failed the link; a panic there dropped
    /// `done` unrun while `call` returned `Ok` (TF would wait for ever).
    /// A failing first part still returns `Err` with `done` unrun; a later
    /// one runs `done` once, panic or not.
    #[test]
    fn a_panic_while_failing_the_link_loses_no_call() {
        for (fail_part, want_err) in [(0u32, true), (1, false)] {
            let w = Loopback { fail_part: Some(fail_part), panic_on_fail_link: true, ..Loopback::default() };
            let rpc = Rpc::default();
            let (got, done) = recorder();
            let body = vec![1u8; 2 * CALL_PART_BYTES];
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rpc.call(&w, "/job:peer/task:0", 1, &body, None, false, done)));
            let r = r.expect("a panic unwound out of Rpc::call");
            assert_eq!(r.is_err(), want_err, "part {fail_part}: {r:?}");
            let runs = got.lock().len();
            assert_eq!(runs, usize::from(!want_err), "part {fail_part} failed: done ran {runs} times");
            assert!(rpc.out.lock().is_empty());
        }
    }

    /// Review finding: every part but a call's (or reply's) last is
    /// `CALL_PART_BYTES` long, as `call` and `reply` cut them. A peer's
    /// empty or short non-last parts used to be taken, each resetting the
    /// stall clock, so a call could be held open for ever within the caps.
    #[test]
    fn short_parts_before_the_last_fail_the_link() {
        let w = Loopback::default();
        let rpc = Rpc::default();
        let call = |part: u32, more: bool, len: usize| Msg::Call { id: 3, method: 1, part, more, body: vec![7; len] }.encode().to_vec();
        assert!(rpc.on_msg(&w, 1, &call(0, true, 0)).is_err(), "an empty part with more to come was taken");
        let rpc = Rpc::default();
        assert!(rpc.on_msg(&w, 1, &call(0, true, CALL_PART_BYTES - 1)).is_err(), "a short part with more to come was taken");
        let rpc = Rpc::default();
        rpc.on_msg(&w, 1, &call(0, true, CALL_PART_BYTES)).unwrap();
        rpc.on_msg(&w, 1, &call(1, false, 5)).unwrap();
        // Replies alike.
        let rpc = Rpc::default();
        let (_got, done) = recorder();
        let id = rpc.call(&w, "/job:peer/task:0", 1, b"q", None, false, done).unwrap();
        let reply = Msg::Reply { id, code: 0, part: 0, more: true, body: vec![1; 10] }.encode().to_vec();
        assert!(rpc.on_msg(&w, 1, &reply).is_err(), "a short reply part with more to come was taken");
    }

    /// Review finding: the caps counted the bytes received, while the
    /// buffers holding them grow by doubling, so twice the cap could be
    /// allocated. Now what a call holds is its buffer's capacity.
    #[test]
    fn calls_still_arriving_are_charged_what_their_buffers_hold() {
        let mut s = Served { caps: (usize::MAX, usize::MAX), ..Served::default() };
        for i in 0..5u32 {
            s.take_part(|| 77, 1, 1, 1, i, true, vec![0; CALL_PART_BYTES]).unwrap();
            let held = s.calls[&77].body.capacity();
            assert_eq!((s.links[&1].partial, s.partial), (held, held), "after part {i}: charged less than the buffer holds");
        }
        let w = s.take_part(|| 77, 1, 1, 1, 5, false, vec![0; 3]).unwrap().expect("whole");
        assert_eq!(w.body.len(), 5 * CALL_PART_BYTES + 3);
        assert_eq!((s.links[&1].partial, s.partial), (0, 0));
        // A cap below the doubled buffer refuses the part that would need it.
        let mut s = Served { caps: (3 * CALL_PART_BYTES, usize::MAX), ..Served::default() };
        for i in 0..2u32 {
            s.take_part(|| 78, 1, 1, 1, i, true, vec![0; CALL_PART_BYTES]).unwrap();
        }
        let r = s.take_part(|| 78, 1, 1, 1, 2, true, vec![0; CALL_PART_BYTES]);
        assert!(matches!(r, Err(Error::ResourceExhausted(_))), "a buffer grown to 4 parts under a cap of 3: ok={}", r.is_ok());
    }

    /// Review finding: a reply's status code is the peer's; one TensorFlow
    /// does not know reaches the caller as UNKNOWN, not cast blindly.
    #[test]
    fn a_reply_code_tensorflow_does_not_know_becomes_unknown() {
        let w = Loopback::default();
        for (sent, seen) in [(0u32, 0u32), (5, 5), (16, 16), (17, 2), (u32::MAX, 2)] {
            let rpc = Rpc::default();
            let (got, done) = recorder();
            let id = rpc.call(&w, "/job:peer/task:0", 1, b"q", None, false, done).unwrap();
            rpc.on_msg(&w, 1, &Msg::Reply { id, code: sent, part: 0, more: false, body: b"r".to_vec() }.encode()).unwrap();
            assert_eq!(got.lock()[0].0, seen, "code {sent}");
        }
    }

    /// M1: parts must come in order from 0; the tail of a call dropped
    /// meanwhile is dropped, a part of a call never begun fails the link.
    #[test]
    fn parts_come_in_order_and_tails_of_dropped_calls_are_never_served() {
        let mut s = Served::default();
        assert!(part(&mut s, 1, 5, 0, true, CALL_PART_BYTES).unwrap().is_none());
        assert!(part(&mut s, 1, 5, 2, true, CALL_PART_BYTES).is_err(), "a part skipped");
        let mut s = Served::default();
        assert!(part(&mut s, 1, 5, 0, true, CALL_PART_BYTES).unwrap().is_none());
        let h = s.by_key[&(1, 5)];
        s.remove(h); // cancelled
        assert!(part(&mut s, 1, 5, 1, true, CALL_PART_BYTES).unwrap().is_none(), "the tail is dropped");
        assert!(part(&mut s, 1, 5, 2, false, 3).unwrap().is_none(), "and never served");
        assert!(s.calls.is_empty());
        assert!(part(&mut s, 1, 9, 1, false, 3).is_err(), "a part of a call never begun");
    }
}
