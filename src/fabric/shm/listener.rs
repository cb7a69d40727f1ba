//! Receiving side of the shm backend: accept thread, one reader thread per
//! connection (control messages, disconnect), one progress thread that
//! polls every doorbell ring and delivers write completions.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use super::outbox::Outbox;
use super::ring::{Doorbell, Ring};
use super::socket::{self, KIND_ACCEPT, KIND_CHALLENGE, KIND_HELLO, KIND_MSG, KIND_REFUSE};
use crate::constants::CONTROL_SEND_TIMEOUT_MS;
use crate::error::{Error, Result};
use crate::fabric::arena::Window;
use crate::fabric::{next_conn_id, Arena, ConnId, FabricEvents, Listener};

/// How long an accepted socket may take to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

struct RxConn {
    id: ConnId,
    stream: UnixStream,
    /// Control messages to the sender (never waits; see outbox.rs).
    outbox: Arc<Outbox>,
    ring: Ring,
    /// Set by the reader thread when the connection ends; the progress
    /// thread drains the ring once more and then reports the disconnect, so
    /// `on_disconnect` is always the connection's last event.
    closed: Mutex<Option<Error>>,
    /// The sender's own view of the arena (None where the page size rules
    /// windows out: it then maps the whole arena).
    window: Option<Arc<Window>>,
    /// Without a window only: the sender's process (None: our own process,
    /// or no pidfd support); its slots stay quarantined after the
    /// connection ends until it exits. With a window nothing it writes
    /// later reaches a slot placed for anyone else, so none is needed.
    pidfd: Mutex<Option<OwnedFd>>,
}

struct Inner {
    addr: String,
    name: Vec<u8>,
    arena: Arc<Arena>,
    events: Arc<dyn FabricEvents>,
    doorbell: Doorbell,
    conns: Mutex<HashMap<ConnId, Arc<RxConn>>>,
    /// Connections the node accepted whose reply is not sent yet: their
    /// outboxes are corked, so what the node sends on them meanwhile (any
    /// thread may, from `on_accept` on) follows the reply, in order.
    accepting: Mutex<HashMap<ConnId, Arc<Outbox>>>,
    /// Snapshot the progress thread polls without taking `conns`.
    polled: RwLock<Arc<Vec<Arc<RxConn>>>>,
    stop: AtomicBool,
    /// Ended connections whose sender process may still be writing.
    departed: Mutex<Vec<(ConnId, OwnedFd)>>,
    listen_fd: OwnedFd,
    spin: Duration,
    /// Held by whichever thread drains the rings: the progress thread
    /// (one pass at a time), or a thread polling for its own receive
    /// (`Listener::poll`). A ring has one consumer at a time.
    draining: Mutex<()>,
    /// The progress thread sleeps on the doorbell (set before it tells the
    /// rings it sleeps, cleared after it woke).
    asleep: AtomicBool,
    /// Threads polling (`start_polling` .. `stop_polling`). While there is
    /// one, the rings say "awake", so senders do not ring the doorbell.
    pollers: AtomicUsize,
}

pub struct ShmListener {
    inner: Arc<Inner>,
}

impl ShmListener {
    pub fn start(
        local: &str,
        arena: Arc<Arena>,
        events: Arc<dyn FabricEvents>,
        spin: Duration,
    ) -> Result<Arc<ShmListener>> {
        let name = socket::socket_name(local)?;
        let listen_fd = socket::listen(&name)?;
        let inner = Arc::new(Inner {
            addr: local.to_string(),
            name,
            arena,
            events,
            doorbell: Doorbell::create()?,
            conns: Mutex::new(HashMap::new()),
            accepting: Mutex::new(HashMap::new()),
            polled: RwLock::new(Arc::new(Vec::new())),
            stop: AtomicBool::new(false),
            departed: Mutex::new(Vec::new()),
            listen_fd,
            spin,
            draining: Mutex::new(()),
            asleep: AtomicBool::new(false),
            pollers: AtomicUsize::new(0),
        });
        let a = inner.clone();
        std::thread::Builder::new()
            .name("rdev-shm-accept".into())
            .spawn(move || {
                let _ = crate::error::catch_panic("the shm accept thread", || accept_loop(a));
            })
            .map_err(|e| Error::Io(format!("spawn accept thread: {e}")))?;
        let p = inner.clone();
        std::thread::Builder::new()
            .name("rdev-shm-progress".into())
            .spawn(move || guarded_progress(p))
            .map_err(|e| Error::Io(format!("spawn progress thread: {e}")))?;
        Ok(Arc::new(ShmListener { inner }))
    }
}

impl ShmListener {
    fn outbox(&self, conn: ConnId) -> Result<Arc<Outbox>> {
        if let Some(o) = self.inner.accepting.lock().get(&conn) {
            return Ok(o.clone());
        }
        let c = self.inner.conns.lock().get(&conn).map(|c| c.outbox.clone());
        c.ok_or_else(|| Error::PeerLost(format!("connection {conn} is closed")))
    }
}

impl Listener for ShmListener {
    fn local_addr(&self) -> String {
        self.inner.addr.clone()
    }

    fn send_msg(&self, conn: ConnId, msg: &[u8]) -> Result<()> {
        self.outbox(conn)?.send(msg)
    }

    fn post_msg(&self, conn: ConnId, msg: &[u8]) -> Result<()> {
        self.outbox(conn)?.post(msg)
    }

    fn backlog(&self, conn: ConnId) -> usize {
        self.outbox(conn).map_or(0, |o| o.backlog())
    }

    fn grant(&self, conn: ConnId, off: u64, len: u64) -> Result<Option<u32>> {
        let Some(c) = self.inner.conns.lock().get(&conn).cloned() else { return Ok(None) };
        if let Some(w) = &c.window {
            self.inner.arena.show(off as usize, len as usize, Some(w))?;
        }
        // The window is the isolation; no key.
        Ok(Some(0))
    }

    fn close_conn(&self, conn: ConnId) {
        if let Some(c) = self.inner.conns.lock().get(&conn) {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
        }
    }

    fn shutdown(&self) {
        if self.inner.stop.swap(true, Ordering::SeqCst) {
            return;
        }
        // Wake the accept thread with a connection of our own.
        let _ = socket::connect(&self.inner.name);
        for c in self.inner.conns.lock().values() {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
        }
        self.inner.doorbell.ring();
    }

    fn poll(&self) -> usize {
        let inner = &self.inner;
        let Some(_draining) = inner.draining.try_lock() else { return 0 };
        let _event = crate::fabric::as_event_thread();
        let conns = inner.polled.read().clone();
        let mut found = 0;
        for c in conns.iter() {
            // An ended connection's last drain and its disconnect are the
            // progress thread's (in that order).
            if c.closed.lock().is_none() {
                found += c.ring.drain(|imm| inner.events.on_write_imm(c.id, imm));
            }
        }
        found
    }

    fn start_polling(&self) {
        self.inner.pollers.fetch_add(1, Ordering::SeqCst);
        for c in self.inner.polled.read().iter() {
            c.ring.set_sleeping(false);
        }
    }

    fn stop_polling(&self) {
        let inner = &self.inner;
        // The last poller out gives a sleeping progress thread its
        // doorbell back. Read `asleep` after our own "awake" stores: if the
        // progress thread went to sleep before them, we see it here (it
        // sets `asleep` before its own "sleeping" stores), and if after,
        // its stores came last. Either way a sleeping progress thread ends
        // with every ring saying so.
        if inner.pollers.fetch_sub(1, Ordering::SeqCst) == 1 && inner.asleep.load(Ordering::SeqCst) {
            let conns = inner.polled.read().clone();
            for c in conns.iter() {
                c.ring.set_sleeping(true);
            }
            // Writes pushed while the rings said "awake" rang nothing.
            if conns.iter().any(|c| c.ring.has_entries()) && self.poll() == 0 {
                inner.doorbell.ring();
            }
        }
    }
}

impl Drop for ShmListener {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(inner: Arc<Inner>) {
    loop {
        let s = socket::accept(&inner.listen_fd);
        if inner.stop.load(Ordering::SeqCst) {
            return;
        }
        match s {
            Ok(s) => {
                let i = inner.clone();
                let spawned = std::thread::Builder::new()
                    .name("rdev-shm-conn".into())
                    .spawn(move || {
                        let _ = crate::error::catch_panic("an shm connection thread", || serve_conn(i, s));
                    });
                if let Err(e) = spawned {
                    log::error!("shm: cannot spawn a connection thread: {e}");
                }
            }
            Err(e) => {
                log::warn!("shm accept on {}: {e}", inner.addr);
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Handshake, then read control messages until the connection ends.
fn serve_conn(inner: Arc<Inner>, stream: UnixStream) {
    crate::fabric::mark_event_thread();
    let id = next_conn_id();
    let conn = match handshake(&inner, id, stream) {
        Ok(c) => c,
        Err(e) => {
            log::warn!("shm: refused a connection to {}: {e}", inner.addr);
            return;
        }
    };
    let mut body = Vec::new();
    let why = loop {
        match socket::recv_frame_into(&conn.stream, &mut body) {
            Ok((KIND_MSG, _)) => {
                if let Err(e) = crate::error::catch_panic("handling an shm control message", || inner.events.on_message(id, &body)) {
                    break e;
                }
            }
            Ok((kind, _)) => break Error::Protocol(format!("unexpected frame kind {kind} after handshake")),
            Err(e) => break e,
        }
    };
    // Our own send side may have failed the connection: that is the reason.
    let why = conn.outbox.failure().unwrap_or(why);
    let _ = conn.stream.shutdown(std::net::Shutdown::Both);
    *conn.closed.lock() = Some(why);
    inner.doorbell.ring();
}

fn handshake(inner: &Arc<Inner>, id: ConnId, stream: UnixStream) -> Result<Arc<RxConn>> {
    let (uid, pid) = socket::peer_cred(&stream)?;
    // SAFETY: getuid has no preconditions.
    let me = unsafe { libc::getuid() };
    if uid != me {
        let msg = format!("peer uid {uid} differs from ours ({me})");
        let e = Error::InvalidArgument(msg);
        let _ = socket::send_frame(&stream, KIND_REFUSE, &crate::fabric::encode_refusal(&e), &[]);
        return Err(e);
    }
    // The connection's nonce first: the sender's token proof must cover
    // it, so a hello recorded on another connection proves nothing here.
    let nonce = crate::fabric::new_nonce()?;
    socket::send_frame(&stream, KIND_CHALLENGE, &nonce, &[])?;
    stream.set_read_timeout(Some(HELLO_TIMEOUT))?;
    let (kind, hello, _) = socket::recv_frame(&stream)?;
    if inner.stop.load(Ordering::SeqCst) {
        // Said, not just dropped: the connector then treats this address
        // as a lost peer (its listener may come back), never as a task
        // that does not run this transport.
        let _ = socket::send_frame(&stream, KIND_REFUSE, &crate::fabric::encode_refusal(&Error::PeerLost(crate::fabric::LISTENER_CLOSING.into())), &[]);
        return Err(Error::Aborted("listener is shutting down".into()));
    }
    if kind != KIND_HELLO {
        return Err(Error::Protocol(format!("expected hello, got frame kind {kind}")));
    }
    stream.set_read_timeout(None)?;
    // What can fail is made before the node learns of the connection: once
    // it accepted, only the sender's going away ends the connection (and
    // then with `on_disconnect`, as every accepted connection ends).
    let ring = Ring::create()?;
    let window = if Arena::windows_supported() {
        Some(inner.arena.new_window()?)
    } else {
        log::warn!("shm: page size {} does not divide slot alignment: senders share one view of the arena", crate::fabric::arena::page_size());
        None
    };
    let outbox = Outbox::new(&stream, Duration::from_millis(CONTROL_SEND_TIMEOUT_MS), true)?;
    inner.accepting.lock().insert(id, outbox.clone());
    let reply = match inner.events.on_accept(id, &hello, &nonce) {
        Ok(r) => r,
        Err(e) => {
            inner.accepting.lock().remove(&id);
            let _ = socket::send_frame(&stream, KIND_REFUSE, &crate::fabric::encode_refusal(&e), &[]);
            return Err(e);
        }
    };
    let mut body = Vec::with_capacity(8 + reply.len());
    body.extend_from_slice(&(inner.arena.len() as u64).to_le_bytes());
    body.extend_from_slice(&reply);
    // A sender in our own process is not watched: it is gone when its
    // endpoint is (same trust as the rest of the process).
    let watch = window.is_none() && pid != std::process::id() as i32;
    let pidfd = if watch { socket::pidfd_open(pid) } else { None };
    if pidfd.is_none() && watch {
        log::warn!("shm: no pidfd for sender pid {pid}: its slots are freed as soon as its connection ends");
    }
    let view = window.as_ref().map(|w| w.fd()).unwrap_or(inner.arena.fd());
    let conn = Arc::new(RxConn { id, stream, outbox, ring, closed: Mutex::new(None), window, pidfd: Mutex::new(pidfd) });
    // Register before replying so the first write's doorbell is polled.
    inner.conns.lock().insert(id, conn.clone());
    inner.accepting.lock().remove(&id);
    refresh_polled(inner);
    // A sleeping progress thread would not poll the new ring: wake it.
    inner.doorbell.ring();
    // The reply, then what the node sent meanwhile (the outbox is corked
    // until then), before any other message.
    let sent = socket::send_frame(&conn.stream, KIND_ACCEPT, &body, &[view, conn.ring.fd(), inner.doorbell.fd()]);
    if sent.is_ok() {
        conn.outbox.uncork();
    }
    if let Err(e) = sent {
        // The sender is gone; the progress thread reports the disconnect.
        *conn.closed.lock() = Some(e.clone());
        inner.doorbell.ring();
        return Err(e);
    }
    Ok(conn)
}

fn refresh_polled(inner: &Inner) {
    let v: Vec<Arc<RxConn>> = inner.conns.lock().values().cloned().collect();
    *inner.polled.write() = Arc::new(v);
}

/// Report `on_sender_gone` for ended connections whose sender process has
/// exited (all of them with `all`). Never blocks.
fn release_departed(inner: &Inner, all: bool) {
    let gone: Vec<ConnId> = {
        let mut d = inner.departed.lock();
        if d.is_empty() {
            return;
        }
        let (gone, alive): (Vec<_>, Vec<_>) = std::mem::take(&mut *d).into_iter().partition(|(_, fd)| all || socket::pidfd_exited(fd));
        *d = alive;
        gone.into_iter().map(|(id, _)| id).collect()
    };
    for id in gone {
        inner.events.on_sender_gone(id);
    }
}

/// Run the progress loop; a panic in it fails every connection (their
/// waiters get the reason) and the loop starts over for new ones.
fn guarded_progress(inner: Arc<Inner>) {
    crate::fabric::mark_event_thread();
    loop {
        let Err(e) = crate::error::catch_panic("the shm progress thread", || progress_loop(inner.clone())) else { return };
        let rest: Vec<Arc<RxConn>> = inner.conns.lock().drain().map(|(_, c)| c).collect();
        refresh_polled(&inner);
        for c in rest {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
            let _ = crate::error::catch_panic("reporting a disconnect", || inner.events.on_disconnect(c.id, e.clone()));
        }
        if inner.stop.load(Ordering::SeqCst) {
            return;
        }
    }
}

/// Deliver completions; spin while busy, then sleep on the doorbell.
fn progress_loop(inner: Arc<Inner>) {
    let max_spin = Duration::from_micros(crate::constants::MAX_ADAPTIVE_SPIN_US).max(inner.spin);
    let mut idle_since = Instant::now();
    let mut window = inner.spin;
    loop {
        let draining = inner.draining.lock();
        let conns = inner.polled.read().clone();
        let mut found = 0;
        let mut ended = Vec::new();
        for c in conns.iter() {
            found += c.ring.drain(|imm| inner.events.on_write_imm(c.id, imm));
            if c.closed.lock().is_some() {
                ended.push(c.clone());
            }
        }
        for c in ended {
            // Final drain: writes that landed before the close still count.
            c.ring.drain(|imm| inner.events.on_write_imm(c.id, imm));
            inner.conns.lock().remove(&c.id);
            refresh_polled(&inner);
            let why = c.closed.lock().clone().unwrap_or_else(|| Error::PeerLost("closed".into()));
            inner.events.on_disconnect(c.id, why);
            match c.pidfd.lock().take() {
                Some(fd) if !socket::pidfd_exited(&fd) => inner.departed.lock().push((c.id, fd)),
                _ => inner.events.on_sender_gone(c.id),
            }
        }
        release_departed(&inner, false);
        if inner.stop.load(Ordering::SeqCst) {
            let rest: Vec<Arc<RxConn>> = inner.conns.lock().drain().map(|(_, c)| c).collect();
            refresh_polled(&inner);
            for c in rest {
                // `shutdown` may find `conns` already drained by us: close
                // the socket here too, or the sender never learns we left.
                let _ = c.stream.shutdown(std::net::Shutdown::Both);
                c.ring.drain(|imm| inner.events.on_write_imm(c.id, imm));
                inner.events.on_disconnect(c.id, Error::Aborted("listener shut down".into()));
            }
            // The node is going away: nothing is placed in its arena again.
            release_departed(&inner, true);
            return;
        }
        drop(draining);
        if found > 0 {
            // Adapt: keep polling across the gaps of a steady stream.
            let gap = idle_since.elapsed();
            // A stream of large writes (gaps beyond the cap) gains nothing
            // from polling: a wake-up is small next to the gap.
            window = if gap < max_spin { (gap * 2).clamp(inner.spin, max_spin) } else { Duration::ZERO };
            idle_since = Instant::now();
            continue;
        }
        if idle_since.elapsed() < window {
            std::hint::spin_loop();
            continue;
        }
        // Idle: see whether a departed sender has exited (at least every
        // doorbell timeout, below).
        release_departed(&inner, false);
        // Announce sleep, re-check, then block (see ring.rs for why this
        // cannot miss a wake-up; `stop_polling` for the threads that poll).
        inner.asleep.store(true, Ordering::SeqCst);
        // A thread that polls keeps the rings "awake" (it delivers their
        // writes); the last one to stop hands them back to us.
        if inner.pollers.load(Ordering::SeqCst) == 0 {
            for c in conns.iter() {
                c.ring.set_sleeping(true);
            }
        }
        let pending = conns.iter().any(|c| c.ring.has_entries() || c.closed.lock().is_some());
        if !pending {
            inner.doorbell.wait(200);
        }
        inner.asleep.store(false, Ordering::SeqCst);
        for c in conns.iter() {
            c.ring.set_sleeping(false);
        }
        idle_since = Instant::now();
        window = inner.spin;
    }
}
