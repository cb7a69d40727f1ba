//! Sending side of the shm backend: the receiver's arena mapped into our
//! address space, its doorbell ring, and a reader thread for its control
//! messages.

use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::copy::CopyPool;
use super::outbox::{self, Backlog, Flushed, Outbox};
use super::ring::{Doorbell, Ring};
use super::socket::{self, KIND_ACCEPT, KIND_CHALLENGE, KIND_HELLO, KIND_MSG, KIND_REFUSE};
use crate::constants::CONTROL_SEND_TIMEOUT_MS;
use crate::error::{Error, Result};

/// How long a write's immediate waits for room in a full doorbell ring
/// (8192 entries the receiver has not taken yet) before the write fails:
/// only a receiver whose progress thread has stopped gets there. Nobody
/// waits meanwhile: the write is queued (see `RingBacklog`).
const RING_FULL_TIMEOUT: Duration = Duration::from_secs(10);

use crate::fabric::arena::{check_range, check_sealed, map_shared};
use crate::fabric::{next_conn_id, ConnId, Endpoint, FabricEvents, TransportKind, WriteOp};

pub struct ShmEndpoint {
    id: ConnId,
    remote: String,
    stream: UnixStream,
    outbox: Arc<Outbox>,
    arena: *mut u8,
    arena_len: usize,
    bells: Arc<RingBacklog>,
    peer_hello: Vec<u8>,
    dead: Arc<AtomicBool>,
    copier: &'static CopyPool,
}

/// The receiver's doorbell ring, and the writes whose immediates found it
/// full: they wait here, in order, for the `rdev-shm-send` thread (see
/// outbox.rs) to push them, instead of a thread spinning on the ring.
struct RingBacklog {
    ring: Ring,
    doorbell: Doorbell,
    remote: String,
    dead: Arc<AtomicBool>,
    q: Mutex<Pushes>,
}

struct Pushes {
    waiting: VecDeque<(u32, Box<dyn WriteOp>)>,
    /// When the receiver last took an immediate (or the backlog started).
    since: Instant,
    registered: bool,
}

impl RingBacklog {
    /// Push `imm` (the write's bytes are in place), or queue it behind
    /// the ones already waiting. `op` completes once it is pushed.
    fn push(self: &Arc<Self>, imm: u32, op: Box<dyn WriteOp>, remote: &str) {
        let mut q = self.q.lock();
        if q.waiting.is_empty() {
            if let Some(wake) = self.ring.try_push(imm) {
                drop(q);
                if wake {
                    self.doorbell.ring();
                }
                return op.complete(Ok(()));
            }
        }
        if q.waiting.try_reserve(1).is_err() {
            drop(q);
            return op.complete(Err(Error::ResourceExhausted(format!("queueing a write to {remote}'s full doorbell ring"))));
        }
        q.waiting.push_back((imm, op));
        if !q.registered {
            q.registered = true;
            q.since = Instant::now();
            drop(q);
            if let Err(e) = outbox::hand_to_sender(self.clone()) {
                self.fail_all(e);
            }
        }
    }

    fn fail_all(&self, e: Error) {
        let ops: Vec<_> = {
            let mut q = self.q.lock();
            q.registered = false;
            q.waiting.drain(..).map(|(_, op)| op).collect()
        };
        for op in ops {
            op.complete(Err(e.clone()));
        }
    }
}

impl Backlog for RingBacklog {
    fn abandon(&self, why: Error) {
        self.fail_all(why);
    }

    fn flush(&self) -> Flushed {
        let mut done = Vec::new();
        let mut wake = false;
        let outcome = {
            let mut q = self.q.lock();
            while let Some(&(imm, _)) = q.waiting.front() {
                let Some(w) = self.ring.try_push(imm) else { break };
                wake |= w;
                q.since = Instant::now();
                done.extend(q.waiting.pop_front().map(|(_, op)| op));
            }
            if q.waiting.is_empty() {
                q.registered = false;
                None
            } else if self.dead.load(Ordering::SeqCst) {
                Some(Error::PeerLost(format!("shm connection to {} is closed", self.remote)))
            } else if q.since.elapsed() >= RING_FULL_TIMEOUT {
                Some(Error::Timeout(format!(
                    "{}'s doorbell ring stayed full for {RING_FULL_TIMEOUT:?}: the receiver stopped taking writes",
                    self.remote
                )))
            } else {
                // Not under `q`: completing a write takes the protocol
                // lock and sends (a TF thread's small write would wait
                // behind it on `q`).
                drop(q);
                return self.finish(done, wake, Flushed::Waiting(None));
            }
        };
        match outcome {
            None => self.finish(done, wake, Flushed::Done),
            Some(e) => {
                let r = self.finish(done, wake, Flushed::Done);
                self.fail_all(e);
                r
            }
        }
    }
}

impl RingBacklog {
    fn finish(&self, done: Vec<Box<dyn WriteOp>>, wake: bool, r: Flushed) -> Flushed {
        if wake {
            self.doorbell.ring();
        }
        // Each completion on its own: one that panics (logged) neither
        // drops the others nor unwinds out of `flush` (the send thread
        // would drop this backlog while it still counts as registered).
        for op in done {
            let _ = crate::error::catch_panic("completing an shm write", || op.complete(Ok(())));
        }
        r
    }
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
        // restarting). PeerLost: the caller treats it as nobody listening.
        let gone = |e: Error| match e {
            Error::PeerLost(m) => Error::PeerLost(format!("shm handshake with {remote}: the listener closed the connection before answering ({m})")),
            e => e.context(&format!("shm handshake with {remote}")),
        };
        // The listener's error, of its kind (see `fabric::encode_refusal`).
        let refused = |body: &[u8]| crate::fabric::decode_refusal(body).context(&format!("{remote} refused the shm connection"));
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100));
        stream.set_read_timeout(Some(left))?;
        // The listener opens with its nonce for this connection; the hello
        // is signed over it (`FabricEvents::sign_hello`).
        let (kind, nonce, _) = socket::recv_frame(&stream).map_err(gone)?;
        match kind {
            KIND_CHALLENGE if nonce.len() == crate::fabric::NONCE_LEN => {}
            KIND_REFUSE => return Err(refused(&nonce)),
            k => return Err(Error::Protocol(format!("shm handshake with {remote}: expected the listener's nonce, got frame kind {k} of {} bytes", nonce.len()))),
        }
        let hello = events.sign_hello(hello, &nonce);
        socket::send_frame(&stream, KIND_HELLO, &hello, &[]).map_err(gone)?;
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100));
        stream.set_read_timeout(Some(left))?;
        let (kind, body, mut fds) = socket::recv_frame(&stream).map_err(gone)?;
        stream.set_read_timeout(None)?;
        match kind {
            KIND_ACCEPT => {}
            KIND_REFUSE => return Err(refused(&body)),
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
        let outbox = match Outbox::new(&stream, Duration::from_millis(CONTROL_SEND_TIMEOUT_MS), false) {
            Ok(o) => o,
            Err(e) => {
                // SAFETY: exactly the mapping made above.
                unsafe { libc::munmap(arena.cast(), arena_len) };
                return Err(e);
            }
        };
        let dead = Arc::new(AtomicBool::new(false));
        let q = Pushes { waiting: VecDeque::new(), since: Instant::now(), registered: false };
        let bells = Arc::new(RingBacklog { ring, doorbell, remote: remote.to_string(), dead: dead.clone(), q: Mutex::new(q) });
        let ep = Arc::new(ShmEndpoint {
            id: next_conn_id(),
            remote: remote.to_string(),
            stream,
            outbox,
            arena,
            arena_len,
            bells,
            peer_hello: body[8..].to_vec(),
            dead,
            copier,
        });
        // The reader holds only a clone of the socket, so dropping the last
        // endpoint handle closes the connection (see Drop).
        let reader = ep.stream.try_clone()?;
        let (id, dead, outbox) = (ep.id, ep.dead.clone(), ep.outbox.clone());
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
                // Our own send side may have failed the connection (the
                // peer read nothing): that is the reason, not the EOF.
                let why = outbox.failure().unwrap_or(why);
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
        self.bells.push(imm, done, &self.remote);
    }

    fn send_msg(&self, msg: &[u8]) -> Result<()> {
        if self.dead.load(Ordering::SeqCst) {
            return Err(self.lost());
        }
        self.outbox.send(msg)
    }

    fn post_msg(&self, msg: &[u8]) -> Result<()> {
        if self.dead.load(Ordering::SeqCst) {
            return Err(self.lost());
        }
        self.outbox.post(msg)
    }

    fn backlog(&self) -> usize {
        self.outbox.backlog()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::shm::ring::RingWord;
    use crate::fabric::Segs;

    type Seen = Arc<Mutex<Vec<(&'static str, bool)>>>;

    /// A write whose completion records itself, or panics.
    struct Op(&'static str, Seen, bool);

    impl WriteOp for Op {
        fn segments(&self) -> Segs<'_> {
            Segs::new()
        }
        fn complete(self: Box<Self>, r: Result<()>) {
            if self.2 {
                panic!("a write completion that panics");
            }
            self.1.lock().push((self.0, r.is_ok()));
        }
    }

    /// A write whose completion queues another write on the same backlog
    /// (as completing a tensor write may start the next one).
    struct Chained(Arc<RingBacklog>, Seen);

    impl WriteOp for Chained {
        fn segments(&self) -> Segs<'_> {
            Segs::new()
        }
        fn complete(self: Box<Self>, r: Result<()>) {
            self.1.lock().push(("chained", r.is_ok()));
            self.0.push(9, Box::new(Op("next", self.1.clone(), false)), "peer");
        }
    }

    fn backlog() -> Arc<RingBacklog> {
        Arc::new(RingBacklog {
            ring: Ring::create().unwrap(),
            doorbell: Doorbell::create().unwrap(),
            remote: "peer".into(),
            dead: Arc::new(AtomicBool::new(false)),
            q: Mutex::new(Pushes { waiting: VecDeque::new(), since: Instant::now(), registered: false }),
        })
    }

    /// Issue 30 (locks across callbacks): the send thread completes the
    /// writes it pushed without holding the backlog's lock, so a
    /// completion that queues the next write on the same connection (or a
    /// TF thread's small write) does not wait on it. Held, this completion
    /// deadlocked the send thread.
    #[test]
    fn a_completion_may_queue_the_next_write_on_its_own_connection() {
        let bells = backlog();
        while bells.ring.try_push(0).is_some() {}
        let seen: Seen = Arc::default();
        bells.push(1, Box::new(Chained(bells.clone(), seen.clone())), "peer");
        bells.push(2, Box::new(Op("b", seen.clone(), false)), "peer");
        // Room for one: the chained write is pushed while b still waits.
        bells.ring.poke(RingWord::Head, 1);
        let deadline = Instant::now() + Duration::from_secs(5);
        while seen.lock().len() < 3 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            bells.ring.drain(|_| {});
        }
        let got = seen.lock().clone();
        assert_eq!(got.len(), 3, "the writes stopped completing (the send thread is stuck?): {got:?}");
        assert!(got.iter().all(|(_, ok)| *ok), "{got:?}");
    }

    /// Review finding: a completion that panicked while the send thread
    /// flushed a doorbell backlog unwound out of `flush`; the thread
    /// dropped the backlog while it still counted as registered, so the
    /// writes queued behind it never completed (and later ones only
    /// queued). Each write behind it still completes, once, with Ok.
    #[test]
    fn a_panicking_completion_does_not_strand_the_writes_behind_it() {
        let bells = backlog();
        let mut n = 0u32;
        while bells.ring.try_push(n).is_some() {
            n += 1;
        }
        let seen: Seen = Arc::default();
        bells.push(1, Box::new(Op("panics", seen.clone(), true)), "peer");
        bells.push(2, Box::new(Op("b", seen.clone(), false)), "peer");
        bells.push(3, Box::new(Op("c", seen.clone(), false)), "peer");
        // The consumer's side of the same shared ring (a test thread).
        let consumer = &bells.ring;
        // Room for one: the send thread pushes the panicking one only.
        consumer.poke(RingWord::Head, 1);
        std::thread::sleep(Duration::from_millis(50));
        // Then room for all.
        consumer.drain(|_| {});
        let deadline = Instant::now() + Duration::from_secs(5);
        while seen.lock().len() < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(*seen.lock(), vec![("b", true), ("c", true)], "the writes behind a panicking completion");
        // And the backlog still works for the next write.
        bells.push(4, Box::new(Op("d", seen.clone(), false)), "peer");
        let deadline = Instant::now() + Duration::from_secs(5);
        while seen.lock().len() < 3 && Instant::now() < deadline {
            consumer.drain(|_| {});
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(seen.lock().last(), Some(&("d", true)));
    }
}
