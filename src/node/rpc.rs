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
//! - On the event thread, one thread wake-up fewer at each end: a method
//!   the server declared fit (`rpc_serve_on_event_thread`: its `call`
//!   returns within microseconds and never waits) is handed to it on the
//!   event thread that read the call's last part; a caller that declared
//!   its `done` fit (`rpc_call(.., on_event_thread: true, ..)`) gets a
//!   successful reply of at most `EVENT_THREAD_REPLY_MAX` bytes on the
//!   event thread that read it. Failures, cancellations, deadlines and
//!   larger replies still run on `rdev-callbacks`. (The C ABI calls this
//!   "inline": `rdev_serve_inline`, `rdev_call_inline`.)
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
/// Largest reply handed to a caller on the event thread that read it (a larger
/// one, e.g. a RunGraph response carrying fetched tensors, is parsed on
/// `rdev-callbacks`, not on the thread that reads the link).
pub const EVENT_THREAD_REPLY_MAX: usize = 64 << 10;
/// Method ids a server may have served on the event thread
/// (`rpc_serve_on_event_thread`): below this.
pub const EVENT_THREAD_METHODS: u32 = 64;
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

struct Outgoing {
    link: ConnId,
    done: CallDone,
    /// A successful reply may complete on the event thread.
    on_event_thread: bool,
    deadline: Option<Instant>,
    /// Reply parts so far, and how many.
    reply: Vec<u8>,
    reply_parts: u32,
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
    event_thread_methods: AtomicU64,
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
    /// the module docs; `on_event_thread`: a successful small reply may run it on
    /// the event thread). `Err`: the call could not start over the
    /// transport (`done` dropped uncalled; make it another way). `Ok`:
    /// `done` runs, even when the link is lost while the parts go out.
    ///
    /// Whoever removes the call from `out` owns its `done`: this function
    /// (its first part not sent), a reply, `cancel`, `expire`, `link_lost`
    /// or `fail_all`. Only when this function removed it before any part
    /// left may it return `Err`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn call(&self, w: &dyn Wire, peer: &str, method: u32, body: &[u8], timeout: Option<Duration>, on_event_thread: bool, done: CallDone) -> Result<u64> {
        let Some(link) = w.call_link(peer) else {
            return Err(Error::NotViable(format!("no connection with {peer} yet")));
        };
        if body.len() > MAX_CALL_BYTES {
            return Err(Error::NotViable(format!("a call body of {} bytes exceeds {MAX_CALL_BYTES}", body.len())));
        }
        part_index(body.len() / CALL_PART_BYTES.max(1))?;
        let id = self.new_id();
        let deadline = timeout.map(|t| Instant::now() + t);
        self.out.lock().insert(id, Outgoing { link, done, on_event_thread, deadline, reply: Vec::new(), reply_parts: 0 });
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
    pub(crate) fn serve_on_event_thread(&self, method: u32) -> Result<()> {
        if method >= EVENT_THREAD_METHODS {
            return Err(Error::InvalidArgument(format!("method {method}: only methods below {EVENT_THREAD_METHODS} can be served inline")));
        }
        self.event_thread_methods.fetch_or(1 << method, Ordering::Relaxed);
        Ok(())
    }

    fn served_on_event_thread(&self, method: u32) -> bool {
        method < EVENT_THREAD_METHODS && self.event_thread_methods.load(Ordering::Relaxed) & (1 << method) != 0
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
                if self.served_on_event_thread(method) {
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
        let here = o.on_event_thread && code == 0 && o.reply.len() <= EVENT_THREAD_REPLY_MAX;
        let done = move || {
            let (t, n) = (crate::trace::start(), o.reply.len() as u64);
            (o.done)(code, o.reply);
            crate::trace::end("call done", t, 0, n, None);
        };
        if here {
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

    /// The node goes: every call still waiting fails.
    pub(crate) fn fail_all(&self, w: &dyn Wire) {
        let all: Vec<Outgoing> = self.out.lock().drain().map(|(_, o)| o).collect();
        for o in all {
            w.later(Box::new(move || (o.done)(CODE_UNAVAILABLE, b"transport shut down".to_vec())));
        }
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
    pub(super) fn rpc_call(&self, peer: &str, method: u32, body: &[u8], timeout: Option<Duration>, on_event_thread: bool, done: CallDone) -> Result<u64> {
        self.rpc.call(self, peer, method, body, timeout, on_event_thread, done)
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
    pub(super) fn rpc_serve_on_event_thread(&self, method: u32) -> Result<()> {
        self.rpc.serve_on_event_thread(method)
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

mod paced;
mod served;
pub(crate) use paced::Pace;
use served::{Served, Whole};
use paced::{Paced, PacedKind};

#[cfg(all(test, feature = "shuttle"))]
mod sched_tests;

#[cfg(all(test, not(feature = "shuttle")))]
mod tests;
