//! The progress thread and the state it shares with the API faces.
//!
//! One thread per fabric does every CM transition and every teardown, and
//! polls the CQs: while completions come it busy-polls (and [`super::SPIN`]
//! beyond the last), then arms the CQs and blocks in `poll(2)` on the
//! completion channels, the CM channel and a wake-up eventfd. Because ids
//! and QPs are destroyed only here, and CM events are acknowledged as soon
//! as they are read, `rdma_destroy_id` never waits on an unacked event.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use rdma_sys::*;

use super::cm::{self, CmId, EventChannel};
use super::conn::{self, Action, Conn, Role, Sizing};
use super::device::{self, Context};
use super::hca::Device;
use super::{wr, VerbsOptions};

mod events;
mod handshakes;
mod listeners;
pub(crate) mod worker;
pub(crate) use listeners::ListenerShared;
use events::on_cm_event;
use crate::error::{Error, Result};
use crate::fabric::ConnId;

/// Listener tokens live above every connection id in the ids' `context`.
pub(crate) const LISTENER_BIT: u64 = 1 << 63;

pub(crate) enum Request {
    Kill(ConnId, Error),
    CloseListener(u64),
    /// An incoming handshake ended: admit the next waiting one.
    Tend,
}

pub(crate) struct Shared {
    pub opts: VerbsOptions,
    pub channel: Arc<EventChannel>,
    pub conns: Mutex<HashMap<ConnId, Arc<Conn>>>,
    by_qpn: Mutex<HashMap<(usize, u32), Arc<Conn>>>,
    pub listeners: Mutex<HashMap<u64, Arc<ListenerShared>>>,
    devices: Mutex<Vec<Arc<Device>>>,
    requests: Mutex<Vec<Request>>,
    wake: OwnedFd,
    stop: AtomicBool,
    thread: Mutex<Option<std::thread::ThreadId>>,
    /// Incoming connections in the handshake, and requests waiting for
    /// room (see `handshakes`).
    pub handshakes: Mutex<handshakes::Handshakes>,
}

pub(crate) struct Runtime {
    pub shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Runtime {
    pub fn start(opts: VerbsOptions) -> Result<Runtime> {
        let channel = EventChannel::new()?;
        // SAFETY: plain syscall; the fd is owned below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::last_os("eventfd"));
        }
        let shared = Arc::new(Shared {
            opts,
            channel,
            conns: Default::default(),
            by_qpn: Default::default(),
            listeners: Default::default(),
            devices: Default::default(),
            requests: Default::default(),
            // SAFETY: fd is fresh and ours.
            wake: unsafe { OwnedFd::from_raw_fd(fd) },
            stop: AtomicBool::new(false),
            thread: Mutex::new(None),
            handshakes: Default::default(),
        });
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("rdev-verbs".into())
            .spawn(move || {
                *sh.thread.lock() = Some(std::thread::current().id());
                crate::fabric::mark_event_thread();
                // A panic here must not unwind into libibverbs or kill TF.
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&sh))).is_err() {
                    log::error!("verbs: progress thread panicked; connections are lost");
                    kill_all(&sh, &Error::Internal("verbs progress thread panicked".into()));
                }
            })
            .map_err(|e| Error::Io(format!("spawning the verbs progress thread: {e}")))?;
        Ok(Runtime { shared, thread: Some(thread) })
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.wake();
        if let Some(t) = self.thread.take() {
            // The last owner may drop us from a callback on the progress
            // thread itself: it cannot join itself; it sees `stop` and ends
            // after the callback returns.
            if self.shared.on_progress_thread() {
                return;
            }
            if t.join().is_err() {
                log::warn!("verbs: progress thread ended with a panic");
            }
        }
    }
}

impl Shared {
    pub fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes from a valid u64 to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// See `VerbsFabric::mr_cache_usage`.
    pub fn mr_cache_usage(&self) -> Vec<(usize, u64)> {
        self.devices.lock().iter().map(|d| d.regs.usage()).collect()
    }

    /// See `VerbsFabric::arena_rkeys`.
    pub fn arena_rkeys(&self) -> Vec<u32> {
        self.devices.lock().iter().flat_map(|d| d.arenas.lock().values().flat_map(|a| a.rkeys()).collect::<Vec<_>>()).collect()
    }

    pub fn request(&self, r: Request) {
        self.requests.lock().push(r);
        self.wake();
    }

    fn on_progress_thread(&self) -> bool {
        *self.thread.lock() == Some(std::thread::current().id())
    }

    pub fn sizing(&self, role: Role) -> Sizing {
        let o = &self.opts;
        Sizing {
            slot: super::SLOT_BYTES,
            n_recv: o.srq_depth,
            n_send: super::SEND_BUFFERS,
            // Small buffers for zero-copy writes' headers: senders only.
            n_small: if role == Role::Active { super::SEND_BUFFERS } else { 0 },
            chunk: o.staging_chunk.max(4096),
            // Only senders write; a listener's connections need no staging.
            n_chunks: if role == Role::Active { o.staging_chunks } else { 0 },
            sq_depth: super::SQ_DEPTH,
            register_threshold: o.register_threshold,
        }
    }

    /// The device an id is bound to, opened on first use; checks overrides.
    /// Opening registers memory: never on the progress thread.
    pub fn device_for(&self, cm: &CmId, what: &str) -> Result<Arc<Device>> {
        self.device_at(cm.verbs(), cm.port_num(), what)
    }

    /// The device of context `ctx` (an id's), opened on first use (outside
    /// the devices' lock, which the progress thread takes every loop).
    pub fn device_at(&self, ctx: *mut ibv_context, port: u8, what: &str) -> Result<Arc<Device>> {
        if ctx.is_null() {
            return Err(Error::NotViable(format!("{what} is not on an RDMA device")));
        }
        let known = self.devices.lock().iter().find(|d| d.ctx.raw == ctx).cloned();
        let dev = match known {
            Some(d) => d,
            None => {
                debug_assert!(!self.on_progress_thread(), "a device is opened on the progress thread");
                // SAFETY: ctx comes from a bound rdma_cm id (librdmacm's
                // context, open for the life of the process).
                let d = Device::open(unsafe { Context::for_cm(ctx) }?, self.opts.srq_depth, self.opts.mr_cache_bytes, self.opts.mr_cache_trust_mappings)?;
                let mut devs = self.devices.lock();
                match devs.iter().find(|x| x.ctx.raw == ctx) {
                    // Opened meanwhile by another thread: use that one.
                    Some(x) => x.clone(),
                    None => {
                        log::info!(
                            "verbs: using {}; shared receive queue of {} x {} B; ACK timeout 2^{} x 4.096 us, retry {}, RNR retry {}{} (dead peer detected within {:?}); registration cache {}",
                            d.ctx.info.describe(),
                            d.srq.depth,
                            d.srq.slot,
                            self.opts.ack_timeout,
                            self.opts.retry_count,
                            self.opts.rnr_retry,
                            if self.opts.rnr_retry >= 7 { " (forever)" } else { "" },
                            self.opts.dead_peer_bound(),
                            if d.regs.caching() { format!("up to {} bytes", self.opts.mr_cache_bytes) } else { "off".into() }
                        );
                        devs.push(d.clone());
                        self.wake();
                        d
                    }
                }
            }
        };
        let info = &dev.ctx.info;
        if let Some(want) = &self.opts.device {
            if *want != info.name {
                return Err(Error::NotViable(format!(
                    "{what} is on RDMA device {} port {port}, but RDMA_DEVICE_VERBS_DEVICE={want}",
                    info.name
                )));
            }
        }
        if let Some(want) = self.opts.port {
            if want != port {
                return Err(Error::NotViable(format!(
                    "{what} is on {} port {port}, but RDMA_DEVICE_VERBS_PORT={want}",
                    info.name
                )));
            }
        }
        Ok(dev)
    }

    /// Which GID rdma_cm chose for `cm` (index and description), and the
    /// GID-index override check.
    pub fn check_gid(&self, dev: &Device, cm: &CmId, what: &str) -> Result<String> {
        let sgid = cm.sgid();
        let port = dev.ctx.info.ports.iter().find(|p| p.num == cm.port_num());
        let found = port.and_then(|p| p.gids.iter().find(|g| g.gid == sgid));
        let desc = match found {
            Some(g) => format!("{} port {} GID[{}] {} {} {}", dev.name(), cm.port_num(), g.index, device::gid_str(&g.gid), g.kind, g.netdev),
            None => format!("{} port {} GID {}", dev.name(), cm.port_num(), device::gid_str(&sgid)),
        };
        if let Some(want) = self.opts.gid_index {
            if found.map(|g| g.index) != Some(want) {
                return Err(Error::Config(format!(
                    "RDMA_DEVICE_VERBS_GID_INDEX={want}, but rdma_cm chose {desc} for {what}; \
                     use the address that GID {want} carries, or unset the override"
                )));
            }
        }
        Ok(desc)
    }

    fn register_qp(&self, dev: &Device, qpn: u32, conn: &Arc<Conn>) {
        self.by_qpn.lock().insert((dev.ctx.raw as usize, qpn), conn.clone());
    }
}

/// Run the callbacks a connection owes, outside every lock. A caller that
/// holds the node's protocol lock (`fabric::no_blocking`: a grant) gets
/// nothing run in place, since each callback, and a Kill's disconnect, may
/// take that lock: a Kill is requested from the progress thread (no lock,
/// no wait), the rest goes to `rdev-verbs-setup`.
pub(crate) fn run_actions(sh: &Arc<Shared>, c: &Arc<Conn>, acts: Vec<Action>) {
    if crate::fabric::under_no_blocking() && !acts.is_empty() {
        let mut rest = Vec::new();
        for a in acts {
            match a {
                Action::Kill(e) => sh.request(Request::Kill(c.id, e)),
                a => rest.push(a),
            }
        }
        if !rest.is_empty() {
            let (sh, c) = (sh.clone(), c.clone());
            worker::spawn(move || run_now(&sh, &c, rest));
        }
        return;
    }
    run_now(sh, c, acts);
}

fn run_now(sh: &Arc<Shared>, c: &Arc<Conn>, acts: Vec<Action>) {
    for a in acts {
        match a {
            // Run here, on any thread: a registration the write held that
            // is dropped here goes to rdev-verbs-dereg on its own (`Mr`).
            Action::WriteDone(f) => f.run(),
            Action::Imm(imm) => c.events.on_write_imm(c.id, imm),
            Action::Message(m) => c.events.on_message(c.id, &m),
            Action::Disconnect(e) => c.events.on_disconnect(c.id, e),
            Action::Accept(hello) if sh.on_progress_thread() => {
                // `on_accept` may wait for its node to finish starting:
                // never on the progress thread.
                let (sh, c) = (sh.clone(), c.clone());
                worker::spawn(move || accept_hello(&sh, &c, hello));
            }
            Action::Accept(hello) => accept_hello(sh, c, hello),
            Action::Copy => {
                crate::stats::Stats::add(&crate::stats::Stats::global().c.verbs_staged_copies_handed_off, 1);
                let (sh, c) = (sh.clone(), c.clone());
                worker::copy(move || {
                    let acts = c.pump_copying();
                    run_actions(&sh, &c, acts);
                });
            }
            Action::Kill(e) => {
                if sh.on_progress_thread() {
                    kill(sh, c, e);
                } else {
                    sh.request(Request::Kill(c.id, e));
                }
            }
        }
    }
}

/// The receiver's `on_accept` decides; its answer is the first message
/// back. On `rdev-verbs-setup` (handed over by the progress thread).
fn accept_hello(sh: &Arc<Shared>, c: &Arc<Conn>, hello: Vec<u8>) {
    let mut accepted = false;
    let nonce = c.inner.lock().nonce;
    let r = match c.events.on_accept(c.id, &hello, &nonce) {
        Ok(reply) => {
            accepted = true;
            handshakes::done(sh, c.id);
            c.accept_ok(reply)
        }
        Err(e) => {
            log::info!("verbs: conn {} refused by the receiver: {e}", c.id);
            // The sender closes on receipt; we stay in Handshake until then.
            c.send_msg(conn::MSG_HELLO_ERR, conn::encode_refusal(&e))
        }
    };
    match r {
        Ok(acts) => run_actions(sh, c, acts),
        Err(e) => {
            if accepted {
                // The connection died while its hello was being accepted
                // (off the progress thread, so its teardown owed no
                // disconnect yet): the owner, which now knows the link,
                // hears of it.
                c.events.on_disconnect(c.id, e.clone());
            }
            run_actions(sh, c, vec![Action::Kill(e)]);
        }
    }
}

pub(crate) fn kill(sh: &Arc<Shared>, c: &Arc<Conn>, why: Error) {
    let (dev, qpn) = {
        let i = c.inner.lock();
        (i.dev.as_ref().map(|d| d.ctx.raw as usize), i.qpn)
    };
    let acts = c.kill(&why);
    if let Some(d) = dev {
        sh.by_qpn.lock().remove(&(d, qpn));
    }
    sh.conns.lock().remove(&c.id);
    if c.role == Role::Passive {
        handshakes::done(sh, c.id);
        if let Some(l) = sh.listeners.lock().get(&c.listener) {
            l.conns.lock().remove(&c.id);
        }
    }
    if !acts.is_empty() {
        log::debug!("verbs: conn {} down: {why}", c.id);
    }
    run_actions(sh, c, acts);
}

fn kill_all(sh: &Arc<Shared>, why: &Error) {
    let conns: Vec<_> = sh.conns.lock().values().cloned().collect();
    for c in conns {
        kill(sh, &c, why.clone());
    }
    let tokens: Vec<u64> = sh.listeners.lock().keys().copied().collect();
    for t in tokens {
        close_listener(sh, t);
    }
    handshakes::drop_waiting(sh, None);
}

fn close_listener(sh: &Arc<Shared>, token: u64) {
    let Some(l) = sh.listeners.lock().remove(&token) else { return };
    handshakes::drop_waiting(sh, Some(token));
    drop(l.cm.lock().take());
    let ids: Vec<ConnId> = l.conns.lock().drain().collect();
    for id in ids {
        let c = sh.conns.lock().get(&id).cloned();
        if let Some(c) = c {
            kill(sh, &c, Error::Aborted("listener shut down".into()));
        }
    }
    for d in sh.devices.lock().iter() {
        d.arenas.lock().remove(&token);
    }
}

/// While busy-polling, how often the CM channel is checked (a `poll(2)`
/// of its fd, then `rdma_get_cm_event` only when it is readable): CM
/// events (connects, disconnects) are rare and not latency-critical, and
/// each check is a syscall the completion path should not pay per loop.
const CM_CHECK_EVERY: std::time::Duration = std::time::Duration::from_millis(1);

fn fd_readable(fd: i32) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, zero timeout.
    unsafe { libc::poll(&mut p, 1, 0) > 0 && p.revents & libc::POLLIN != 0 }
}

fn run(sh: &Arc<Shared>) {
    // SAFETY: ibv_wc is POD; zeroed entries are overwritten by ibv_poll_cq.
    let mut wcs: Vec<ibv_wc> = (0..32).map(|_| unsafe { std::mem::zeroed() }).collect();
    let mut busy_at = Instant::now();
    let mut cm_at = Instant::now();
    let mut cm_due = true;
    let mut tended_at: Option<Instant> = None;
    loop {
        if sh.stop.load(Ordering::SeqCst) {
            kill_all(sh, &Error::Aborted("verbs fabric shut down".into()));
            return;
        }
        let reqs = std::mem::take(&mut *sh.requests.lock());
        for r in reqs {
            match r {
                Request::Kill(id, why) => {
                    let c = sh.conns.lock().get(&id).cloned();
                    if let Some(c) = c {
                        kill(sh, &c, why);
                    }
                }
                Request::CloseListener(t) => close_listener(sh, t),
                Request::Tend => tended_at = None,
            }
        }
        if !matches!(tended_at, Some(t) if t.elapsed() < handshakes::TEND_EVERY) {
            handshakes::tend(sh);
            tended_at = Some(Instant::now());
        }
        if cm_due || cm_at.elapsed() >= CM_CHECK_EVERY {
            if cm_due || fd_readable(sh.channel.fd()) {
                // Completions first: a write the peer acknowledged before it
                // disconnected completes as it did, not as "peer lost".
                let devs: Vec<Arc<Device>> = sh.devices.lock().clone();
                for d in &devs {
                    poll_device(sh, d, &mut wcs);
                }
                while let Some(ev) = cm::next_event(&sh.channel) {
                    on_cm_event(sh, ev);
                }
            }
            cm_at = Instant::now();
            cm_due = false;
        }
        let devs: Vec<Arc<Device>> = sh.devices.lock().clone();
        let mut n = 0;
        for d in &devs {
            n += poll_device(sh, d, &mut wcs);
        }
        if n > 0 {
            busy_at = Instant::now();
            continue;
        }
        if busy_at.elapsed() < sh.opts.spin {
            std::hint::spin_loop();
            continue;
        }
        for d in &devs {
            for cq in d.cqs().iter() {
                // SAFETY: the CQ is live (the device is held by `devs`).
                unsafe { ibv_req_notify_cq(cq.raw, 0) };
            }
        }
        for d in &devs {
            n += poll_device(sh, d, &mut wcs);
        }
        if n > 0 {
            busy_at = Instant::now();
            continue;
        }
        let mut fds = vec![
            libc::pollfd { fd: sh.wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: sh.channel.fd(), events: libc::POLLIN, revents: 0 },
        ];
        fds.extend(devs.iter().map(|d| libc::pollfd { fd: d.channel.fd(), events: libc::POLLIN, revents: 0 }));
        // Handshakes in progress have deadlines (`handshakes::tend`).
        let wait_ms = if sh.handshakes.lock().counts() == (0, 0) { 1000 } else { handshakes::TEND_EVERY.as_millis() as i32 };
        // SAFETY: fds is a valid array of pollfd; bounded wait.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait_ms) };
        cm_due = fds[1].revents != 0;
        let mut buf = 0u64;
        // SAFETY: reading 8 bytes into a u64 from our non-blocking eventfd.
        unsafe { libc::read(sh.wake.as_raw_fd(), (&mut buf as *mut u64).cast(), 8) };
        for d in &devs {
            drain_cq_events(d);
        }
        busy_at = Instant::now();
    }
}

/// Consume (and acknowledge) the channel's notifications.
fn drain_cq_events(d: &Device) {
    loop {
        let mut cq = std::ptr::null_mut();
        let mut ctx = std::ptr::null_mut();
        // SAFETY: the channel fd is non-blocking; out-pointers are valid.
        if unsafe { ibv_get_cq_event(d.channel.raw, &mut cq, &mut ctx) } != 0 {
            return;
        }
        // SAFETY: cq is the CQ the event was for (ours), acked once.
        unsafe { ibv_ack_cq_events(cq, 1) };
    }
}

fn poll_device(sh: &Arc<Shared>, d: &Arc<Device>, wcs: &mut [ibv_wc]) -> usize {
    let mut n = 0;
    for cq in d.cqs().iter() {
        n += poll_cq(sh, d, cq, wcs);
    }
    n
}

fn poll_cq(sh: &Arc<Shared>, d: &Arc<Device>, cq: &device::Cq, wcs: &mut [ibv_wc]) -> usize {
    // SAFETY: the CQ is live; wcs has room for wcs.len() entries.
    let n = unsafe { ibv_poll_cq(cq.raw, wcs.len() as i32, wcs.as_mut_ptr()) };
    if n < 0 {
        log::error!("verbs: ibv_poll_cq on {} failed ({n})", d.name());
        return 0;
    }
    for wc in &wcs[..n as usize] {
        // A shared receive buffer: hand its bytes to the connection, then
        // repost it whatever became of the connection (a completion of a
        // connection already torn down still returns the buffer). Receive
        // wr_ids carry no connection tag (the buffer is the device's), so a
        // stale receive completion of a destroyed QP whose number was
        // already reused would reach the new connection; providers do not
        // reuse QP numbers at once (rxe and mlx5 allocate them round-robin).
        let recv = match wr::decode(wc.wr_id) {
            Some((wr::WrKind::Recv, _, idx)) if idx < d.srq.depth => Some(idx),
            _ => None,
        };
        let c = sh.by_qpn.lock().get(&(d.ctx.raw as usize, wc.qp_num)).cloned();
        if let Some(c) = c {
            let bytes = recv.map(|i| {
                let len = (wc.byte_len as usize).min(d.srq.slot);
                // SAFETY: buffer i is ours until reposted below; the NIC
                // wrote `byte_len` bytes into it (bounded by the slot).
                unsafe { std::slice::from_raw_parts(d.srq.buf(i), len) }
            });
            let acts = c.complete(wc, bytes);
            run_actions(sh, &c, acts);
        }
        if let Some(i) = recv {
            if let Err(e) = d.srq.post(i) {
                log::warn!("verbs: {}: reposting receive buffer {i}: {e}", d.name());
            }
        }
    }
    n as usize
}
