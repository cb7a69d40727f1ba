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
//! a call of a method declared inline (`rdev_serve_inline`; TensorFlow's
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
//! | `Node::rpc_call`, `rpc_reply`, `rpc_cancel` (worker RPCs, rpc.rs) | the caller (TF's master; for replies, the thread that finished the call: an executor thread, or the event thread of a call served inline) | nothing: one control message per 64 KiB of body, as below | — |
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
//! | callbacks and writes released by events | `rdev-callbacks` (one per node, queued); a successful `rdev_recv_inline` receive's callback, a successful small `rdev_call_inline` reply's and a call of a method served inline (`rdev_serve_inline`) on the event thread itself | what the callback does; a write as `send` on a live link | as `send` |
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
mod idle;
mod keepalive;
mod lease;
mod pace;
mod peers;
mod pool;
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

pub use lease::Lease;
pub use peers::PeerChoice;

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
    pub fn add_peer(&self, peer: &str, addr: &str) -> PeerChoice {
        self.inner.add_peer(peer, addr)
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
    /// successful reply of at most `rpc::INLINE_REPLY_MAX` bytes runs it
    /// there, one thread wake-up sooner; anything else as `rpc_call`.
    pub fn rpc_call_inline(&self, peer: &str, method: u32, body: &[u8], timeout: Option<std::time::Duration>, done: rpc::CallDone) -> Result<u64> {
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

    /// Hand calls of `method` (below `rpc::INLINE_METHODS`) to the server
    /// on the event thread that read them, not on `rdev-callbacks`: for a
    /// method whose `Server::call` returns within microseconds and never
    /// waits (it delays everything else that thread handles meanwhile).
    pub fn rpc_serve_inline(&self, method: u32) -> Result<()> {
        self.inner.rpc_serve_inline(method)
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

struct Events {
    node: Weak<Inner>,
    kind: TransportKind,
    /// Sender side: the token proof `sign_hello` put in the hello (the
    /// receiver's reply must answer exactly it).
    signed: Mutex<Vec<u8>>,
}

impl Events {
    fn new(node: Weak<Inner>, kind: TransportKind) -> Events {
        Events { node, kind, signed: Mutex::new(Vec::new()) }
    }

    /// The proof our hello carried (empty before `sign_hello`, or without
    /// a token).
    fn signed(&self) -> Vec<u8> {
        self.signed.lock().clone()
    }
}

impl FabricEvents for Events {
    fn sign_hello(&self, hello: &[u8], nonce: &[u8]) -> Vec<u8> {
        let Some(n) = self.node.upgrade() else { return hello.to_vec() };
        let token = &n.cfg.cluster_token;
        // Our own hello, built by `ensure_tx`: it decodes.
        let Ok(mut h) = Hello::decode(hello) else { return hello.to_vec() };
        h.proof = rendezvous::proof::hello(token, &h.task, &h.target, h.incarnation, nonce);
        *self.signed.lock() = h.proof.clone();
        h.encode()
    }

    fn on_accept(&self, conn: ConnId, hello: &[u8], nonce: &[u8]) -> Result<Vec<u8>> {
        let n = self.node.upgrade().ok_or_else(|| Error::Aborted("transport shut down".into()))?;
        {
            let mut r = n.ready.0.lock();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while !*r {
                if n.ready.1.wait_until(&mut r, deadline).timed_out() {
                    return Err(Error::Aborted("transport is not ready".into()));
                }
            }
        }
        let h = Hello::decode(hello)?;
        // Before anything about the peer is believed: a stranger stops here.
        rendezvous::proof::check_hello(&n.cfg.cluster_token, &h.task, &h.target, h.incarnation, nonce, &h.proof)?;
        if !h.target.is_empty() && h.target != n.task {
            // The sender knows this address under another name (a renamed
            // job after ClusterSpec propagation, a stale cluster): it is
            // not the peer it wants, so it goes by gRPC, which names tasks
            // its own way; on every backend alike (shm already turns every
            // refusal into NotViable, verbs carries the code).
            return Err(Error::NotViable(format!("this is {}, not {}", n.task, h.target)));
        }
        if n.routes_over_grpc(&h.task) {
            // Both ends must agree, or pushes would go to a task that pulls.
            return Err(Error::NotViable(format!(
                "{} routes {} over stock gRPC, so it does not accept pushes from it; \
                 give every task the same RDMA_DEVICE_TRANSPORTS (see rdma_device.stats()[\"peers\"] for the reason)",
                n.task, h.task
            )));
        }
        if h.rpc != n.cfg.rpc_mode {
            return Err(Error::NotViable(format!(
                "{} runs RDMA_DEVICE_MODE={}, {} runs {}: set the same mode on every task",
                h.task, mode_name(h.rpc), n.task, mode_name(n.cfg.rpc_mode)
            )));
        }
        // Admitted and added under one hold of both locks (links, then
        // the protocol state): concurrent handshakes of one task cannot
        // all pass the check (L3).
        let (admitted, refused) = {
            let mut links = n.links.lock();
            n.locked_under_links(|r| {
                r.admit_rx_link(&h.task)?;
                links.insert(conn, LinkRef::Rx(self.kind));
                r.add_rx_link(conn, &h.task, h.incarnation);
                Ok::<(), Error>(())
            })
        };
        n.fail_refused(refused);
        admitted?;
        log::info!("{}: {} connected over {} (incarnation {:#x})", n.task, h.task, self.kind.name(), h.incarnation);
        let proof = rendezvous::proof::reply(&n.cfg.cluster_token, &n.task, &h.proof);
        Ok(Hello { task: n.task.clone(), incarnation: n.incarnation, target: String::new(), rpc: n.cfg.rpc_mode, proof }.encode())
    }

    fn on_write_imm(&self, conn: ConnId, imm: u32) {
        let Some(n) = self.node.upgrade() else { return };
        let t = trace::start();
        let res = crate::error::catch_panic("handling a write", || {
            let mem = ArenaMem(&n.arena);
            let acts = n.locked(|r| r.on_write_imm(conn, imm, &mem));
            n.exec(acts);
        });
        trace::end("arrive", t, 0, 0, None);
        if let Err(e) = res {
            n.fail_link(conn, e);
        }
    }

    fn on_message(&self, conn: ConnId, msg: &[u8]) {
        let Some(n) = self.node.upgrade() else { return };
        if rendezvous::wire::is_call(msg) {
            let res = crate::error::catch_panic("handling a call", || n.on_call_msg(conn, msg)).and_then(|r| r);
            if let Err(e) = res {
                n.fail_link(conn, e);
            }
            return;
        }
        let res = crate::error::catch_panic("handling a control message", || {
            if log::log_enabled!(log::Level::Trace) {
                log::trace!("{}: recv on {conn}: {:?}", n.task, rendezvous::Msg::decode(msg));
            }
            let acts = n.locked(|r| r.on_message(conn, msg));
            n.exec(acts);
        });
        if let Err(e) = res {
            n.fail_link(conn, e);
        }
        n.notify_progress();
    }

    fn on_sender_gone(&self, conn: ConnId) {
        self.sender_gone(conn);
    }

    fn on_disconnect(&self, conn: ConnId, why: Error) {
        let Some(n) = self.node.upgrade() else { return };
        Stats::add(&Stats::global().c.peers_lost, 1);
        log::info!("{}: connection {conn} over {} ended: {why}", n.task, self.kind.name());
        n.rpc_link_lost(conn, &why);
        // Under `links` (lock order: links, then the protocol state), so a
        // connection still being registered (`ensure_tx`) either sees this
        // loss or is fully registered before it is processed.
        let (acts, refused) = {
            let mut links = n.links.lock();
            if links.remove(&conn).is_none() {
                n.ended_early.lock().insert(conn);
            }
            n.locked_under_links(|r| {
                let acts = r.on_link_lost(conn, why);
                if self.kind != TransportKind::Shm {
                    // See FabricEvents::on_sender_gone: verbs writes of a
                    // link cannot land once its disconnect is reported.
                    r.sender_gone(conn);
                }
                acts
            })
        };
        n.fail_refused(refused);
        n.exec(acts);
        n.notify_progress();
    }
}

impl Events {
    /// (Split out of the trait impl for the docs' sake.)
    fn sender_gone(&self, conn: ConnId) {
        let Some(n) = self.node.upgrade() else { return };
        log::debug!("{}: the sender of connection {conn} is gone; its slots are free", n.task);
        n.locked(|r| r.sender_gone(conn));
    }
}

/// Grants ranges placed for a sender through the listener that accepted
/// it (see `rendezvous::Granter`): runs under the protocol lock, on
/// whatever thread holds it (an event thread included); a listener's
/// `grant` never blocks (verbs posts the window bind and returns).
struct NodeGranter {
    node: Weak<Inner>,
}

impl rendezvous::Granter for NodeGranter {
    fn grant(&self, link: ConnId, off: u64, len: u64) -> Result<u32> {
        let n = self.node.upgrade().ok_or_else(|| Error::Aborted("transport shut down".into()))?;
        // Lock order: the protocol state, then `listeners` (held briefly).
        let listeners: Vec<Arc<dyn Listener>> = n.listeners.lock().values().cloned().collect();
        for l in &listeners {
            match l.grant(link, off, len) {
                Ok(Some(key)) => return Ok(key),
                Ok(None) => {}
                Err(e) => return Err(Error::Internal(format!("{}: cannot grant a slot to connection {link}: {e}", n.task))),
            }
        }
        // Not an accepted connection (any more): its Publish finds no link
        // either; nothing to do.
        Ok(0)
    }
}

struct ArenaMem<'a>(&'a Arena);

impl rendezvous::SlotMemory for ArenaMem<'_> {
    fn header(&self, offset: u64) -> [u8; HEADER_BYTES] {
        let mut h = [0u8; HEADER_BYTES];
        let at = usize::try_from(offset).unwrap_or(usize::MAX);
        if self.0.read_into(at, &mut h).is_err() {
            h = [0u8; HEADER_BYTES];
        }
        h
    }
}

impl Inner {
    /// Ends `step` here (`Node::step_done`, idle steps).
    fn step_done(&self, step: u64) {
        self.fail_queued(|s| s == step, &|| Error::Aborted(format!("step {step} finished before this tensor was sent")));
        let acts = self.locked(|r| r.step_done(step));
        self.exec(acts);
    }

    /// Ends the steps idle for `IDLE_STEP_LINGER_MS` (`rdev-keepalive`).
    /// `scratch` is kept from call to call: nothing is allocated.
    pub(super) fn end_idle_steps(&self, now: std::time::Instant, scratch: &mut Vec<u64>) {
        scratch.clear();
        let linger = std::time::Duration::from_millis(crate::constants::IDLE_STEP_LINGER_MS);
        self.idle.lock().expired(now, linger, scratch);
        for &step in scratch.iter() {
            log::debug!("{}: step {step} idle for {linger:?}: it ends", self.task);
            self.step_done(step);
        }
    }

    fn notify_progress(&self) {
        *self.progress.0.lock() += 1;
        self.progress.1.notify_all();
    }

    /// Wait until `notify_progress` runs or `until` passes.
    fn wait_progress(&self, seen: u64, until: std::time::Instant) -> u64 {
        let mut g = self.progress.0.lock();
        if *g == seen {
            self.progress.1.wait_until(&mut g, until);
        }
        *g
    }

    /// Run `f` on the protocol state, mirroring its counters into Stats;
    /// then fail the links whose grant `f` refused (which takes `links`:
    /// never call it with `links` held, see `locked_under_links`).
    fn locked<T>(&self, f: impl FnOnce(&mut Rendezvous) -> T) -> T {
        let (out, refused) = self.locked_under_links(f);
        self.fail_refused(refused);
        out
    }

    /// Fail the links `locked_under_links` returned (not under `links`).
    fn fail_refused(&self, refused: Vec<(ConnId, Error)>) {
        for (link, why) in refused {
            self.fail_link(link, why);
        }
    }

    /// `locked` for a caller that holds `links` (lock order: `links`, then
    /// the protocol state): the links whose grant `f` refused are returned
    /// for it to fail with `fail_refused` once it let go of `links`
    /// (failing one takes `links`: that would be a self-deadlock).
    fn locked_under_links<T>(&self, f: impl FnOnce(&mut Rendezvous) -> T) -> (T, Vec<(ConnId, Error)>) {
        let mut r = self.rdv.lock();
        // Others wait on this lock: a grant made in `f` must not pin
        // memory here (verbs registers on its setup thread instead).
        let no_blocking = fabric::no_blocking();
        let out = f(&mut r);
        drop(no_blocking);
        // Grants happened inside `f` (the `NodeGranter`); the links whose
        // grant failed are failed below, outside the lock.
        let refused = r.take_refused();
        let t = std::mem::take(&mut r.tally);
        let in_use = r.arena_in_use();
        drop(r);
        if t != rendezvous::Tally::default() {
            self.totals.lock().add(&t);
        }
        let c = &Stats::global().c;
        c.add_tally(&t);
        c.arena_bytes_in_use.store(in_use, std::sync::atomic::Ordering::Relaxed);
        (out, refused.into_iter().collect())
    }

    fn endpoint(&self, link: ConnId) -> Option<Arc<dyn Endpoint>> {
        match self.links.lock().get(&link) {
            Some(LinkRef::Tx(e)) => Some(e.clone()),
            _ => None,
        }
    }

    fn send_msg(&self, link: ConnId, msg: &rendezvous::Msg) -> Result<()> {
        self.send_msg_as(link, msg, false)
    }

    /// Messages queued on `link` that wait for its peer (0 where the
    /// backend does not count them, or the link is gone).
    fn link_backlog(&self, link: ConnId) -> usize {
        let target = match self.links.lock().get(&link) {
            Some(LinkRef::Tx(e)) => Ok(e.clone()),
            Some(LinkRef::Rx(k)) => Err(*k),
            None => return 0,
        };
        match target {
            Ok(e) => e.backlog(),
            Err(kind) => self.listeners.lock().get(&kind).cloned().map_or(0, |l| l.backlog(link)),
        }
    }

    /// `send_msg`; with `post`, no I/O on this thread (see
    /// `Listener::post_msg`).
    fn send_msg_as(&self, link: ConnId, msg: &rendezvous::Msg, post: bool) -> Result<()> {
        msg.check()?;
        let bytes = msg.encode();
        let target = match self.links.lock().get(&link) {
            Some(LinkRef::Tx(e)) => Ok(e.clone()),
            Some(LinkRef::Rx(k)) => Err(*k),
            None => return Err(Error::PeerLost(format!("connection {link} is closed"))),
        };
        match (target, post) {
            (Ok(e), false) => e.send_msg(&bytes),
            (Ok(e), true) => e.post_msg(&bytes),
            (Err(kind), post) => {
                let l = self.listeners.lock().get(&kind).cloned();
                let l = l.ok_or_else(|| Error::PeerLost("listener closed".into()))?;
                if post {
                    l.post_msg(link, &bytes)
                } else {
                    l.send_msg(link, &bytes)
                }
            }
        }
    }

    /// Carry out protocol actions (never called with the state locked).
    fn exec(&self, acts: Actions) {
        self.exec_as(acts, false)
    }

    /// `exec` for a thread that must do no I/O (a received tensor's
    /// release on a TensorFlow thread): its control messages are posted.
    fn exec_posting(&self, acts: Actions) {
        self.exec_as(acts, true)
    }

    fn exec_as(&self, acts: Actions, post: bool) {
        let on_event_thread = fabric::on_event_thread();
        for a in acts {
            // Stream chunk writes and slot copies go to the rdev-stream pool
            // themselves; a message-borne chunk is copied here, so it moves.
            let copies = matches!(a, Action::SendChunk { .. } | Action::CopyChunk { src: rendezvous::ChunkSrc::Bytes(_), .. });
            // A receive whose completion only wakes a waiting thread
            // (`Complete::runs_anywhere`), or whose callback the
            // application declared fit for an event thread
            // (`rdev_recv_inline`, on success), is delivered here: one
            // thread wake-up less between the tensor landing and its user.
            let waiter = matches!(&a, Action::Deliver { done, result } if done.runs_anywhere() || (result.is_ok() && done.inline_ok()));
            if on_event_thread
                && !waiter
                && (copies || matches!(a, Action::Write { .. } | Action::Deliver { .. } | Action::SendDone { .. } | Action::StreamAlloc { .. }))
            {
                // Not on a backend's event thread: see handoff.rs.
                self.handoff.run(a);
                continue;
            }
            match a {
                Action::Write { link, offset, key, header, payload, imm, done, bytes: _ } => {
                    let Some(ep) = self.endpoint(link) else {
                        payload.release();
                        done.complete(Err(Error::PeerLost(format!("connection {link} is closed"))));
                        let acts = self.locked(|r| r.write_done(link));
                        self.exec(acts);
                        continue;
                    };
                    let (step, bytes) = (header.step, header.len);
                    let op = write::TensorWrite::new(header.encode(), payload, write::Then::Send(done), self.me.clone(), link);
                    if bytes as usize >= crate::constants::WRITE_ENGINE_MIN {
                        // Posted, as to a NIC: this (TensorFlow's) thread
                        // returns; the copy runs on rdev-write.
                        self.engine.post(ep, offset, key, imm, op, step, bytes);
                    } else {
                        let t = trace::start();
                        ep.write(offset, key, imm, op);
                        trace::end("write", t, step, bytes, None);
                    }
                }
                Action::WriteChunk { link, stream, offset, key, header, payload, imm } => self.write_chunk(link, stream, offset, key, header, payload, imm),
                Action::SendChunk { link, stream, offset, payload } => self.send_chunk(link, stream, offset, payload),
                Action::StreamAlloc { link, stream, total } => self.stream_alloc(link, stream, total),
                Action::CopyChunk { link, stream, src, len, dst, at } => self.copy_chunk(link, stream, src, len, dst, at),
                Action::Send { link, msg } => {
                    log::trace!("{}: send on {link}: {msg:?}", self.task);
                    let t = trace::start();
                    let sent = self.send_msg_as(link, &msg, post);
                    trace::end(msg.name(), t, 0, 0, None);
                    if let Err(e) = sent {
                        // A lost Publish or Credit would stall the edge
                        // forever: the link is unusable, fail it now.
                        let why = Error::PeerLost(format!("{}: control message {} on connection {link} not sent: {}", self.task, msg.name(), e.message()));
                        self.fail_link(link, why);
                    }
                }
                Action::Close { link, why } => self.fail_link(link, why),
                Action::SendDone { done, result } => done.complete(result),
                Action::Deliver { done, result } => {
                    let (t, bytes) = (trace::start(), result.as_ref().map_or(0, |r| match &r.data {
                        Data::Slot { len, .. } => *len,
                        Data::Owned(v) => v.len() as u64,
                    }));
                    done.complete(result);
                    trace::end("deliver", t, 0, bytes, None);
                }
                Action::Release { link, slot, gen } => {
                    let acts = self.locked(|r| r.release(link, slot, gen));
                    self.exec_as(acts, post);
                }
                Action::PlaceFor { link, req, receiver, key, bytes } => self.place_for(link, req, receiver, key, bytes),
                Action::PlaceDone { req, outcome, error } => self.placement_answered(req, outcome, error),
            }
        }
    }

    /// Close `link` and fail everything that depends on it with `why` now
    /// (the transport's own disconnect event may come later, with a less
    /// telling reason, and then finds nothing left to fail).
    fn fail_link(&self, link: ConnId, why: Error) {
        log::warn!("{}: closing connection {link}: {why}", self.task);
        let l = self.links.lock().get(&link).map(|l| match l {
            LinkRef::Tx(e) => Ok(e.clone()),
            LinkRef::Rx(k) => Err(*k),
        });
        match l {
            Some(Ok(e)) => e.close(),
            Some(Err(k)) => {
                // Looked up first: `listeners` is not held across the call.
                let l = self.listeners.lock().get(&k).cloned();
                if let Some(l) = l {
                    l.close_conn(link);
                }
            }
            None => {}
        }
        self.rpc_link_lost(link, &why);
        let acts = self.locked(|r| r.on_link_lost(link, why));
        self.exec(acts);
        self.notify_progress();
    }

    fn lease(&self, r: Received) -> Lease {
        let (ptr, len, arena) = match &r.data {
            Data::Slot { offset, len, .. } => {
                // The protocol only hands out ranges inside the arena it was
                // sized for; check anyway, since the bytes reach TensorFlow.
                let ok = (*offset as usize).checked_add(*len as usize).is_some_and(|e| e <= self.arena.len());
                if ok {
                    (self.arena.as_ptr().wrapping_add(*offset as usize) as *const u8, *len as usize, Some(self.arena.clone()))
                } else {
                    (std::ptr::null(), 0, None)
                }
            }
            Data::Owned(v) => (v.as_ptr(), v.len(), None),
        };
        Lease::new(self.me.clone(), arena, r.meta, r.data, ptr, len)
    }
}
