//! Peers: which transport serves each, the sender-side connection to it
//! (made on first use), and watching a peer we only receive from.
//!
//! Threads and waits (see the crate docs for the whole list):
//! - `send` never blocks: with a live connection it queues the write; without
//!   one it queues the tensor on the peer and returns, and a thread of the
//!   bounded `rdev-connect` pool (`pool.rs`; one connect per peer at a time)
//!   connects (bounded by RDMA_DEVICE_CONNECT_TIMEOUT_MS) and then sends or
//!   fails what queued up. Sends to one peer are not kept
//!   in order across a connect (a send issued as the queue is flushed may
//!   go first): tensors are matched by (key, step), never by order;
//! - `connect`, `place_ahead` and `request_placement` block their caller up
//!   to the connect timeout plus the given timeout (the shim calls them from
//!   its own pool only). One thread connects to a peer at a time, holding
//!   no lock while it does; the others wait on the slot's condvar, each up
//!   to its own deadline (a placement's timeout), never behind a mutex;
//! - `recv` never blocks; a peer we only receive from is watched from the
//!   `rdev-connect` pool (one watch per peer at a time);
//! - placements (`place_ahead`, `place_for`) are in placing.rs.
//!
//! A peer's route (which transport, or gRPC) is chosen in routes.rs; sends
//! to a peer whose route is still pending queue here, as behind a connect.
//! A peer that does not run this transport (nothing listens for it on first
//! contact, or it refuses our hello because it routes us over gRPC) is
//! demoted to gRPC for good: queued sends and waiting receives fail with
//! `NotViable`, which the shim turns into a stock gRPC transfer (or with
//! `Strict` in strict mode: routes.rs), at once rather than after a timeout.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::routes::Route;
use super::{mode_name, Events, Inner, LeaseDone, LinkRef};
use crate::error::{Error, Result};
use crate::fabric::{ConnId, Endpoint, FabricEvents};
use crate::rendezvous::{Hello, Payload, SendDone, TensorMeta};
use crate::stats::Stats;


/// How long to try reaching a peer whose connection broke before its
/// receives and sends fail: long enough for a restarted task that is
/// already up, short enough that a dead one fails a step well within 5 s.
const LOST_PEER_GRACE: Duration = Duration::from_millis(1500);

/// The sender-side connection to a peer, once made, and whether a thread
/// is making it. No lock is held while connecting: one thread connects,
/// the others for the same peer wait on `made`, each up to its own
/// deadline.
#[derive(Default)]
struct TxSlot {
    state: Mutex<TxState>,
    made: parking_lot::Condvar,
}

#[derive(Default)]
struct TxState {
    link: Option<(ConnId, Arc<dyn Endpoint>)>,
    connecting: bool,
}

/// Ends a connect attempt however `ensure_tx` returns (an error, a
/// panic): the slot is free again and the waiters look.
struct Connecting<'a>(&'a TxSlot);

impl Drop for Connecting<'_> {
    fn drop(&mut self) {
        self.0.state.lock().connecting = false;
        self.0.made.notify_all();
    }
}

/// A send waiting for its peer's route or connection.
pub(super) struct QueuedSend {
    key: String,
    step: u64,
    meta: TensorMeta,
    payload: Box<dyn Payload>,
    pub(super) done: SendDone,
}

pub(super) struct PeerEntry {
    pub(super) addr: String,
    pub(super) route: Route,
    /// What waited for a pending route has been failed (routes.rs).
    pub(super) expired: bool,
    /// The sender-side connection (one connect at a time per peer).
    tx: Arc<TxSlot>,
    watching: bool,
    /// The sender connection once made (may have died since: check
    /// `links`); read without touching the slot's connect lock.
    live: Option<ConnId>,
    /// A `rdev-connect` thread is connecting; sends queue in `queued`.
    pub(super) connecting: bool,
    /// Sends waiting for the route (pending) or the connection.
    pub(super) queued: Vec<QueuedSend>,
}

impl PeerEntry {
    fn new(addr: &str, route: Route) -> PeerEntry {
        PeerEntry { addr: addr.to_string(), route, expired: false, tx: Arc::default(), watching: false, live: None, connecting: false, queued: Vec::new() }
    }

}

impl Peers {
    /// Record `peer` at `addr` with the pending `route`: a new peer, or
    /// (unless `only_if_moved` and the address is the same) a known one.
    /// Returns whether it was recorded.
    pub(super) fn pend(&self, peer: &str, addr: &str, route: Route, only_if_moved: bool) -> bool {
        let mut t = self.table.lock();
        match t.get_mut(peer) {
            Some(e) if only_if_moved && e.addr == addr => false,
            Some(e) => {
                e.addr = addr.to_string();
                e.route = route;
                e.expired = false;
                true
            }
            None => {
                t.insert(peer.to_string(), PeerEntry::new(addr, route));
                true
            }
        }
    }
}

#[derive(Default)]
pub(super) struct Peers {
    pub(super) table: Mutex<HashMap<String, PeerEntry>>,
    /// Notified whenever a peer is added or its route chosen (see
    /// `wait_for_peer`, `ensure_tx`).
    pub(super) added: parking_lot::Condvar,
}


impl Inner {
    /// The live sender connection to `peer`, connecting if needed. While
    /// another thread connects to `peer`, wait for it until `deadline`
    /// (`None`: the connect timeout from now), never holding a lock.
    ///
    /// A peer not yet known, or whose route is still being chosen, is
    /// waited for within the same deadline (tasks learn of each other as
    /// they start: a placement may come first).
    pub(super) fn ensure_tx(&self, peer: &str, deadline: Option<std::time::Instant>) -> Result<ConnId> {
        let deadline = deadline.unwrap_or_else(|| std::time::Instant::now() + Duration::from_millis(self.cfg.connect_timeout_ms));
        let (addr, kind, slot) = {
            let mut t = self.peers.table.lock();
            loop {
                let pending_since = match t.get(peer) {
                    None => None,
                    Some(e) => match &e.route {
                        Route::Device(kind) => break (e.addr.clone(), *kind, e.tx.clone()),
                        Route::Grpc(_) => {
                            drop(t);
                            return Err(self.grpc_route(peer));
                        }
                        Route::Pending { deadline: d, .. } => Some(*d),
                    },
                };
                if pending_since.is_some_and(|d| std::time::Instant::now() >= d) {
                    return Err(super::routes::route_timeout(peer));
                }
                if self.peers.added.wait_until(&mut t, deadline).timed_out() {
                    return Err(match t.get(peer) {
                        None => Error::InvalidArgument(format!("{}: unknown peer {peer}: it was not added (add_peer) in time", self.task)),
                        Some(_) => Error::Timeout(format!("{}: the route to {peer} is still being chosen (resolving its name, probing RDMA)", self.task)),
                    });
                }
            }
        };
        {
            let mut st = slot.state.lock();
            loop {
                if let Some((id, _)) = st.link.as_ref() {
                    if self.links.lock().contains_key(id) {
                        return Ok(*id);
                    }
                }
                if !st.connecting {
                    st.connecting = true;
                    break;
                }
                if slot.made.wait_until(&mut st, deadline).timed_out() {
                    return Err(Error::Timeout(format!("{}: another thread is still connecting to {peer} at {addr}", self.task)));
                }
            }
        }
        let _connecting = Connecting(&slot);
        let f = self
            .fabrics
            .iter()
            .find(|f| f.kind() == kind)
            .ok_or_else(|| Error::Internal(format!("{} backend missing", kind.name())))?;
        let token = &self.cfg.cluster_token;
        // The proof is added by `Events::sign_hello`, over the receiver's
        // nonce for this connection.
        let hello = Hello { task: self.task.clone(), incarnation: self.incarnation, target: peer.to_string(), rpc: self.cfg.rpc_mode, proof: Vec::new() }.encode();
        let signer = Arc::new(Events::new(self.me.clone(), kind));
        let events: Arc<dyn FabricEvents> = signer.clone();
        // A peer we were connected to and lost gets a short grace: if it has
        // restarted we reach its new life; if it is dead we fail soon rather
        // than after the start-up grace period.
        //
        // On first contact nobody listening is final: a task's listener is
        // up before its gRPC server serves anything (the shim starts it in
        // server Init), so a peer that TF already talks to and that does
        // not listen does not run this transport.
        let lost = self.locked(|r| r.is_lost(peer));
        let timeout = if lost {
            Duration::from_millis(self.cfg.connect_timeout_ms).min(LOST_PEER_GRACE)
        } else {
            Duration::from_millis(self.cfg.connect_timeout_ms)
        };
        let connected = f.connect(&addr, &hello, events, timeout, lost).and_then(|ep| match Hello::decode(ep.peer_hello()) {
            Ok(reply) if reply.task == peer && reply.rpc == self.cfg.rpc_mode => {
                match crate::rendezvous::proof::check_reply(token, &reply.task, &signer.signed(), &reply.proof) {
                    Ok(()) => Ok(ep),
                    Err(e) => {
                        ep.close();
                        Err(e)
                    }
                }
            }
            Ok(reply) if reply.task == peer => {
                ep.close();
                Err(Error::NotViable(format!(
                    "{peer} runs RDMA_DEVICE_MODE={}, this task {}: set the same mode on every task",
                    mode_name(reply.rpc),
                    mode_name(self.cfg.rpc_mode)
                )))
            }
            Ok(reply) => {
                ep.close();
                Err(Error::NotViable(format!("{addr} is {}, not {peer}", reply.task)))
            }
            Err(e) => {
                ep.close();
                Err(e)
            }
        });
        let ep = match connected {
            Ok(ep) => ep,
            Err(Error::NotViable(why)) => {
                return Err(self.demote(peer, &format!("{peer} at {addr} does not take this transport from {}: {why}", self.task)));
            }
            Err(e) => return Err(e.context(&format!("connecting to {peer} at {addr}"))),
        };
        let id = ep.id();
        let refused = {
            // Register before any event for the link is processed: its
            // disconnect may already have fired (see `on_disconnect`).
            let mut links = self.links.lock();
            if self.ended_early.lock().remove(&id) {
                return Err(Error::PeerLost(format!("connection to {peer} at {addr} ended as it was made")));
            }
            links.insert(id, LinkRef::Tx(ep.clone()));
            self.locked_under_links(|r| r.add_tx_link(id, peer)).1
        };
        self.fail_refused(refused);
        if self.cfg.rpc_mode {
            // The receiver sends its requests on this link once it is up.
            self.exec(crate::rendezvous::smallvec![crate::rendezvous::Action::Send { link: id, msg: crate::rendezvous::Msg::Ready }]);
        }
        slot.state.lock().link = Some((id, ep));
        if let Some(e) = self.peers.table.lock().get_mut(peer) {
            e.live = Some(id);
        }
        log::info!("{}: connected to {peer} at {addr} over {}", self.task, kind.name());
        Ok(id)
    }

    pub(super) fn connect(&self, peer: &str) -> Result<()> {
        self.ensure_tx(peer, None).map(|_| ())
    }

    /// The error for a peer routed over gRPC (routes.rs: `over_grpc`).
    fn grpc_route(&self, peer: &str) -> Error {
        let why = match self.peers.table.lock().get(peer).map(|e| &e.route) {
            Some(Route::Grpc(why)) if !why.is_empty() => format!("{peer} goes over stock gRPC: {why}"),
            _ => format!("no transport serves {peer}"),
        };
        self.over_grpc(peer, &why)
    }

    /// `peer` does not run this transport with us: route it over gRPC from
    /// now on, and fail its queued sends and waiting receives (NotViable,
    /// which the shim turns into a gRPC transfer). Returns the error.
    fn demote(&self, peer: &str, why: &str) -> Error {
        log::warn!("{}: {why}; its tensors go over stock gRPC", self.task);
        let err = self.over_grpc(peer, why);
        if let Some(e) = self.peers.table.lock().get_mut(peer) {
            e.route = Route::Grpc(why.to_string());
        }
        Stats::global().set_peer(peer, &format!("grpc ({why})"));
        let acts = self.locked(|r| r.peer_unreachable(peer, err.clone()));
        self.exec(acts);
        err
    }

    /// The live sender connection to `peer`, if any (none while its route
    /// is pending or a connect runs: sends queue); NotViable (or Strict)
    /// when the peer is routed over gRPC, Timeout when its route is
    /// pending past its deadline.
    fn live_tx(&self, peer: &str) -> Result<Option<ConnId>> {
        let live = {
            let t = self.peers.table.lock();
            let e = t.get(peer).ok_or_else(|| Error::InvalidArgument(format!("unknown peer {peer}: add it first")))?;
            match e.route {
                Route::Grpc(_) => {
                    drop(t);
                    return Err(self.grpc_route(peer));
                }
                Route::Pending { deadline, .. } if std::time::Instant::now() >= deadline => {
                    return Err(super::routes::route_timeout(peer));
                }
                Route::Pending { .. } => None,
                // While a connect runs, sends queue behind the ones waiting.
                Route::Device(_) if e.connecting => None,
                Route::Device(_) => e.live,
            }
        };
        Ok(live.filter(|id| self.links.lock().contains_key(id)))
    }

    /// Never blocks (module docs). Errors returned here mean nothing was
    /// queued; later failures (including NotViable) go to `done`.
    pub(super) fn send(&self, peer: &str, key: &str, step: u64, meta: TensorMeta, payload: Box<dyn Payload>, done: SendDone) -> Result<()> {
        if key.len() > crate::rendezvous::wire::MAX_KEY {
            return Err(Error::InvalidArgument(format!("rendezvous key of {} bytes exceeds {}", key.len(), crate::rendezvous::wire::MAX_KEY)));
        }
        if let Some(link) = self.live_tx(peer)? {
            let acts = self.locked(|r| r.send(link, key, step, meta, payload, done));
            self.exec(acts);
            return Ok(());
        }
        let spawn = {
            let mut t = self.peers.table.lock();
            let e = t.get_mut(peer).ok_or_else(|| Error::InvalidArgument(format!("unknown peer {peer}: add it first")))?;
            if e.queued.try_reserve(1).is_err() {
                return Err(Error::ResourceExhausted(format!("queue of sends to {peer}")));
            }
            e.queued.push(QueuedSend { key: key.to_string(), step, meta, payload, done });
            // A pending route starts the connect once chosen (routes.rs).
            matches!(e.route, Route::Device(_)) && !std::mem::replace(&mut e.connecting, true)
        };
        if spawn {
            let me = self.me.clone();
            let name = peer.to_string();
            super::pool::CONNECT.schedule(move || {
                if let Some(n) = me.upgrade() {
                    n.connect_and_flush(&name);
                }
            });
        }
        Ok(())
    }

    /// Fail the sends queued while connecting whose step matches `pred`
    /// (an aborted step, or every step when the node shuts down), now
    /// rather than when the connect ends.
    pub(super) fn fail_queued(&self, pred: impl Fn(u64) -> bool, why: &dyn Fn() -> Error) {
        // The error is built only when a send fails (ending a step is
        // frequent; failing one is not).
        let failed: Vec<QueuedSend> = {
            let mut t = self.peers.table.lock();
            let mut out = Vec::new();
            for e in t.values_mut() {
                if e.queued.iter().any(|q| pred(q.step)) {
                    let (fail, keep): (Vec<QueuedSend>, Vec<QueuedSend>) = std::mem::take(&mut e.queued).into_iter().partition(|q| pred(q.step));
                    e.queued = keep;
                    out.extend(fail);
                }
            }
            out
        };
        if failed.is_empty() {
            return;
        }
        let why = why();
        for q in failed {
            q.done.complete(Err(why.clone()));
        }
    }

    /// On `rdev-connect`: connect to `peer`, then send or fail what queued.
    pub(super) fn connect_and_flush(&self, peer: &str) {
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.ensure_tx(peer, None)))
            .unwrap_or_else(|_| Err(Error::Internal(format!("connecting to {peer} panicked"))));
        let queued = {
            let mut t = self.peers.table.lock();
            match t.get_mut(peer) {
                Some(e) => {
                    e.connecting = false;
                    std::mem::take(&mut e.queued)
                }
                None => Vec::new(),
            }
        };
        for q in queued {
            match &res {
                Ok(link) => {
                    let acts = self.locked(|r| r.send(*link, &q.key, q.step, q.meta, q.payload, q.done));
                    self.exec(acts);
                }
                Err(e) => q.done.complete(Err(e.clone())),
            }
        }
    }

    /// Does this task route `peer` over stock gRPC (known, no transport)?
    pub(super) fn routes_over_grpc(&self, peer: &str) -> bool {
        self.peers.table.lock().get(peer).is_some_and(|e| matches!(e.route, Route::Grpc(_)))
    }

    /// Never blocks. A receive from a peer whose route is pending waits as
    /// any other (the peer may push before our own choice is made).
    pub(super) fn recv(&self, peer: &str, key: &str, step: u64, done: LeaseDone) {
        let route = self.peers.table.lock().get(peer).map(|e| e.route.clone());
        match route {
            Some(Route::Grpc(_)) => return done.complete(Err(self.grpc_route(peer))),
            Some(Route::Pending { deadline, .. }) if std::time::Instant::now() >= deadline => {
                return done.complete(Err(super::routes::route_timeout(peer)));
            }
            _ => {}
        }
        let wrapped = TO_LEASE.boxed(ToLease { node: self.me.clone(), done: Some(done) });
        let (acts, connected) = self.locked(|r| {
            let a = r.recv(peer, key, step, wrapped);
            (a, r.peer_connected(peer))
        });
        self.exec(acts);
        if !connected {
            self.watch(peer);
        }
    }

    /// We wait on `peer` but have no connection with it: connect as a
    /// sender in the background, so that its death (or absence) reaches
    /// our waiters as an error instead of a hang.
    pub(super) fn watch(&self, peer: &str) {
        {
            let mut t = self.peers.table.lock();
            match t.get_mut(peer) {
                Some(e) if !e.watching && matches!(e.route, Route::Device(_)) => e.watching = true,
                _ => return,
            }
        }
        let me = self.me.clone();
        let peer = peer.to_string();
        super::pool::CONNECT.schedule(move || {
            let Some(n) = me.upgrade() else { return };
            let res = crate::error::catch_panic("rdev-watch", || n.ensure_tx(&peer, None)).and_then(|r| r);
            if let Some(e) = n.peers.table.lock().get_mut(&peer) {
                e.watching = false;
            }
            match res {
                // demote() already failed the waiters, with NotViable.
                Ok(_) | Err(Error::NotViable(_)) => {}
                Err(e) => {
                    log::warn!("{}: {peer} is unreachable: {e}", n.task);
                    let acts = n.locked(|r| r.peer_unreachable(&peer, Error::PeerLost(e.to_string())));
                    n.exec(acts);
                }
            }
        });
    }

    pub(super) fn close_peer(&self, peer: &str) {
        let links = self.locked(|r| r.links_of(peer));
        let acts = links
            .into_iter()
            .map(|link| crate::rendezvous::Action::Close { link, why: Error::Aborted(format!("connection to {peer} aborted")) })
            .collect();
        self.exec(acts);
    }
}

/// A receive's completion in the protocol's terms (`Received`) turned
/// into the caller's (`Lease`); recycled, so a receive allocates nothing.
struct ToLease {
    node: std::sync::Weak<Inner>,
    /// `None` only while the box waits in `TO_LEASE`.
    done: Option<LeaseDone>,
}

static TO_LEASE: crate::completion::Recycler<ToLease> = crate::completion::Recycler::new(crate::completion::KEPT);

impl crate::completion::Complete<Result<crate::rendezvous::Received>> for ToLease {
    fn runs_anywhere(&self) -> bool {
        self.done.as_ref().is_some_and(|d| d.runs_anywhere())
    }

    fn event_thread_ok(&self) -> bool {
        self.done.as_ref().is_some_and(|d| d.event_thread_ok())
    }

    fn complete(mut self: Box<Self>, res: Result<crate::rendezvous::Received>) {
        let node = std::mem::take(&mut self.node);
        let done = self.done.take();
        TO_LEASE.recycle(self);
        let Some(done) = done else { return };
        match (res, node.upgrade()) {
            (Ok(r), Some(n)) => done.complete(Ok(n.lease(r))),
            (Ok(_), None) => done.complete(Err(Error::Aborted("transport shut down".into()))),
            (Err(e), _) => done.complete(Err(e)),
        }
    }
}
