//! The sending side: connect over rdma_cm, then write into the receiver's
//! arena, read from it, and exchange control messages.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys::*;

use super::cm::{self, CmId, RawAddr};
use super::conn::{Conn, Phase, Role, MSG_USER};
use super::progress::{self, Request, Shared};
use crate::error::{Error, Result};
use crate::fabric::{ConnId, Endpoint, FabricEvents, TransportKind, WriteOp};

/// A connected sender. Only handed out once the receiver accepted, so
/// every data-path method has a live remote arena behind it.
pub struct VerbsEndpoint {
    conn: Arc<Conn>,
    shared: Arc<Shared>,
    peer_hello: Vec<u8>,
    remote_len: u64,
    _rt: Option<Arc<super::progress::Runtime>>,
}

impl VerbsEndpoint {
    /// Keep the backend's progress thread running while this endpoint lives.
    pub(crate) fn keep_alive(&mut self, rt: Arc<super::progress::Runtime>) {
        self._rt = Some(rt);
    }
}

pub(crate) fn connect(
    sh: &Arc<Shared>,
    remote: &str,
    hello: &[u8],
    events: Arc<dyn FabricEvents>,
    timeout: Duration,
) -> Result<VerbsEndpoint> {
    if hello.len() > super::max_msg_bytes() {
        return Err(Error::InvalidArgument(format!(
            "handshake payload of {} bytes exceeds {}",
            hello.len(),
            super::max_msg_bytes()
        )));
    }
    let deadline = Instant::now() + timeout;
    let addr = cm::resolve(remote, sh.opts.cm_port_offset)?;
    let id = crate::fabric::next_conn_id();
    let conn = Arc::new(Conn::new(id, Role::Active, events, 0, sh.sizing(Role::Active)));
    let cmid = CmId::new(&sh.channel, id)?;
    if let Some(t) = sh.opts.tos {
        // Before route resolution: the route (and on IB the SL) follows it.
        cmid.set_u8_option(cm::RDMA_OPTION_ID_TOS, t, "TOS")?;
    }
    let raw_id = cmid.raw;
    {
        // Registered (and the id stored) before address resolution starts:
        // its ADDR_RESOLVED may arrive at once and must find the connection.
        // The progress thread's handler waits for this lock.
        let mut inner = conn.inner.lock();
        inner.hello = hello.to_vec();
        inner.cm = Some(cmid);
        sh.conns.lock().insert(id, conn.clone());
        let mut raw = RawAddr::new(&addr);
        let ms = (timeout.as_millis() as i32).clamp(1, super::RESOLVE_TIMEOUT_MS);
        // SAFETY: the id is alive (held by inner.cm, under the lock); raw
        // outlives the call (rdma_cm copies it).
        if unsafe { rdma_resolve_addr(raw_id, std::ptr::null_mut(), raw.as_mut_ptr(), ms) } != 0 {
            let e = Error::last_os(&format!("rdma_resolve_addr({addr})")).context("verbs connect");
            drop(inner);
            sh.request(Request::Kill(id, e.clone()));
            return Err(e);
        }
    }
    let mut inner = conn.inner.lock();
    while inner.result.is_none() {
        if conn.cv.wait_until(&mut inner, deadline).timed_out() {
            break;
        }
    }
    match inner.result.clone() {
        Some(Ok(())) if inner.phase == Phase::Ready => {
            inner.owes_disconnect = true;
            let remote_len = inner.remote.map(|r| r.arena_len).unwrap_or(0);
            let peer_hello = inner.peer_hello.clone();
            drop(inner);
            Ok(VerbsEndpoint { conn, shared: sh.clone(), peer_hello, remote_len, _rt: None })
        }
        Some(Ok(())) => Err(Error::PeerLost(format!("connection to {remote} closed during the handshake"))),
        Some(Err(e)) => {
            drop(inner);
            sh.request(Request::Kill(id, e.clone()));
            Err(e.context(&format!("verbs connect to {remote}")))
        }
        None => {
            drop(inner);
            let e = Error::Timeout(format!("verbs connect to {remote} timed out after {timeout:?}"));
            sh.request(Request::Kill(id, e.clone()));
            Err(e)
        }
    }
}

impl Endpoint for VerbsEndpoint {
    fn id(&self) -> ConnId {
        self.conn.id
    }

    fn kind(&self) -> TransportKind {
        TransportKind::Verbs
    }

    fn peer_hello(&self) -> &[u8] {
        &self.peer_hello
    }

    fn remote_len(&self) -> u64 {
        self.remote_len
    }

    fn write(&self, remote_off: u64, key: u32, imm: u32, op: Box<dyn WriteOp>) {
        // `key` is the rkey the receiver granted for the range (a memory
        // window bound to this connection, or its shared arena region).
        let acts = self.conn.write(remote_off, key, imm, op);
        progress::run_actions(&self.shared, &self.conn, acts);
    }

    fn send_msg(&self, msg: &[u8]) -> Result<()> {
        if msg.len() > super::max_msg_bytes() {
            return Err(Error::InvalidArgument(format!(
                "control message of {} bytes exceeds {}",
                msg.len(),
                super::max_msg_bytes()
            )));
        }
        let acts = self.conn.send_msg(MSG_USER, msg.to_vec())?;
        progress::run_actions(&self.shared, &self.conn, acts);
        Ok(())
    }

    fn backlog(&self) -> usize {
        self.conn.backlog()
    }

    fn close(&self) {
        self.shared.request(Request::Kill(self.conn.id, Error::Aborted("connection closed locally".into())));
    }
}

impl Drop for VerbsEndpoint {
    fn drop(&mut self) {
        self.close();
    }
}
