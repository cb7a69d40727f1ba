//! rdma_cm: the event channel, connection ids, addresses, and the small
//! fixed-size private data carried by the CM's connect/accept messages.
//!
//! Private data is tiny (56 bytes on a RoCE/IB REQ, 196 on a REP), so it
//! carries only what the backend itself needs (magic, version, the arena's
//! address/rkey/length, MTUs); the caller's opaque handshake payloads go
//! over the established connection as the first control messages.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;

use rdma_sys::*;

use crate::codec::{Fixed, Reader, Writer};
use crate::error::{Error, Result};

/// The event channel all of a fabric's ids report on.
pub struct EventChannel {
    pub(crate) raw: *mut rdma_event_channel,
}

// SAFETY: librdmacm channels are thread-safe; only the progress thread reads.
unsafe impl Send for EventChannel {}
// SAFETY: as above.
unsafe impl Sync for EventChannel {}

impl EventChannel {
    pub fn new() -> Result<Arc<EventChannel>> {
        // SAFETY: no preconditions.
        let raw = unsafe { rdma_create_event_channel() };
        if raw.is_null() {
            return Err(Error::NotViable(format!(
                "rdma_create_event_channel failed ({}); is the rdma_ucm module loaded?",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: raw is valid.
        super::device::set_nonblocking(unsafe { (*raw).fd })?;
        Ok(Arc::new(EventChannel { raw }))
    }

    pub fn fd(&self) -> i32 {
        // SAFETY: raw is valid for our lifetime.
        unsafe { (*self.raw).fd }
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: all ids on it are destroyed first (they hold an Arc to us).
        unsafe { rdma_destroy_event_channel(self.raw) };
    }
}

/// An `rdma_cm_id`, with the QP rdma_cm created on it (if any). Dropping
/// destroys the QP, then the id. Holds the CQ the QP uses, so the CQ (and
/// its device) outlive the QP.
pub struct CmId {
    pub(crate) raw: *mut rdma_cm_id,
    has_qp: bool,
    /// What the QP uses, kept alive until it is destroyed.
    keep: Option<(Arc<super::device::Cq>, Arc<super::device::Cq>, Arc<super::hca::Srq>)>,
    _channel: Arc<EventChannel>,
}

// SAFETY: the id is only mutated under its owner's lock or on the progress
// thread; librdmacm calls are thread-safe.
unsafe impl Send for CmId {}
// SAFETY: as above.
unsafe impl Sync for CmId {}

impl CmId {
    /// A new TCP-port-space id whose `context` is the integer `token`.
    pub fn new(channel: &Arc<EventChannel>, token: u64) -> Result<CmId> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: channel is live; the context is an integer tag, never
        // dereferenced by librdmacm.
        let rc = unsafe {
            rdma_create_id(channel.raw, &mut raw, token as usize as *mut _, rdma_port_space::RDMA_PS_TCP)
        };
        if rc != 0 {
            return Err(Error::last_os("rdma_create_id"));
        }
        Ok(CmId { raw, has_qp: false, keep: None, _channel: channel.clone() })
    }

    /// Adopt an id librdmacm created for an incoming connect request.
    ///
    /// # Safety
    /// `raw` must be the `id` of a CONNECT_REQUEST event, owned by nobody else.
    pub unsafe fn adopt(channel: &Arc<EventChannel>, raw: *mut rdma_cm_id, token: u64) -> CmId {
        // SAFETY: raw is valid (caller); `context` is the user's field.
        unsafe { (*raw).context = token as usize as *mut _ };
        CmId { raw, has_qp: false, keep: None, _channel: channel.clone() }
    }

    /// The device context rdma_cm bound this id to (null before binding).
    pub fn verbs(&self) -> *mut ibv_context {
        // SAFETY: raw is valid for our lifetime.
        unsafe { (*self.raw).verbs }
    }

    pub fn port_num(&self) -> u8 {
        // SAFETY: as above.
        unsafe { (*self.raw).port_num }
    }

    pub fn qp(&self) -> *mut ibv_qp {
        // SAFETY: as above.
        unsafe { (*self.raw).qp }
    }

    /// The source GID rdma_cm chose for this id's route.
    pub fn sgid(&self) -> [u8; 16] {
        // SAFETY: route.addr is plain data in the id; for RoCE/IB ids the
        // ibaddr member is the active one.
        unsafe { (*self.raw).route.addr.addr.ibaddr.sgid.raw }
    }

    /// The local TCP-space port (host order).
    pub fn src_port(&self) -> u16 {
        // SAFETY: raw is valid.
        u16::from_be(unsafe { rdma_get_src_port(self.raw) })
    }

    /// Create an RC QP on this id: sends complete on `send_cq`, receives
    /// come from the device's `srq` and complete on `recv_cq`. Asks for
    /// `cap.max_inline_data` and, if the device refuses, retries without
    /// inline data. Returns the capabilities the QP really has.
    pub fn create_qp(
        &mut self,
        pd: &super::device::Pd,
        send_cq: &Arc<super::device::Cq>,
        recv_cq: &Arc<super::device::Cq>,
        srq: &Arc<super::hca::Srq>,
        cap: ibv_qp_cap,
    ) -> Result<ibv_qp_cap> {
        let mut tries = vec![cap];
        if cap.max_inline_data > 0 {
            tries.push(ibv_qp_cap { max_inline_data: 0, ..cap });
        }
        let mut last = Error::Internal("no QP attempt".into());
        for cap in tries {
            // SAFETY: zeroed POD init-attr, then filled.
            let mut attr: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
            attr.send_cq = send_cq.raw;
            attr.recv_cq = recv_cq.raw;
            attr.srq = srq.raw();
            attr.cap = cap;
            attr.qp_type = ibv_qp_type::IBV_QPT_RC;
            attr.sq_sig_all = 0;
            // SAFETY: id, pd, CQs and SRQ are live and on the same device.
            if unsafe { rdma_create_qp(self.raw, pd.raw, &mut attr) } == 0 {
                self.has_qp = true;
                self.keep = Some((send_cq.clone(), recv_cq.clone(), srq.clone()));
                return Ok(attr.cap);
            }
            last = Error::last_os(&format!("rdma_create_qp (inline {} bytes)", cap.max_inline_data));
        }
        Err(last)
    }

    /// `rdma_set_option(RDMA_OPTION_ID, opt, u8)`: TOS must be set before
    /// route resolution, the ACK timeout before connect/accept.
    pub fn set_u8_option(&self, opt: i32, val: u8, what: &str) -> Result<()> {
        let mut v = val;
        // SAFETY: the id is live; v outlives the call (the kernel copies it).
        let rc = unsafe { rdma_set_option(self.raw, RDMA_OPTION_ID, opt, (&mut v as *mut u8).cast(), 1) };
        if rc != 0 {
            return Err(Error::last_os(&format!("rdma_set_option({what}={val})")));
        }
        Ok(())
    }

    /// Move the QP to the error state and send a DREQ (idempotent).
    pub fn disconnect(&self) {
        // SAFETY: raw is valid; an error only means "not connected".
        unsafe { rdma_disconnect(self.raw) };
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        if self.has_qp {
            // SAFETY: the QP was made by rdma_create_qp on this id; no thread
            // posts to it any more (owners drop us under their lock).
            unsafe { rdma_destroy_qp(self.raw) };
        }
        // SAFETY: every event for this id has been acknowledged (the progress
        // thread acks before acting), so this does not block.
        let rc = unsafe { rdma_destroy_id(self.raw) };
        if rc != 0 {
            log::warn!("verbs: rdma_destroy_id failed: {}", std::io::Error::last_os_error());
        }
        drop(self.keep.take());
    }
}

/// `rdma_set_option` level and names (enum values of rdma_cma.h that
/// rdma-sys does not bind).
pub const RDMA_OPTION_ID: i32 = 0;
pub const RDMA_OPTION_ID_TOS: i32 = 0;
pub const RDMA_OPTION_ID_ACK_TIMEOUT: i32 = 3;

/// Whether rdma_cm can reach `addr` through an RDMA port: address and
/// route resolution on a temporary id with its own event channel, waited
/// for here (never on the progress thread) for at most `timeout_ms` each.
/// Returns the device the route leaves through.
pub fn probe_route(addr: &SocketAddr, timeout_ms: i32, tos: Option<u8>) -> Result<String> {
    use rdma_cm_event_type::*;
    let ch = EventChannel::new()?;
    let id = CmId::new(&ch, 0)?;
    if let Some(t) = tos {
        id.set_u8_option(RDMA_OPTION_ID_TOS, t, "TOS")?;
    }
    let not = |why: String| Error::NotViable(format!("rdma_cm cannot reach {addr} through an RDMA port: {why}"));
    let wait = |want: rdma_cm_event_type::Type| -> Result<()> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(timeout_ms.max(1) as u64 + 100);
        loop {
            if let Some(ev) = next_event(&ch) {
                return if ev.kind == want { Ok(()) } else { Err(not(format!("{} (status {})", ev.name(), ev.status))) };
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(not(format!("no answer within {timeout_ms} ms")));
            }
            let mut p = libc::pollfd { fd: ch.fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd; bounded wait.
            unsafe { libc::poll(&mut p, 1, left.as_millis().clamp(1, 1000) as i32) };
        }
    };
    let mut raw = RawAddr::new(addr);
    // SAFETY: the id is alive; raw outlives the call (rdma_cm copies it).
    if unsafe { rdma_resolve_addr(id.raw, std::ptr::null_mut(), raw.as_mut_ptr(), timeout_ms) } != 0 {
        return Err(not(format!("rdma_resolve_addr: {}", std::io::Error::last_os_error())));
    }
    wait(RDMA_CM_EVENT_ADDR_RESOLVED)?;
    // SAFETY: the id is alive and its address resolved.
    if unsafe { rdma_resolve_route(id.raw, timeout_ms) } != 0 {
        return Err(not(format!("rdma_resolve_route: {}", std::io::Error::last_os_error())));
    }
    wait(RDMA_CM_EVENT_ROUTE_RESOLVED)?;
    let ctx = id.verbs();
    if ctx.is_null() {
        return Err(not("the route is not on an RDMA device".into()));
    }
    // SAFETY: ctx is the live librdmacm context the id is bound to.
    let name = unsafe { std::ffi::CStr::from_ptr(ibv_get_device_name((*ctx).device)) };
    Ok(name.to_string_lossy().into_owned())
}

/// Resolve "host:port" (IPv4 preferred) with `offset` added to the port.
pub fn resolve(addr: &str, offset: u16) -> Result<SocketAddr> {
    let (host, port) = addr
        .rsplit_once(':')
        .ok_or_else(|| Error::InvalidArgument(format!("address {addr:?} is not host:port")))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port: u16 = port
        .parse()
        .map_err(|_| Error::InvalidArgument(format!("bad port in address {addr:?}")))?;
    let port = if port == 0 {
        0
    } else {
        port.checked_add(offset).ok_or_else(|| {
            Error::InvalidArgument(format!("port {port} + rdma_cm port offset {offset} overflows"))
        })?
    };
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| Error::InvalidArgument(format!("cannot resolve {host:?}: {e}")))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| Error::InvalidArgument(format!("{host:?} resolves to no address")))
}

/// A socket address in the C layout rdma_cm takes.
pub struct RawAddr(libc::sockaddr_storage);

impl RawAddr {
    pub fn new(a: &SocketAddr) -> RawAddr {
        // SAFETY: zeroed sockaddr_storage is valid; we fill one family below.
        let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        match a {
            SocketAddr::V4(v4) => {
                // SAFETY: sockaddr_storage is large and aligned enough.
                let sin = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in) };
                sin.sin_family = libc::AF_INET as _;
                sin.sin_port = v4.port().to_be();
                sin.sin_addr.s_addr = u32::from_ne_bytes(v4.ip().octets());
            }
            SocketAddr::V6(v6) => {
                // SAFETY: as above.
                let sin6 = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in6) };
                sin6.sin6_family = libc::AF_INET6 as _;
                sin6.sin6_port = v6.port().to_be();
                sin6.sin6_addr.s6_addr = v6.ip().octets();
                sin6.sin6_scope_id = v6.scope_id();
            }
        }
        RawAddr(ss)
    }

    pub fn as_mut_ptr(&mut self) -> *mut libc::sockaddr {
        &mut self.0 as *mut _ as *mut libc::sockaddr
    }
}

/// Magic and version at the start of our private data ("RDV" + version).
pub const MAGIC: u32 = 0x5244_5602;

/// What the connecting side tells the listener in the CM REQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectData {
    pub mtu: u32,
    pub recv_depth: u32,
    pub slot: u32,
}

/// What the listener answers in the CM REP: where to write, and its MTU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcceptData {
    pub arena_addr: u64,
    pub arena_rkey: u32,
    pub arena_len: u64,
    pub mtu: u32,
    pub recv_depth: u32,
    pub slot: u32,
    /// The receiver's nonce for this connection: the sender's hello is
    /// signed over it (`FabricEvents::sign_hello`).
    pub nonce: [u8; crate::fabric::NONCE_LEN],
}

impl ConnectData {
    pub const LEN: usize = 16;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut w = Writer::<Fixed<{ Self::LEN }>>::fixed();
        w.u32(MAGIC);
        w.u32(self.mtu);
        w.u32(self.recv_depth);
        w.u32(self.slot);
        w.into_array()
    }

    pub fn decode(b: &[u8]) -> Result<ConnectData> {
        let bad = || Error::Protocol("connect request is not from an rdma_device verbs peer (bad private data)".into());
        let mut r = Reader::new(b);
        if r.u32().map_err(|_| bad())? != MAGIC {
            return Err(bad());
        }
        Ok(ConnectData { mtu: r.u32().map_err(|_| bad())?, recv_depth: r.u32().map_err(|_| bad())?, slot: r.u32().map_err(|_| bad())? })
    }
}

impl AcceptData {
    pub const LEN: usize = 36 + crate::fabric::NONCE_LEN;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut w = Writer::<Fixed<{ Self::LEN }>>::fixed();
        w.u32(MAGIC);
        w.u64(self.arena_addr);
        w.u32(self.arena_rkey);
        w.u64(self.arena_len);
        w.u32(self.mtu);
        w.u32(self.recv_depth);
        w.u32(self.slot);
        w.raw(&self.nonce);
        w.into_array()
    }

    pub fn decode(b: &[u8]) -> Result<AcceptData> {
        let bad = || Error::Protocol("accept reply is not from an rdma_device verbs peer (bad private data)".into());
        let mut r = Reader::new(b);
        if r.u32().map_err(|_| bad())? != MAGIC {
            return Err(bad());
        }
        Ok(AcceptData {
            arena_addr: r.u64().map_err(|_| bad())?,
            arena_rkey: r.u32().map_err(|_| bad())?,
            arena_len: r.u64().map_err(|_| bad())?,
            mtu: r.u32().map_err(|_| bad())?,
            recv_depth: r.u32().map_err(|_| bad())?,
            slot: r.u32().map_err(|_| bad())?,
            nonce: r.array().map_err(|_| bad())?,
        })
    }
}

/// A CM event, copied out so the event can be acknowledged at once.
pub struct Event {
    pub kind: rdma_cm_event_type::Type,
    pub status: i32,
    pub id: *mut rdma_cm_id,
    /// `context` of the event's id (or of the listening id for a request).
    pub token: u64,
    pub private: Vec<u8>,
    pub responder_resources: u8,
    pub initiator_depth: u8,
}

impl Event {
    pub fn name(&self) -> String {
        // SAFETY: returns a static string for any value.
        let p = unsafe { rdma_event_str(self.kind) };
        if p.is_null() {
            return format!("event {}", self.kind);
        }
        // SAFETY: static NUL-terminated string.
        unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// Take the next CM event without blocking, copy it and acknowledge it.
pub fn next_event(ch: &EventChannel) -> Option<Event> {
    let mut ev = std::ptr::null_mut();
    // SAFETY: the channel fd is non-blocking; ev is a valid out-pointer.
    if unsafe { rdma_get_cm_event(ch.raw, &mut ev) } != 0 || ev.is_null() {
        return None;
    }
    // SAFETY: ev is a live event until acked below; we copy what we need.
    let out = unsafe {
        let e = &*ev;
        let is_req = e.event == rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST;
        let ctx_id = if is_req && !e.listen_id.is_null() { e.listen_id } else { e.id };
        let conn = &e.param.conn;
        let private = if conn.private_data.is_null() || conn.private_data_len == 0 {
            Vec::new()
        } else {
            std::slice::from_raw_parts(conn.private_data.cast::<u8>(), conn.private_data_len as usize).to_vec()
        };
        Event {
            kind: e.event,
            status: e.status,
            id: e.id,
            token: (*ctx_id).context as usize as u64,
            private,
            responder_resources: conn.responder_resources,
            initiator_depth: conn.initiator_depth,
        }
    };
    // SAFETY: ev came from rdma_get_cm_event and is acked exactly once.
    unsafe { rdma_ack_cm_event(ev) };
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_data_round_trips() {
        let c = ConnectData { mtu: 1024, recv_depth: 32, slot: 4096 };
        assert_eq!(ConnectData::decode(&c.encode()).unwrap(), c);
        let a = AcceptData { arena_addr: 0x7f00_0000_1000, arena_rkey: 77, arena_len: 1 << 30, mtu: 4096, recv_depth: 32, slot: 4096, nonce: [9; 16] };
        assert_eq!(AcceptData::decode(&a.encode()).unwrap(), a);
        assert!(ConnectData::decode(&[0u8; 16]).is_err());
        assert!(AcceptData::decode(&a.encode()[..20]).is_err());
        assert!(AcceptData::decode(&a.encode()[..AcceptData::LEN - 1]).is_err(), "an accept without its whole nonce");
        const { assert!(ConnectData::LEN <= 56 && AcceptData::LEN <= 196) };
    }

    #[test]
    fn resolve_adds_offset_and_prefers_ipv4() {
        assert_eq!(resolve("127.0.0.1:1000", 5).unwrap(), "127.0.0.1:1005".parse().unwrap());
        assert_eq!(resolve("127.0.0.1:0", 5).unwrap().port(), 0);
        assert!(resolve("nohostport", 0).is_err());
        assert!(resolve("127.0.0.1:65535", 1).is_err());
        assert!(resolve("localhost:7", 0).unwrap().is_ipv4());
    }
}
