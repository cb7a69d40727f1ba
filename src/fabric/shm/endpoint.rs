//! Sending side of the shm backend: the receiver's arena mapped into our
//! address space, its doorbell ring, and a reader thread for its control
//! messages.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::copy::CopyPool;
use super::ring::{Doorbell, Ring};
use super::socket::{self, KIND_ACCEPT, KIND_HELLO, KIND_MSG, KIND_REFUSE};
use crate::error::{Error, Result};

/// How long a write waits for room in a full doorbell ring (8192 entries
/// the receiver has not taken yet) before it fails: only a receiver whose
/// progress thread has stopped gets there.
const RING_FULL_TIMEOUT: Duration = Duration::from_secs(10);
use crate::fabric::arena::{check_range, check_sealed, map_shared};
use crate::fabric::{next_conn_id, ConnId, Endpoint, FabricEvents, TransportKind, WriteOp};

pub struct ShmEndpoint {
    id: ConnId,
    remote: String,
    stream: UnixStream,
    write_lock: Mutex<()>,
    push_lock: Mutex<()>,
    arena: *mut u8,
    arena_len: usize,
    ring: Ring,
    doorbell: Doorbell,
    peer_hello: Vec<u8>,
    dead: Arc<AtomicBool>,
    copier: &'static CopyPool,
}

// SAFETY: `arena` is a shared mapping owned by this struct for its whole
// life; concurrent writes target disjoint slots (the rendezvous protocol
// hands each slot to one writer at a time).
unsafe impl Send for ShmEndpoint {}
// SAFETY: as above.
unsafe impl Sync for ShmEndpoint {}

impl ShmEndpoint {
    pub(super) fn handshake(
        stream: UnixStream,
        remote: &str,
        hello: &[u8],
        events: Arc<dyn FabricEvents>,
        deadline: Instant,
        copier: &'static CopyPool,
    ) -> Result<Arc<ShmEndpoint>> {
        // A connection closed before any answer: the listener went away
        // between our connect and its accept (a task shutting down or
        // restarting): nobody listens there now, as when connect is refused.
        let gone = |e: Error| match e {
            Error::PeerLost(m) => Error::NotViable(format!("shm handshake with {remote}: the listener closed the connection before answering ({m})")),
            e => e.context(&format!("shm handshake with {remote}")),
        };
        socket::send_frame(&stream, KIND_HELLO, hello, &[]).map_err(gone)?;
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100));
        stream.set_read_timeout(Some(left))?;
        let (kind, body, mut fds) = socket::recv_frame(&stream).map_err(gone)?;
        stream.set_read_timeout(None)?;
        match kind {
            KIND_ACCEPT => {}
            KIND_REFUSE => {
                return Err(Error::NotViable(format!(
                    "{remote} refused the shm connection: {}",
                    String::from_utf8_lossy(&body)
                )))
            }
            k => return Err(Error::Protocol(format!("shm handshake with {remote}: unexpected frame kind {k}"))),
        }
        if body.len() < 8 || fds.len() != 3 {
            return Err(Error::Protocol(format!(
                "shm handshake with {remote}: malformed accept ({} bytes, {} descriptors)",
                body.len(),
                fds.len()
            )));
        }
        let arena_len = u64::from_le_bytes(body[..8].try_into().expect("8 bytes")) as usize;
        let doorbell = Doorbell::from_fd(fds.pop().expect("3 fds"));
        let ring = Ring::map(fds.pop().expect("3 fds"))?;
        let arena_fd = fds.pop().expect("3 fds");
        check_sealed(arena_fd.as_raw_fd(), &format!("shm handshake with {remote}: the arena"))?;
        // SAFETY: fstat into a zeroed struct on a valid fd.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(arena_fd.as_raw_fd(), &mut st) } != 0 || (st.st_size as usize) < arena_len || arena_len == 0 {
            return Err(Error::Protocol(format!("shm handshake with {remote}: arena descriptor smaller than announced")));
        }
        let arena = map_shared(arena_fd.as_raw_fd(), arena_len)?;
        let ep = Arc::new(ShmEndpoint {
            id: next_conn_id(),
            remote: remote.to_string(),
            stream,
            write_lock: Mutex::new(()),
            push_lock: Mutex::new(()),
            arena,
            arena_len,
            ring,
            doorbell,
            peer_hello: body[8..].to_vec(),
            dead: Arc::new(AtomicBool::new(false)),
            copier,
        });
        // The reader holds only a clone of the socket, so dropping the last
        // endpoint handle closes the connection (see Drop).
        let reader = ep.stream.try_clone()?;
        let (id, dead) = (ep.id, ep.dead.clone());
        std::thread::Builder::new()
            .name("rdev-shm-reader".into())
            .spawn(move || {
                crate::fabric::mark_event_thread();
                let mut body = Vec::new();
                let why = loop {
                    match socket::recv_frame_into(&reader, &mut body) {
                        Ok((KIND_MSG, _)) => {
                            if let Err(e) = crate::error::catch_panic("handling an shm control message", || events.on_message(id, &body)) {
                                break e;
                            }
                        }
                        Ok((k, _)) => break Error::Protocol(format!("unexpected frame kind {k}")),
                        Err(e) => break e,
                    }
                };
                dead.store(true, Ordering::SeqCst);
                let _ = reader.shutdown(std::net::Shutdown::Both);
                let _ = crate::error::catch_panic("reporting a disconnect", || events.on_disconnect(id, why));
            })
            .map_err(|e| Error::Io(format!("spawn shm reader thread: {e}")))?;
        Ok(ep)
    }

    fn lost(&self) -> Error {
        Error::PeerLost(format!("shm connection to {} is closed", self.remote))
    }
}

impl Endpoint for ShmEndpoint {
    fn id(&self) -> ConnId {
        self.id
    }

    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn peer_hello(&self) -> &[u8] {
        &self.peer_hello
    }

    fn remote_len(&self) -> u64 {
        self.arena_len as u64
    }

    fn write(&self, remote_off: u64, _key: u32, imm: u32, done: Box<dyn WriteOp>) {
        if self.dead.load(Ordering::SeqCst) {
            return done.complete(Err(self.lost()));
        }
        let segs = done.segments();
        let total = segs.iter().try_fold(0usize, |t, s| t.checked_add(s.len()));
        let checked = total.ok_or_else(|| Error::InvalidArgument("write size overflows".into())).and_then(|t| check_range(remote_off as usize, t, self.arena_len));
        if let Err(e) = checked {
            drop(segs);
            return done.complete(Err(e));
        }
        let mut off = remote_off as usize;
        for b in &segs {
            // SAFETY: [off, off+len) was checked to lie inside the mapping
            // (which the slot protocol gives to this write alone); the
            // source is a live slice that cannot overlap our mapping.
            unsafe { self.copier.copy(b.as_ptr(), self.arena.add(off), b.len()) };
            off += b.len();
        }
        drop(segs);
        let wake = {
            let _g = self.push_lock.lock();
            let mut tries = 0u32;
            let mut full_since: Option<Instant> = None;
            loop {
                if let Some(w) = self.ring.try_push(imm) {
                    break w;
                }
                if self.dead.load(Ordering::SeqCst) {
                    return done.complete(Err(self.lost()));
                }
                // Full ring: the receiver is behind. Back off gently, and
                // give up on a receiver that stopped draining it.
                tries += 1;
                if tries == 100 {
                    full_since = Some(Instant::now());
                }
                if full_since.is_some_and(|t| t.elapsed() >= RING_FULL_TIMEOUT) {
                    return done.complete(Err(Error::Timeout(format!(
                        "{}'s doorbell ring stayed full for {RING_FULL_TIMEOUT:?}: the receiver stopped taking writes",
                        self.remote
                    ))));
                }
                if tries < 100 {
                    std::hint::spin_loop();
                } else {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        };
        if wake {
            self.doorbell.ring();
        }
        done.complete(Ok(()))
    }

    fn send_msg(&self, msg: &[u8]) -> Result<()> {
        if self.dead.load(Ordering::SeqCst) {
            return Err(self.lost());
        }
        let _g = self.write_lock.lock();
        socket::send_frame(&self.stream, KIND_MSG, msg, &[])
    }

    fn close(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

impl Drop for ShmEndpoint {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        // SAFETY: exactly the mapping created in handshake.
        unsafe { libc::munmap(self.arena.cast(), self.arena_len) };
    }
}
