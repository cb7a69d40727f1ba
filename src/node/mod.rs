//! One task's transport: the arena, the backends, the protocol state, and
//! the glue that turns fabric events into protocol inputs and protocol
//! actions into fabric calls. This is what the C ABI wraps: one `Node` per
//! TensorFlow server.
//!
//! Threading: protocol state sits behind one mutex; actions are executed
//! after it is released, so completions may call back in. A backend's
//! event threads (shm progress and reader threads, the verbs progress
//! thread) only update the protocol state and send control messages:
//! completions for the application (a receive's or send's callback) and
//! writes that an event released (a queued send) are handed to the node's
//! `rdev-callbacks` thread (handoff.rs), so no tensor copy or memory
//! registration ever runs on an event thread, and no application callback
//! but those the application declared fit for it (return promptly, call
//! only non-blocking functions): a successful receive's
//! (`rdev_recv_inline`; TensorFlow's receive `done` for host memory), a
//! successful small call reply's (`rdev_call_inline`) and the serving of
//! a call of a method declared fit (`rdev_serve_inline`; TensorFlow's
//! RunGraph and CleanupGraph).
//! Callbacks run on the calling thread or on `rdev-callbacks`, and must
//! not call the blocking functions below.
//!
//! Every call that can block, the thread it may run on, and its bound:
//!
//! | call | runs on | waits for | bound |
//! |---|---|---|---|
//! | `Node::send` | any (TF executor threads) | no network: a first send to a peer is queued while `rdev-connect` connects; on a live link a write of `WRITE_ENGINE_MIN` (64 KiB) or more is posted to `rdev-write` (engine.rs) and `send` returns; a smaller one (the copy into the receiver's slot on shm) runs on the caller, which then pushes the doorbell ring or, when it is full, queues the write and returns | a small copy |
//! | tensor writes of 64 KiB or more | `rdev-write` (2 per node, queued) | the copy (shm) or registration and post (verbs); a full ring queues it | the copy |
//! | `Node::rpc_call`, `rpc_reply`, `rpc_cancel` (worker RPCs, rpc.rs) | the caller (TF's master; for replies, the thread that finished the call: an executor thread, or the event thread of a call served there) | nothing: one control message per 64 KiB of body, as below | — |
//! | dropping a received tensor (`Lease`) | any (TF threads) | nothing: its slot's credit is posted (shm: queued for `rdev-shm-send`, no I/O on the releasing thread; verbs: a post) | — |
//! | `Node::recv`, `step_done`, `step_idle`, `step_active`, `abort_*` | any | nothing | — |
//! | `Node::connect` | the shim's pool | the connection | RDMA_DEVICE_CONNECT_TIMEOUT_MS (1.5 s for a lost peer) |
//! | `Node::place_ahead` | the shim's pool | connect + the receiver's Publish | connect + `timeout` |
//! | `Node::request_placement` | the shim's pool | connect + the sender's PlaceDone | connect + `timeout` |
//! | placement for a peer (`place_for`) | the `rdev-place` pool (4 threads, queued) | as `place_ahead` | connect + connect timeout |
//! | connect and flush queued sends (one per peer at a time) | the `rdev-connect` pool (4 threads, queued) | `Fabric::connect` | connect timeout |
//! | watching a peer we only receive from (one per peer at a time) | the `rdev-connect` pool | `Fabric::connect` | connect timeout |
//! | `Events::on_accept` | the connection's own thread (shm: its reader; verbs: `rdev-verbs-setup`, never the progress thread) | `Node::new` to finish registering listeners (only a hello that arrives while the node starts) | 10 s |
//! | shm writes whose doorbell ring is full (8192 entries: only when the receiver's progress thread has stopped) | `rdev-shm-send` (one per process) | ring space, polled every millisecond | 10 s, then the write fails with Timeout |
//! | shm control messages the socket did not take at once | `rdev-shm-send` | socket space (poll) | `CONTROL_SEND_TIMEOUT_MS` (10 s) without progress, then the link fails |
//! | shm/verbs progress threads | own threads | events (sleep on the doorbell / CQ channel) | woken by events or shutdown |
//! | callbacks and writes released by events | `rdev-callbacks` (one per node, queued); a successful `rdev_recv_inline` receive's callback, a successful small `rdev_call_inline` reply's and a call of a method served on the event thread (`rdev_serve_inline`) on the event thread itself | what the callback does; a write as `send` on a live link | as `send` |
//! | probing links with work waiting on their peer (`Msg::Ping`, keepalive.rs); failing calls past their deadline | `rdev-keepalive` (one per node) | nothing: a control message, as below | — |
//! | granting a placed slot to its sender (`NodeGranter` → `Listener::grant`, under the protocol lock) | whichever thread placed it (an event thread included) | nothing: shm maps the window's pages; verbs allocates a memory window and queues its bind on the sender's QP ahead of the Publish (ordered by the send queue, never awaited; see `fabric::verbs::mw`); a new 64 MiB arena extent the window needs is registered on `rdev-verbs-setup` and the bind waits for it in the QP's queue (`fabric::no_blocking` marks the lock; debug builds assert no registration runs under it) | — |
//!
//! Control messages never wait for the peer: verbs queues them on the
//! connection (a full queue is an error); shm makes one non-blocking
//! `send(2)` and queues what the socket does not take for `rdev-shm-send`
//! (`fabric::shm::outbox`), which fails the link when the peer takes
//! nothing for `CONTROL_SEND_TIMEOUT_MS` (10 s). A message sent on a
//! connection the backend has accepted but not yet answered is held and
//! follows the answer.
//!
//! Locks: a peer's tx slot state is held only to read or set its link and
//! its "connecting" flag (taking `links` to check the link is live), never
//! across a connect: other callers wait on its condvar up to their own
//! deadline; `links` may be held while taking `rdv`
//! (registering or ending a link, through `locked_under_links`, which
//! hands back the links to fail instead of failing them: failing one takes
//! `links`); `rdv` may be held while taking
//! `listeners` and a listener's own locks (granting), never the reverse; `peers.table` and `idle` are held only for
//! their own map updates, never while taking another lock. No callback is invoked while
//! any of them is held.

mod handoff;
pub mod rpc;
mod engine;
mod events;
mod exec;
mod idle;
mod keepalive;
mod lease;
mod pace;
mod peers;
mod placing;
mod poll;
mod pool;
mod routes;
mod stream;
mod write;

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::config::Config;
use crate::constants::HEADER_BYTES;
use crate::error::{Error, Result};
use crate::fabric::{self, Arena, ConnId, Endpoint, Fabric, FabricEvents, Listener, TransportKind};
use crate::rendezvous::{self, Action, Actions, Data, Hello, Params, Payload, Received, Rendezvous, TensorMeta};
use crate::stats::Stats;
use crate::trace;

use events::{Events, NodeGranter};
pub use lease::Lease;
pub use poll::Poller;
pub use routes::{strict_refusal, PeerChoice, RouteNow, ROUTE_WAIT_MS};

pub type LeaseDone = Box<dyn crate::completion::Complete<Result<Lease>>>;

enum LinkRef {
    Tx(Arc<dyn Endpoint>),
    Rx(TransportKind),
}

pub(crate) struct Inner {
    cfg: Config,
    task: String,
    addr: String,
    incarnation: u64,
    arena: Arc<Arena>,
    fabrics: Vec<Arc<dyn Fabric>>,
    listeners: Mutex<HashMap<TransportKind, Arc<dyn Listener>>>,
    rdv: Mutex<Rendezvous>,
    links: Mutex<HashMap<ConnId, LinkRef>>,
    /// Connections that ended before they were registered in `links`.
    ended_early: Mutex<std::collections::HashSet<ConnId>>,
    peers: peers::Peers,
    /// Set once every listener is registered: a connection accepted while
    /// `Node::new` is still running waits for it, so replies on it can
    /// find their listener.
    ready: (Mutex<bool>, parking_lot::Condvar),
    /// Notified whenever a control message has been processed, for threads
    /// waiting on a placement's outcome (instead of polling).
    progress: (Mutex<u64>, parking_lot::Condvar),
    /// Placements we asked other tasks to make: request id → answer.
    placing: Mutex<HashMap<u64, std::sync::mpsc::Sender<(u32, String)>>>,
    /// Placements other tasks asked us to make, queued or running, per
    /// link (capped: `MAX_PLACEMENTS_PER_LINK`; see `place_for`).
    placing_for: Mutex<HashMap<ConnId, usize>>,
    /// This node's own counters (Stats holds the process-wide sums).
    totals: Mutex<rendezvous::Tally>,
    /// Callbacks and writes that events produced (see handoff.rs).
    handoff: handoff::Handoff,
    /// Steps with no object left here, ended after a linger (idle.rs).
    idle: Mutex<idle::IdleSteps>,
    /// Probes links with work waiting on their peer (see keepalive.rs).
    _keepalive: keepalive::Keepalive,
    /// Calls over the transport (worker RPCs, see rpc.rs).
    rpc: rpc::Rpc,
    /// Sends the rest of large call and reply bodies (see pace.rs).
    pacer: pace::Pacer,
    /// Large tensor writes, off TensorFlow's threads (see engine.rs).
    engine: engine::WriteEngine,
    /// How long a waiting thread polls before it parks (see poll.rs).
    poll_window: poll::Window,
    me: Weak<Inner>,
}

pub struct Node {
    inner: Arc<Inner>,
}

/// A random 64-bit value (std's hasher keys come from the OS RNG).
pub fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::process::id() as u64);
    h.finish()
}

impl Node {
    /// Start the transport for task `task` serving at `addr` ("host:port").
    pub fn new(cfg: Config, task: &str, addr: &str) -> Result<Node> {
        init_logging(&cfg);
        if cfg.trace {
            trace::set_enabled(true);
        }
        let arena = Arc::new(Arena::new("rdma_device-arena", cfg.arena_bytes)?);
        let fabrics = fabric::build_all(&cfg);
        let incarnation = random_u64();
        let params = Params {
            slots_per_edge: cfg.slots_per_edge,
            max_outstanding_writes: cfg.max_outstanding_writes,
            incarnation,
            rpc: cfg.rpc_mode,
        };
        let rdv = Rendezvous::new(params, arena.len() as u64);
        let inner = Arc::new_cyclic(|me| Inner {
            cfg,
            task: task.to_string(),
            addr: addr.to_string(),
            incarnation,
            arena,
            fabrics,
            listeners: Mutex::new(HashMap::new()),
            rdv: Mutex::new({
                let mut rdv = rdv;
                rdv.set_granter(Arc::new(NodeGranter { node: me.clone() }));
                rdv
            }),
            links: Mutex::new(HashMap::new()),
            ended_early: Mutex::new(std::collections::HashSet::new()),
            peers: peers::Peers::default(),
            ready: (Mutex::new(false), parking_lot::Condvar::new()),
            progress: (Mutex::new(0), parking_lot::Condvar::new()),
            placing: Mutex::new(HashMap::new()),
            placing_for: Mutex::new(HashMap::new()),
            totals: Mutex::new(rendezvous::Tally::default()),
            handoff: handoff::Handoff::start(me.clone()),
            idle: Mutex::new(idle::IdleSteps::default()),
            _keepalive: keepalive::Keepalive::start(me.clone()),
            rpc: rpc::Rpc::default(),
            pacer: pace::Pacer::default(),
            engine: engine::WriteEngine::start(),
            poll_window: poll::Window::default(),
            me: me.clone(),
        });
        if !inner.handoff.started() {
            return Err(Error::Internal("cannot start the rdev-callbacks thread (out of threads or memory)".into()));
        }
        let st = Stats::global();
        st.c.arena_bytes_total.store(inner.arena.len() as u64, std::sync::atomic::Ordering::Relaxed);
        for f in &inner.fabrics {
            if let Err(e) = f.is_viable() {
                log::info!("{} transport not viable: {e}", f.kind().name());
                continue;
            }
            let events: Arc<dyn FabricEvents> = Arc::new(Events::new(Arc::downgrade(&inner), f.kind()));
            match f.listen(addr, inner.arena.clone(), events) {
                Ok(l) => {
                    inner.listeners.lock().insert(f.kind(), l);
                }
                Err(e) => log::warn!("{} transport cannot listen at {addr}: {e}", f.kind().name()),
            }
        }
        *inner.ready.0.lock() = true;
        inner.ready.1.notify_all();
        log::info!("rdma_device node {task} at {addr} (incarnation {incarnation:#x})");
        Ok(Node { inner })
    }

    pub fn config(&self) -> &Config {
        &self.inner.cfg
    }

    pub fn task(&self) -> &str {
        &self.inner.task
    }

    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    /// Transports this node can serve, with the reason for each that can't.
    pub fn transports(&self) -> Vec<(TransportKind, Result<()>)> {
        let l = self.inner.listeners.lock();
        self.inner
            .fabrics
            .iter()
            .map(|f| {
                let ok = if l.contains_key(&f.kind()) { Ok(()) } else { f.is_viable().and(Err(Error::NotViable("not listening".into()))) };
                (f.kind(), ok)
            })
            .collect()
    }

    /// Learn of `peer` at `addr`; returns the transport that will carry
    /// tensors between us, or why none can (then the caller uses gRPC).
    /// Chooses on this thread (a name lookup, a probe): see `set_peer`.
    pub fn add_peer(&self, peer: &str, addr: &str) -> PeerChoice {
        self.inner.add_peer(peer, addr)
    }

    /// Learn of `peer` at `addr` without waiting: a new (or moved) peer's
    /// route is pending while `rdev-route` chooses it (routes.rs). The same
    /// address again changes nothing. Returns whether a choice began.
    pub fn set_peer(&self, peer: &str, addr: &str) -> bool {
        self.inner.set_peer(peer, addr)
    }

    /// The route to `peer` now (routes.rs): pending, a transport, or gRPC
    /// with the reason; strict mode turns gRPC into `Error::Strict`, and a
    /// route pending past `ROUTE_WAIT_MS` is a timeout.
    pub fn route(&self, peer: &str) -> Result<RouteNow> {
        self.inner.route(peer)
    }

    /// Whether a tensor with `peer` may go over stock gRPC for a reason the
    /// caller found (`why`): Ok, or `Error::Strict` in strict mode.
    pub fn grpc_fallback(&self, peer: &str, why: &str) -> Result<()> {
        self.inner.grpc_fallback(peer, why)
    }

    /// Push `payload` for `(key, step)` to `peer`. On `Ok`, `done` runs
    /// exactly once, when the payload may be reused (any thread, possibly
    /// before this returns). On `Err` (no connection to the peer could be
    /// made, e.g. it routes us over gRPC) `done` is dropped uncalled, so the
    /// caller can send the tensor another way.
    pub fn send(&self, peer: &str, key: &str, step: u64, meta: TensorMeta, payload: Box<dyn Payload>, done: rendezvous::SendDone) -> Result<()> {
        let t = trace::start();
        let bytes = payload.bytes().len() as u64;
        let r = self.inner.send(peer, key, step, meta, payload, done);
        trace::end("send", t, step, bytes, Some(key));
        r
    }

    /// Sender side, ahead of the first step (static shapes): have `peer`
    /// place `key` for `bytes` and wait until it has, so the first send
    /// of the edge is already a push. `Ok(false)`: no room at the peer.
    pub fn place_ahead(&self, peer: &str, key: &str, bytes: u64, timeout: std::time::Duration) -> Result<bool> {
        self.inner.place_ahead(peer, key, bytes, timeout)
    }

    /// Static placement on behalf of another task: have `sender` place the
    /// edge `key` it sends to `receiver` for `bytes` (as `place_ahead` does
    /// on it) and wait up to `timeout` for the outcome. For graphs
    /// partitioned in one process and run in others (tf.function).
    pub fn request_placement(&self, sender: &str, receiver: &str, key: &str, bytes: u64, timeout: std::time::Duration) -> Result<bool> {
        self.inner.request_placement(sender, receiver, key, bytes, timeout)
    }

    /// Connect to `peer` now rather than on first use.
    pub fn connect(&self, peer: &str) -> Result<()> {
        self.inner.connect(peer)
    }

    /// Receive `(key, step)` from `peer`. `done` runs exactly once.
    pub fn recv(&self, peer: &str, key: &str, step: u64, done: LeaseDone) {
        let t = trace::start();
        self.inner.recv(peer, key, step, done);
        trace::end("recv", t, step, 0, Some(key));
    }

    /// The step is over here: unclaimed arrivals are released, late pushes
    /// dropped, queued sends fail.
    pub fn step_done(&self, step: u64) {
        Stats::add(&Stats::global().c.steps_ended, 1);
        self.inner.idle.lock().active(step);
        self.inner.step_done(step);
    }

    /// The last object of `step` on this task is gone, but the step may go
    /// on (a new one may come for it): it ends after `IDLE_STEP_LINGER_MS`
    /// unless `step_active` comes first, or at `step_done` (see idle.rs).
    pub fn step_idle(&self, step: u64) {
        // TF may drop its last object of a step after it cleaned the step
        // up: nothing to keep open then.
        if self.inner.rdv.lock().step_finished(step) {
            return;
        }
        let ended = self.inner.idle.lock().idle(step, std::time::Instant::now());
        if let Some(oldest) = ended {
            self.inner.step_done(oldest);
        }
    }

    /// An object of `step` exists on this task (again): it is not idle.
    pub fn step_active(&self, step: u64) {
        if self.inner.idle.lock().active(step) {
            log::debug!("{}: step {step} goes on after it was idle", self.inner.task);
            Stats::add(&Stats::global().c.steps_reopened, 1);
        }
    }

    /// Abort `step`: its waiters and queued sends fail with `why`; with
    /// `propagate`, peers fail what they wait on from us for it.
    pub fn abort_step(&self, step: u64, why: Error, propagate: bool) {
        self.abort_step_caused(step, 0, why, propagate);
    }

    /// `abort_step`, telling peers the TensorFlow error code of the failure
    /// that caused it (0: none; see `Rendezvous::abort_step_caused`).
    pub fn abort_step_caused(&self, step: u64, cause: u32, why: Error, propagate: bool) {
        self.inner.idle.lock().active(step);
        self.inner.fail_queued(|s| s == step, &|| why.clone());
        let acts = self.inner.locked(|r| r.abort_step_caused(step, cause, why, propagate));
        self.inner.exec(acts);
    }

    /// Cancel one receive: it completes with `why` if it still waits; the
    /// step goes on (see `Rendezvous::cancel_recv`).
    pub fn cancel_recv(&self, key: &str, step: u64, why: Error) {
        let acts = self.inner.locked(|r| r.cancel_recv(key, step, why));
        self.inner.exec(acts);
    }

    pub fn abort_all(&self, why: Error) {
        self.inner.fail_queued(|_| true, &|| why.clone());
        let acts = self.inner.locked(|r| r.abort_all(why));
        self.inner.exec(acts);
    }

    /// This node's protocol counters so far.
    pub fn counters(&self) -> rendezvous::Tally {
        self.inner.totals.lock().clone()
    }

    /// A dump of the protocol state, for diagnostics.
    pub fn describe(&self) -> String {
        self.inner.locked(|r| r.describe())
    }

    /// Drop every connection to or from `peer` (its waiters fail).
    pub fn abort_peer(&self, peer: &str) {
        self.inner.close_peer(peer);
    }

    /// Call `method` on `peer` over the transport with `body` (see
    /// rpc.rs); `done(code, body)` runs exactly once on `rdev-callbacks`.
    /// `Err`: no live connection with `peer` (or the first part could not
    /// be sent): nothing reached it, `done` is dropped uncalled.
    pub fn rpc_call(&self, peer: &str, method: u32, body: &[u8], timeout: Option<std::time::Duration>, done: rpc::CallDone) -> Result<u64> {
        self.inner.rpc_call(peer, method, body, timeout, false, done)
    }

    /// `rpc_call` for a `done` fit to run on the event thread that reads
    /// the reply (it returns within microseconds and never waits): a
    /// successful reply of at most `rpc::EVENT_THREAD_REPLY_MAX` bytes runs
    /// it there, one thread wake-up sooner; anything else as `rpc_call`.
    pub fn rpc_call_on_event_thread(&self, peer: &str, method: u32, body: &[u8], timeout: Option<std::time::Duration>, done: rpc::CallDone) -> Result<u64> {
        self.inner.rpc_call(peer, method, body, timeout, true, done)
    }

    /// Give up call `id` (its done runs with CANCELLED; the callee is told).
    pub fn rpc_cancel(&self, id: u64) {
        self.inner.rpc_cancel(id)
    }

    /// Serve calls from peers with `server` (None: stop; calls are then
    /// answered UNIMPLEMENTED).
    pub fn rpc_serve(&self, server: Option<Arc<dyn rpc::Server>>) {
        self.inner.rpc_serve(server)
    }

    /// Hand calls of `method` (below `rpc::EVENT_THREAD_METHODS`) to the
    /// server on the event thread that read them, not on `rdev-callbacks`: for a
    /// method whose `Server::call` returns within microseconds and never
    /// waits (it delays everything else that thread handles meanwhile).
    pub fn rpc_serve_on_event_thread(&self, method: u32) -> Result<()> {
        self.inner.rpc_serve_on_event_thread(method)
    }

    /// Answer served call `handle`: `code` 0 with `body`, or an error code
    /// with its message.
    pub fn rpc_reply(&self, handle: u64, code: u32, body: &[u8]) {
        self.inner.rpc_reply(handle, code, body)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.inner.rpc_serve(None);
        self.inner.rpc_fail_all();
        self.abort_all(Error::Aborted("transport shut down".into()));
        let listeners: Vec<_> = self.inner.listeners.lock().drain().collect();
        for l in listeners {
            l.1.shutdown();
        }
        let eps: Vec<Arc<dyn Endpoint>> = self
            .inner
            .links
            .lock()
            .drain()
            .filter_map(|(_, l)| match l {
                LinkRef::Tx(e) => Some(e),
                LinkRef::Rx(_) => None,
            })
            .collect();
        for e in eps {
            e.close();
        }
    }
}

/// Complete a handed-over action whose node is gone.
pub(super) fn abandon(a: Action) {
    let gone = || Error::Aborted("transport shut down".into());
    match a {
        Action::Write { done, payload, .. } => {
            payload.release();
            done.complete(Err(gone()))
        }
        Action::SendDone { done, result } => done.complete(result),
        Action::Deliver { done, result } => done.complete(result),
        _ => {}
    }
}

fn mode_name(rpc: bool) -> &'static str {
    if rpc { "rpc" } else { "push" }
}

fn init_logging(cfg: &Config) {
    let _ = env_logger::Builder::new().parse_filters(&cfg.log).format_timestamp_micros().try_init();
}
