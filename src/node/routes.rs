//! Routes: how tensors with each peer travel, and the one place strict
//! mode is applied.
//!
//! A peer's route is one of three states ([`Route`]):
//! - **pending** while it is being chosen. `set_peer` records a peer that is
//!   new (or moved) and hands the choice (name resolution, an rdma_cm probe:
//!   `Fabric::reaches`) to the `rdev-route` pool, every peer at once, never
//!   on the caller's thread. Meanwhile sends queue on the peer (the queue of
//!   sends waiting for a connect, peers.rs), receives wait as usual, and a
//!   connect (so a placement) waits for the choice within its own deadline.
//!   What still waits `ROUTE_WAIT_MS` after the choice began fails with a
//!   timeout (the keepalive tick, at most a second late), and so does later
//!   work, until the choice is made;
//! - **a transport** (shm, verbs) once chosen;
//! - **gRPC**, with the reason, when no transport serves the peer, or when
//!   it turned out not to take this transport from us (demoted for good,
//!   peers.rs).
//!
//! Every error that means "this tensor would go over stock gRPC" is made by
//! [`Inner::over_grpc`]: `NotViable` (the caller takes the stock path), or,
//! with RDMA_DEVICE_STRICT, `Strict` (the caller fails). The shim keeps no
//! route, flag or demotion of its own: it asks (`rdev_route`), and takes the
//! stock path on `RDEV_NOT_VIABLE`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::Inner;
use crate::error::{Error, Result};
use crate::fabric::TransportKind;
use crate::stats::Stats;

/// How long work may wait for a route still being chosen: a choice resolves
/// the peer's name (the resolver's own timeouts: 5 s a try by default) and
/// may probe it (rdma_cm: up to 500 ms), and may queue behind other choices.
pub const ROUTE_WAIT_MS: u64 = 20_000;

/// How tensors with one peer travel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// Being chosen on `rdev-route`; work waits until `deadline`.
    Pending { deadline: Instant, generation: u64 },
    /// Over this transport.
    Device(TransportKind),
    /// Over stock gRPC, for this reason.
    Grpc(String),
}

/// The transport chosen for a peer, or why there is none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerChoice {
    pub transport: Option<TransportKind>,
    pub reason: String,
}

/// A route as a caller sees it now (`Inner::route`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteNow {
    /// Still being chosen: work for the peer waits in the transport.
    Pending,
    Device(TransportKind),
    /// Over stock gRPC (never in strict mode: that is an `Error::Strict`).
    Grpc(String),
}

/// Tells one choice from a later one for the same peer (the peer moved).
static GENERATION: AtomicU64 = AtomicU64::new(1);

impl Inner {
    /// The error for a tensor with `peer` that would go over stock gRPC
    /// because of `why`: `NotViable`, or `Strict` with RDMA_DEVICE_STRICT.
    pub(super) fn over_grpc(&self, peer: &str, why: &str) -> Error {
        if self.cfg.strict {
            strict_refusal(peer, why)
        } else {
            Error::NotViable(why.to_string())
        }
    }

    /// Whether a tensor with `peer` may go over stock gRPC because of `why`
    /// (decided by the caller, e.g. a chunk in device memory): Ok, or the
    /// strict-mode error.
    pub(super) fn grpc_fallback(&self, peer: &str, why: &str) -> Result<()> {
        match self.over_grpc(peer, why) {
            e @ Error::Strict(_) => Err(e),
            _ => Ok(()),
        }
    }

    /// Record `peer` at `addr`. A new peer, or one at a new address, gets a
    /// pending route whose choice starts on `rdev-route`; the same address
    /// again changes nothing. Never blocks. Returns whether a choice began.
    pub(super) fn set_peer(&self, peer: &str, addr: &str) -> bool {
        if peer == self.task {
            return false;
        }
        let generation = GENERATION.fetch_add(1, Ordering::Relaxed);
        let route = Route::Pending { deadline: Instant::now() + Duration::from_millis(ROUTE_WAIT_MS), generation };
        if !self.peers.pend(peer, addr, route, true) {
            return false;
        }
        let me = self.me.clone();
        let (peer, addr) = (peer.to_string(), addr.to_string());
        super::pool::ROUTE.schedule(move || {
            let Some(n) = me.upgrade() else { return };
            let choice = crate::error::catch_panic("choosing a route", || n.choose(&addr)).unwrap_or_else(|e| PeerChoice {
                transport: None,
                reason: format!("choosing the route failed: {e}"),
            });
            n.record_route(&peer, &addr, generation, &choice);
        });
        true
    }

    /// Learn of `peer` at `addr` and choose its route on this thread (it
    /// may resolve a name and probe: the endpoint API and tests).
    pub(super) fn add_peer(&self, peer: &str, addr: &str) -> PeerChoice {
        let generation = GENERATION.fetch_add(1, Ordering::Relaxed);
        let route = Route::Pending { deadline: Instant::now() + Duration::from_millis(ROUTE_WAIT_MS), generation };
        self.peers.pend(peer, addr, route, false);
        let choice = self.choose(addr);
        self.record_route(peer, addr, generation, &choice);
        choice
    }

    /// Which transport reaches `addr`, or why none does.
    fn choose(&self, addr: &str) -> PeerChoice {
        let mut reasons = Vec::new();
        let mut choice = None;
        // Not under `listeners`: `reaches` resolves names and may probe
        // (rdma_cm), and the routes of many peers are chosen at once.
        let listening: Vec<TransportKind> = self.listeners.lock().keys().copied().collect();
        for f in &self.fabrics {
            let name = f.kind().name();
            if !listening.contains(&f.kind()) {
                let why = f.is_viable().err().map(|e| e.message().to_string()).unwrap_or_else(|| "not listening".into());
                reasons.push(format!("{name}: {why}"));
                continue;
            }
            match f.reaches(addr) {
                Ok(()) => {
                    choice = Some(f.kind());
                    break;
                }
                Err(e) => reasons.push(format!("{name}: {}", e.message())),
            }
        }
        if self.cfg.transports.is_empty() {
            reasons.push("RDMA_DEVICE_TRANSPORTS is empty".into());
        }
        if !crate::fabric::VERBS_BUILT && self.cfg.allows("verbs") && choice.is_none() {
            reasons.push("verbs: this build has no verbs support".into());
        }
        PeerChoice { transport: choice, reason: reasons.join("; ") }
    }

    /// The choice for `peer` at `addr` (made as `generation`) is in: record
    /// it unless the peer has moved since, then start what waited for it
    /// (queued sends connect, or fail when the route is gRPC, as do the
    /// receives waiting on the peer).
    fn record_route(&self, peer: &str, addr: &str, generation: u64, choice: &PeerChoice) {
        let (connect, failed) = {
            let mut t = self.peers.table.lock();
            let Some(e) = t.get_mut(peer) else { return };
            let current = e.addr == addr && matches!(e.route, Route::Pending { generation: g, .. } if g == generation);
            if !current {
                return; // moved: a newer choice follows
            }
            match choice.transport {
                Some(kind) => {
                    e.route = Route::Device(kind);
                    let connect = !e.queued.is_empty() && !std::mem::replace(&mut e.connecting, true);
                    (connect, Vec::new())
                }
                None => {
                    e.route = Route::Grpc(choice.reason.clone());
                    (false, std::mem::take(&mut e.queued))
                }
            }
        };
        self.peers.added.notify_all();
        match choice.transport {
            Some(kind) => {
                log::debug!("{}: {peer} ({addr}) over {}", self.task, kind.name());
                Stats::global().set_peer(peer, kind.name());
                if connect {
                    let me = self.me.clone();
                    let name = peer.to_string();
                    super::pool::CONNECT.schedule(move || {
                        if let Some(n) = me.upgrade() {
                            n.connect_and_flush(&name);
                        }
                    });
                }
                if self.locked(|r| r.waits_on(peer)) {
                    self.watch(peer);
                }
            }
            None => {
                log::warn!("{}: {peer} ({addr}) uses stock gRPC: {}", self.task, choice.reason);
                Stats::global().set_peer(peer, &format!("grpc ({})", choice.reason));
                let err = self.over_grpc(peer, &format!("{peer} goes over stock gRPC: {}", choice.reason));
                for q in failed {
                    q.done.complete(Err(err.clone()));
                }
                let acts = self.locked(|r| r.peer_unreachable(peer, err.clone()));
                self.exec(acts);
            }
        }
    }

    /// The route to `peer` now. A route pending past its deadline is a
    /// timeout; gRPC in strict mode is `Error::Strict`. A task this one was
    /// never told of goes over gRPC.
    pub(super) fn route(&self, peer: &str) -> Result<RouteNow> {
        let route = self.peers.table.lock().get(peer).map(|e| e.route.clone());
        match route {
            Some(Route::Device(k)) => Ok(RouteNow::Device(k)),
            Some(Route::Pending { deadline, .. }) => {
                if Instant::now() >= deadline {
                    Err(route_timeout(peer))
                } else {
                    Ok(RouteNow::Pending)
                }
            }
            Some(Route::Grpc(why)) => self.grpc_route_now(peer, why),
            None => self.grpc_route_now(peer, "task not in any cluster spec seen here".into()),
        }
    }

    fn grpc_route_now(&self, peer: &str, why: String) -> Result<RouteNow> {
        match self.over_grpc(peer, &why) {
            e @ Error::Strict(_) => Err(e),
            _ => Ok(RouteNow::Grpc(why)),
        }
    }

    /// On the keepalive tick: fail what waits for routes pending past their
    /// deadline (queued sends, and receives from the peer), once each.
    pub(super) fn expire_routes(&self, now: Instant) {
        let mut due = Vec::new();
        {
            let mut t = self.peers.table.lock();
            for (peer, e) in t.iter_mut() {
                if let Route::Pending { deadline, .. } = e.route {
                    if now >= deadline && !e.expired {
                        e.expired = true;
                        due.push((peer.clone(), std::mem::take(&mut e.queued)));
                    }
                }
            }
        }
        for (peer, queued) in due {
            let err = route_timeout(&peer);
            log::warn!("{}: {}; {} sends waiting for it fail", self.task, err.message(), queued.len());
            for q in queued {
                q.done.complete(Err(err.clone()));
            }
            let acts = self.locked(|r| r.fail_waiting_on(&peer, &err));
            self.exec(acts);
        }
    }
}

/// The strict-mode error for a tensor with `peer` that would go over stock
/// gRPC because of `why`.
pub fn strict_refusal(peer: &str, why: &str) -> Error {
    Error::Strict(format!("RDMA_DEVICE_STRICT is set but tensors with {peer} would use stock gRPC: {why}"))
}

/// The error of work that waited `ROUTE_WAIT_MS` for `peer`'s route.
pub(super) fn route_timeout(peer: &str) -> Error {
    Error::Timeout(format!(
        "the route to {peer} is still being chosen after {ROUTE_WAIT_MS} ms (resolving its name, probing RDMA)"
    ))
}
