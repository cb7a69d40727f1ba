//! The receiving side: an rdma_cm listening id on the task's address, the
//! arena's registration per device (in extents made as slots are placed,
//! `mr::arena`), the connections it accepted, and the memory windows that
//! let each sender write only the ranges granted to it (`grant`; see `mw`
//! for the design and what holds on a device without type-2 windows).
//!
//! Threading: `grant` runs under the node's protocol lock on any thread
//! (the progress thread included). It allocates or deallocates windows
//! (short kernel calls, no pinning), hands a new arena extent's
//! registration to `rdev-verbs-setup` and queues the bind on the
//! connection (it waits there for the extent); it never waits for a
//! registration or a completion. Lock order: `windows`, then an arena's
//! extent table, then a connection's lock, then a window's or an
//! extent's own lock.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use rdma_sys::*;

use super::cm::{self, CmId, RawAddr};
use super::conn::MSG_USER;
use super::mw::Mw;
use super::progress::{self, ListenerShared, Request, Shared, LISTENER_BIT};
use crate::error::{Error, Result};
use crate::fabric::{Arena, ConnId, FabricEvents, Listener};

static NEXT_LISTENER: AtomicU64 = AtomicU64::new(1);

/// A listening receiver. Dropping it shuts it down.
pub struct VerbsListener {
    shared: Arc<Shared>,
    lst: Arc<ListenerShared>,
    closed: AtomicBool,
    _rt: Option<Arc<super::progress::Runtime>>,
}

impl VerbsListener {
    /// Keep the backend's progress thread running while this listener lives.
    pub(crate) fn keep_alive(&mut self, rt: Arc<super::progress::Runtime>) {
        self._rt = Some(rt);
    }
}

pub(crate) fn listen(sh: &Arc<Shared>, local: &str, arena: Arc<Arena>, events: Arc<dyn FabricEvents>) -> Result<VerbsListener> {
    let offset = sh.opts.cm_port_offset;
    let addr = cm::resolve(local, offset)?;
    let token = LISTENER_BIT | NEXT_LISTENER.fetch_add(1, Ordering::Relaxed);
    let cmid = CmId::new(&sh.channel, token)?;
    if let Some(t) = sh.opts.tos {
        // Accepted ids inherit the listening id's TOS.
        cmid.set_u8_option(cm::RDMA_OPTION_ID_TOS, t, "TOS")?;
    }
    let mut raw = RawAddr::new(&addr);
    // SAFETY: the id is fresh; raw outlives the call.
    if unsafe { rdma_bind_addr(cmid.raw, raw.as_mut_ptr()) } != 0 {
        return Err(Error::last_os(&format!("rdma_bind_addr({addr}) for the verbs listener")));
    }
    let port = cmid.src_port().saturating_sub(if addr.port() == 0 { 0 } else { offset });
    let host = local.rsplit_once(':').map(|(h, _)| h).unwrap_or(local);
    let lst = Arc::new(ListenerShared {
        token,
        addr: format!("{host}:{port}"),
        events,
        arena,
        cm: Mutex::new(None),
        conns: Mutex::new(HashSet::new()),
        windows_wanted: sh.opts.memory_windows,
        windows: Mutex::new(BTreeMap::new()),
        chunk: sh.opts.arena_chunk,
    });
    // A specific address binds to its device now: open it and prepare the
    // arena's registration here (on the caller's thread), so limits fail
    // `listen`, not the first connection.
    let bound = !cmid.verbs().is_null();
    let raw_id = cmid.raw;
    *lst.cm.lock() = Some(cmid);
    if bound {
        let r = lst.cm.lock().as_ref().map(|id| sh.device_for(id, &format!("listener {}", lst.addr)));
        let r = r.unwrap_or_else(|| Err(Error::Internal("no id".into()))).and_then(|dev| lst.arena_reg(&dev));
        if let Err(e) = r {
            drop(lst.cm.lock().take());
            return Err(e);
        }
    }
    // In the table before rdma_listen: a request may arrive at once.
    sh.listeners.lock().insert(token, lst.clone());
    // SAFETY: the id is bound and alive (held by lst.cm).
    if unsafe { rdma_listen(raw_id, super::LISTEN_BACKLOG) } != 0 {
        let e = Error::last_os(&format!("rdma_listen({addr})"));
        sh.request(Request::CloseListener(token));
        return Err(e);
    }
    log::info!("verbs: listening on {} (rdma_cm port {})", lst.addr, port as u32 + offset as u32);
    Ok(VerbsListener { shared: sh.clone(), lst, closed: AtomicBool::new(false), _rt: None })
}

impl Listener for VerbsListener {
    fn local_addr(&self) -> String {
        self.lst.addr.clone()
    }

    fn send_msg(&self, conn: ConnId, msg: &[u8]) -> Result<()> {
        if msg.len() > super::max_msg_bytes() {
            return Err(Error::InvalidArgument(format!(
                "control message of {} bytes exceeds {}",
                msg.len(),
                super::max_msg_bytes()
            )));
        }
        let c = self.shared.conns.lock().get(&conn).cloned();
        let c = c
            .filter(|c| c.listener == self.lst.token)
            .ok_or_else(|| Error::PeerLost(format!("no connection {conn} on listener {}", self.lst.addr)))?;
        let acts = c.send_msg(MSG_USER, msg.to_vec())?;
        progress::run_actions(&self.shared, &c, acts);
        Ok(())
    }

    fn backlog(&self, conn: ConnId) -> usize {
        let c = self.shared.conns.lock().get(&conn).cloned();
        c.filter(|c| c.listener == self.lst.token).map_or(0, |c| c.backlog())
    }

    fn grant(&self, conn: ConnId, off: u64, len: u64) -> Result<Option<u32>> {
        if !self.lst.conns.lock().contains(&conn) {
            return Ok(None);
        }
        let c = self.shared.conns.lock().get(&conn).cloned();
        let Some(c) = c.filter(|c| c.listener == self.lst.token) else { return Ok(None) };
        let end = off.checked_add(len).filter(|e| *e <= self.lst.arena.len() as u64 && len > 0);
        let Some(end) = end else {
            return Err(Error::InvalidArgument(format!("grant of {len} bytes at {off} outside the arena")));
        };
        // The NIC writes the registered base pages: show those there.
        self.lst.arena.show(off as usize, len as usize, None)?;
        let (areg, dev) = {
            let i = c.inner.lock();
            (i.arena.clone(), i.dev.clone())
        };
        let (Some(areg), Some(dev)) = (areg, dev) else {
            return Err(Error::PeerLost(format!("connection {conn} is closed")));
        };
        let st = crate::stats::Stats::global();
        if !areg.windows {
            let key = areg.whole().and_then(|e| e.mr().map(|m| m.rkey));
            let key = key.ok_or_else(|| Error::Internal("the arena's region is not registered".into()))?;
            crate::stats::Stats::add(&st.c.verbs_shared_grants, 1);
            return Ok(Some(key));
        }
        // The extent the window lies in; a new one is registered here
        // (tools and tests, on their own threads), or, on an event thread
        // and under the node's protocol lock (every grant the protocol
        // makes, `rdev_recv`'s included), by `rdev-verbs-setup` while the
        // bind waits in the connection's queue (see `mr::arena`).
        let (ext, new) = areg.cover(off, len)?;
        if new {
            let (sh, ext, pd) = (self.shared.clone(), ext.clone(), areg.pd().clone());
            let register = move || register_extent(&sh, &ext, &pd);
            if !crate::fabric::may_block() {
                super::progress::worker::spawn(move || {
                    let _ = register();
                });
            } else {
                register()?;
            }
        }
        let mut windows = self.lst.windows.lock();
        // Revoke whatever was granted over this range before (entries never
        // overlap, so walking back from `end` stops at the first that ends
        // at or before `off`).
        let over: Vec<u64> = windows.range(..end).rev().take_while(|(_, (e, _))| *e > off).map(|(s, _)| *s).collect();
        for s in over {
            if let Some((_, mw)) = windows.remove(&s) {
                mw.revoke();
            }
        }
        let mw = Mw::alloc(&dev.pd, &ext, areg.base + off, len)?;
        let rkey = mw.rkey;
        let acts = c.bind(mw.clone())?;
        windows.insert(off, (end, mw));
        drop(windows);
        // Under the node's protocol lock: `run_actions` defers what the
        // connection owes (a failed bind's Kill) rather than run it here.
        progress::run_actions(&self.shared, &c, acts);
        Ok(Some(rkey))
    }

    fn close_conn(&self, conn: ConnId) {
        if self.lst.conns.lock().contains(&conn) {
            self.shared.request(Request::Kill(conn, Error::Aborted("connection closed locally".into())));
        }
    }

    fn shutdown(&self) {
        if !self.closed.swap(true, Ordering::SeqCst) {
            self.shared.request(Request::CloseListener(self.lst.token));
        }
    }
}

/// Register arena extent `ext` and post the binds that waited for it.
fn register_extent(sh: &Arc<Shared>, ext: &Arc<super::mr::arena::Extent>, pd: &Arc<super::device::Pd>) -> Result<()> {
    let t = std::time::Instant::now();
    let waiting = ext.register(pd).map_err(|e| {
        log::warn!("verbs: registering arena bytes {}..{}: {e}", ext.start, ext.end);
        e
    })?;
    log::debug!("verbs: arena bytes {}..{} registered in {:?}", ext.start, ext.end, t.elapsed());
    for id in waiting {
        let c = sh.conns.lock().get(&id).cloned();
        if let Some(c) = c {
            let acts = c.pump_now();
            progress::run_actions(sh, &c, acts);
        }
    }
    Ok(())
}

impl Drop for VerbsListener {
    fn drop(&mut self) {
        self.shutdown();
    }
}
