//! Fabric events into protocol inputs (`Events`, one per backend and per
//! connection we open), and the protocol's two views of the node's memory:
//! granting a placed slot to its sender (`NodeGranter`) and reading a slot's
//! header (`ArenaMem`). Which thread each event runs on, and what it may
//! wait for: the table in the module docs of node/mod.rs.

use super::*;

pub(super) struct Events {
    node: Weak<Inner>,
    kind: TransportKind,
    /// Sender side: the token proof `sign_hello` put in the hello (the
    /// receiver's reply must answer exactly it).
    signed: Mutex<Vec<u8>>,
}

impl Events {
    pub(super) fn new(node: Weak<Inner>, kind: TransportKind) -> Events {
        Events { node, kind, signed: Mutex::new(Vec::new()) }
    }

    /// The proof our hello carried (empty before `sign_hello`, or without
    /// a token).
    pub(super) fn signed(&self) -> Vec<u8> {
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
pub(super) struct NodeGranter {
    pub(super) node: Weak<Inner>,
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
