//! rdma_cm events: connection bring-up on both sides (address and route
//! resolution, QP creation, connect/accept with the private data, the
//! handshake's first message) and the CM's ways of saying "gone".
//!
//! The steps that register memory (opening a device: its shared receive
//! buffers; a connection's buffers; without memory windows, the arena)
//! run on `rdev-verbs-setup`, not here: ROUTE_RESOLVED and CONNECT_REQUEST
//! hand the rest of the bring-up over (`active_connect`, `passive_accept`).
//! The connection is in the table meanwhile, so a kill finds it; the setup
//! job registers outside the connection's lock, then re-checks under it
//! that the connection is still being set up before it touches the QP.

use std::sync::Arc;

use rdma_sys::*;

use super::{handshakes, kill, run_actions, Shared, LISTENER_BIT};
use crate::error::{Error, Result};
use crate::fabric::verbs::cm::{self, AcceptData, CmId, ConnectData};
use crate::fabric::verbs::conn::{self, Conn, Phase, Role};
use crate::fabric::verbs::device;
use crate::fabric::verbs::hca::Device;

pub(super) fn on_cm_event(sh: &Arc<Shared>, ev: cm::Event) {
    use rdma_cm_event_type::*;
    if ev.kind == RDMA_CM_EVENT_CONNECT_REQUEST {
        on_connect_request(sh, ev);
        return;
    }
    let Some(c) = sh.conns.lock().get(&ev.token).cloned() else {
        if ev.token & LISTENER_BIT == 0 || ev.kind == RDMA_CM_EVENT_DEVICE_REMOVAL {
            log::debug!("verbs: {} for unknown id {:#x}", ev.name(), ev.token);
        }
        return;
    };
    let r = match ev.kind {
        RDMA_CM_EVENT_ADDR_RESOLVED => {
            let inner = c.inner.lock();
            match &inner.cm {
                // SAFETY: the id is alive while inner.cm holds it.
                Some(cm) if unsafe { rdma_resolve_route(cm.raw, crate::fabric::verbs::RESOLVE_TIMEOUT_MS) } != 0 => {
                    Err(Error::last_os("rdma_resolve_route"))
                }
                _ => Ok(()),
            }
        }
        RDMA_CM_EVENT_ROUTE_RESOLVED => {
            let (sh, c) = (sh.clone(), c.clone());
            super::worker::spawn(move || {
                if let Err(e) = active_connect(&sh, &c) {
                    sh.request(super::Request::Kill(c.id, e));
                }
            });
            Ok(())
        }
        RDMA_CM_EVENT_ESTABLISHED => established(sh, &c, &ev),
        RDMA_CM_EVENT_DISCONNECTED => Err(Error::PeerLost(format!("peer of connection {} disconnected", c.id))),
        RDMA_CM_EVENT_REJECTED => Err(rejected(&ev)),
        RDMA_CM_EVENT_DEVICE_REMOVAL => Err(Error::PeerLost("RDMA device removed".into())),
        RDMA_CM_EVENT_ADDR_ERROR | RDMA_CM_EVENT_ROUTE_ERROR | RDMA_CM_EVENT_UNREACHABLE | RDMA_CM_EVENT_CONNECT_ERROR => {
            Err(Error::PeerLost(format!("rdma_cm {} (status {})", ev.name(), ev.status)))
        }
        _ => Ok(()),
    };
    if let Err(e) = r {
        kill(sh, &c, e);
    }
}

fn rejected(ev: &cm::Event) -> Error {
    if ev.private.len() > 5 && ev.private[..4] == cm::MAGIC.to_le_bytes() {
        let len = ev.private[4] as usize;
        if let Some(b) = ev.private.get(5..5 + len) {
            return conn::decode_refusal(b);
        }
    }
    // Rejected by rdma_cm itself (no private data of ours): nobody listens
    // on that port, i.e. the peer does not run this transport (or not yet).
    Error::NotViable(format!("{} (rdma_cm rejected the connection, status {})", super::super::NO_LISTENER, ev.status))
}

fn conn_param(sh: &Shared, dev: &Device, private: &[u8], peer_rr: Option<(u8, u8)>) -> rdma_conn_param {
    let (mut rr, mut depth) = (dev.ctx.info.max_qp_rd_atom.clamp(1, 16) as u8, dev.ctx.info.max_qp_init_rd_atom.clamp(1, 16) as u8);
    if let Some((prr, pdepth)) = peer_rr {
        // The passive side may not exceed what the requester offered.
        rr = rr.min(pdepth.max(1));
        depth = depth.min(prr.max(1));
    }
    rdma_conn_param {
        private_data: private.as_ptr().cast(),
        private_data_len: private.len() as u8,
        responder_resources: rr,
        initiator_depth: depth,
        flow_control: 1,
        // Resends after an ACK timeout (the timeout itself is the id's
        // RDMA_OPTION_ID_ACK_TIMEOUT): a dead host fails the QP within
        // `VerbsOptions::dead_peer_bound`.
        retry_count: sh.opts.retry_count.min(7),
        // Resends after receiver-not-ready; 7 would be "forever", so a
        // receiver that stopped reposting would stall its senders for good.
        rnr_retry_count: sh.opts.rnr_retry.min(7),
        srq: 1,
        qp_num: 0,
    }
}

/// The device context and port of a connection still being brought up
/// (`None` once it is not: closed meanwhile, nothing left to do).
fn connecting_port(c: &Conn) -> Option<(*mut ibv_context, u8)> {
    let inner = c.inner.lock();
    match &inner.cm {
        Some(cm) if inner.phase == Phase::Connecting => Some((cm.verbs(), cm.port_num())),
        _ => None,
    }
}

/// The active side's bring-up after route resolution (on the setup
/// thread): device, buffers, QP, `rdma_connect`.
fn active_connect(sh: &Arc<Shared>, c: &Arc<Conn>) -> Result<()> {
    let what = format!("connection {}", c.id);
    let Some((ctx, port)) = connecting_port(c) else { return Ok(()) };
    // Registration, outside the connection's lock.
    let dev = sh.device_at(ctx, port, &what)?;
    let slab = c.new_slab(&dev)?;
    let mut inner = c.inner.lock();
    if inner.phase != Phase::Connecting {
        return Ok(());
    }
    let Some(cm) = inner.cm.take() else { return Ok(()) };
    let gid = match sh.check_gid(&dev, &cm, &what) {
        Ok(g) => g,
        Err(e) => {
            inner.cm = Some(cm);
            return Err(e);
        }
    };
    log::debug!("verbs: conn {} via {gid}", c.id);
    c.setup(&mut inner, cm, dev.clone(), slab)?;
    sh.register_qp(&dev, inner.qpn, c);
    let port_mtu = mtu_of(&dev, &inner);
    let pd = ConnectData { mtu: port_mtu, recv_depth: c.sizing.n_recv, slot: c.sizing.slot as u32 }.encode();
    let mut p = conn_param(sh, &dev, &pd, None);
    let cm = inner.cm.as_ref().ok_or_else(|| Error::Internal("no id".into()))?;
    cm.set_u8_option(cm::RDMA_OPTION_ID_ACK_TIMEOUT, sh.opts.ack_timeout, "ACK timeout")?;
    let raw = cm.raw;
    // SAFETY: the id and its QP are alive (under the connection's lock); p
    // and pd outlive the call.
    if unsafe { rdma_connect(raw, &mut p) } != 0 {
        return Err(Error::last_os("rdma_connect"));
    }
    Ok(())
}

fn mtu_of(dev: &Device, inner: &conn::Inner) -> u32 {
    let port = inner.cm.as_ref().map(|m| m.port_num()).unwrap_or(1);
    dev.ctx.info.ports.iter().find(|p| p.num == port).map(|p| p.mtu).unwrap_or(0)
}

fn path_mtu(inner: &conn::Inner) -> u32 {
    let Some(cm) = inner.cm.as_ref() else { return 0 };
    // SAFETY: zeroed POD out-structs.
    let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    // SAFETY: the QP is alive under the connection lock.
    let rc = unsafe { ibv_query_qp(cm.qp(), &mut attr, ibv_qp_attr_mask::IBV_QP_PATH_MTU.0 as i32, &mut init) };
    if rc != 0 {
        return 0;
    }
    device::mtu_bytes(attr.path_mtu)
}

fn established(sh: &Arc<Shared>, c: &Arc<Conn>, ev: &cm::Event) -> Result<()> {
    if c.role == Role::Passive {
        return Ok(());
    }
    let hello = {
        let mut inner = c.inner.lock();
        if inner.phase != Phase::Connecting {
            return Ok(());
        }
        let acc = AcceptData::decode(&ev.private)?;
        let path = path_mtu(&inner);
        log::info!(
            "verbs: conn {} established: path MTU {path} (ours {}, peer's {}), peer arena {} bytes",
            c.id,
            inner.dev.as_ref().map(|d| mtu_of(d, &inner)).unwrap_or(0),
            acc.mtu,
            acc.arena_len
        );
        let nonce = acc.nonce;
        inner.remote = Some(acc);
        inner.phase = Phase::Handshake;
        (std::mem::take(&mut inner.hello), nonce)
    };
    // Signed over the receiver's nonce, outside the connection's lock.
    let hello = c.events.sign_hello(&hello.0, &hello.1);
    let acts = c.send_msg(conn::MSG_HELLO, hello)?;
    run_actions(sh, c, acts);
    Ok(())
}

pub(super) fn reject(raw: *mut rdma_cm_id, why: &Error) {
    let mut body = conn::encode_refusal(why);
    body.truncate(140);
    let mut pd = cm::MAGIC.to_le_bytes().to_vec();
    pd.push(body.len() as u8);
    pd.extend_from_slice(&body);
    // SAFETY: raw is the live request id; pd outlives the call.
    unsafe { rdma_reject(raw, pd.as_ptr().cast(), pd.len() as u8) };
}

fn on_connect_request(sh: &Arc<Shared>, ev: cm::Event) {
    let id = crate::fabric::next_conn_id();
    // SAFETY: ev.id is the new id of this CONNECT_REQUEST, owned by nobody.
    let cmid = unsafe { CmId::adopt(&sh.channel, ev.id, id) };
    let lst = sh.listeners.lock().get(&ev.token).cloned();
    let Some(lst) = lst else {
        reject(cmid.raw, &Error::PeerLost(crate::fabric::LISTENER_CLOSING.into()));
        return;
    };
    let deadline = std::time::Instant::now() + sh.opts.hello_timeout;
    let w = handshakes::Waiting { id, cm: cmid, listener: lst, private: ev.private.clone(), rr: (ev.responder_resources, ev.initiator_depth), deadline };
    handshakes::admit(sh, w);
}

/// Bring up an admitted connect request (see `handshakes`): into the
/// tables, then QP, buffers and accept on the setup thread.
pub(super) fn bring_up(sh: &Arc<Shared>, w: handshakes::Waiting) {
    let handshakes::Waiting { id, cm: cmid, listener: lst, private, rr, .. } = w;
    if sh.listeners.lock().get(&lst.token).is_none() {
        reject(cmid.raw, &Error::PeerLost(crate::fabric::LISTENER_CLOSING.into()));
        handshakes::done(sh, id);
        return;
    }
    let c = Arc::new(Conn::new(id, Role::Passive, lst.events.clone(), lst.token, sh.sizing(Role::Passive)));
    // The id moves into the conn, and the conn into the tables, first:
    // every failure (and a listener closing meanwhile) then leaves it to
    // `kill`, which destroys it after `reject` used it.
    c.inner.lock().cm = Some(cmid);
    sh.conns.lock().insert(id, c.clone());
    lst.conns.lock().insert(id);
    let sh = sh.clone();
    super::worker::spawn(move || {
        if let Err(e) = passive_accept(&sh, &c, &lst, &private, rr) {
            log::warn!("verbs: refusing a connection at {}: {e}", lst.addr);
            if let Some(cm) = c.inner.lock().cm.as_ref() {
                reject(cm.raw, &e);
            }
            sh.request(super::Request::Kill(c.id, e));
        }
    });
}

/// The passive side's bring-up (on the setup thread): device, the arena's
/// registration, buffers, QP, `rdma_accept`.
fn passive_accept(sh: &Arc<Shared>, c: &Arc<Conn>, lst: &Arc<super::ListenerShared>, private: &[u8], peer_rr: (u8, u8)) -> Result<()> {
    let peer = ConnectData::decode(private)?;
    let what = format!("listener {}", lst.addr);
    let Some((ctx, port)) = connecting_port(c) else { return Ok(()) };
    // Registration, outside the connection's lock.
    let dev = sh.device_at(ctx, port, &what)?;
    let areg = lst.arena_reg(&dev)?;
    let slab = c.new_slab(&dev)?;
    let mut inner = c.inner.lock();
    if inner.phase != Phase::Connecting {
        return Ok(());
    }
    let gid = {
        let cmid = inner.cm.as_ref().ok_or_else(|| Error::Internal("no id".into()))?;
        sh.check_gid(&dev, cmid, &what)?
    };
    let cmid = inner.cm.take().ok_or_else(|| Error::Internal("no id".into()))?;
    let raw = cmid.raw;
    c.setup(&mut inner, cmid, dev.clone(), slab)?;
    inner.arena = Some(areg.clone());
    sh.register_qp(&dev, inner.qpn, c);
    let ours = mtu_of(&dev, &inner);
    log::debug!("verbs: conn {} accepted on {gid}, MTU ours {ours} peer's {}", c.id, peer.mtu);
    // The arena's address and key go out only with the answer to the
    // sender's hello, once the node accepted it (`Conn::accept_ok`):
    // a peer that is refused never learns where or how to write.
    // This connection's nonce: the sender's hello must be signed over it.
    let nonce = crate::fabric::new_nonce()?;
    inner.nonce = nonce;
    let acc = AcceptData {
        nonce,
        arena_addr: 0,
        arena_rkey: 0,
        arena_len: areg.len,
        mtu: ours,
        recv_depth: c.sizing.n_recv,
        slot: c.sizing.slot as u32,
    }
    .encode();
    let mut p = conn_param(sh, &dev, &acc, Some(peer_rr));
    if let Some(cm) = inner.cm.as_ref() {
        cm.set_u8_option(cm::RDMA_OPTION_ID_ACK_TIMEOUT, sh.opts.ack_timeout, "ACK timeout")?;
    }
    // The sender's hello may arrive before our ESTABLISHED event.
    inner.phase = Phase::Handshake;
    // SAFETY: the id and its QP are alive (under the connection's lock);
    // p/acc outlive the call.
    if unsafe { rdma_accept(raw, &mut p) } != 0 {
        return Err(Error::last_os("rdma_accept"));
    }
    Ok(())
}
