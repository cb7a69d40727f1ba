//! What an shm connection sends without waiting: control messages (an
//! [`Outbox`] per connection) and the immediates of writes that found the
//! doorbell ring full (`endpoint::RingBacklog`).
//!
//! No caller ever waits for the peer. `Outbox::send` tries one
//! non-blocking `send(2)` when nothing is queued (the usual case: the
//! frame goes at once, on the caller's thread, as a verbs post would);
//! whatever the socket does not take is queued, in order, and the process's
//! one `rdev-shm-send` thread writes it when the socket has room.
//! `Outbox::post` always queues: the calling thread does no I/O at all
//! (a received tensor's release sends its credit this way). A connection
//! whose peer takes nothing for `CONTROL_SEND_TIMEOUT_MS` (stopped,
//! swapped out, not reading) fails: the socket is shut down, so its reader
//! reports the disconnect with that reason.
//!
//! Allocation: queued bytes go into a buffer each outbox keeps (grown with
//! `try_reserve`, capped at `MAX_QUEUED`); the send thread's lists keep
//! their capacity. A steady stream of messages allocates nothing.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::socket::{KIND_MSG, MAX_FRAME};
use crate::error::{Error, Result};

/// Most bytes queued on one connection (a worker RPC's reply may queue its
/// whole body at once); past it a send fails, and with it the link.
pub const MAX_QUEUED: usize = 1 << 30;

/// What `Backlog::flush` leaves.
pub(super) enum Flushed {
    /// Nothing left (sent, or failed and reported): forget it.
    Done,
    /// Still waiting for the peer; `Some(fd)`: poll it for room, `None`:
    /// try again in a millisecond.
    Waiting(Option<RawFd>),
}

/// Work the send thread finishes for a connection.
pub(super) trait Backlog: Send + Sync {
    /// Move what can move now, without waiting; fail what waited too long.
    fn flush(&self) -> Flushed;
    /// `flush` panicked: the send thread drops this backlog. Fail what it
    /// holds and leave it unregistered, so later work registers it again
    /// (or fails) instead of queueing behind a flush that never comes.
    fn abandon(&self, why: Error);
}

struct Queue {
    buf: Vec<u8>,
    /// Bytes of `buf` already sent.
    head: usize,
    /// Where each frame not wholly sent ends in `buf`, in order: how many
    /// messages wait for the peer (`Outbox::backlog`).
    ends: std::collections::VecDeque<usize>,
    /// When the peer last took bytes (or the queue started).
    since: Instant,
    /// Handed to the send thread (it calls `flush` until `Done`).
    registered: bool,
    /// Held until `uncork`: the handshake's reply must go first.
    corked: bool,
    failed: Option<Error>,
}

pub struct Outbox {
    stream: UnixStream,
    timeout: Duration,
    q: Mutex<Queue>,
}

impl Outbox {
    /// An outbox writing to (a clone of) `stream`; `corked`: queue
    /// everything until `uncork`.
    pub fn new(stream: &UnixStream, timeout: Duration, corked: bool) -> Result<Arc<Outbox>> {
        let stream = stream.try_clone().map_err(|e| Error::Io(format!("dup an shm socket: {e}")))?;
        let q = Queue { buf: Vec::with_capacity(4096), head: 0, ends: std::collections::VecDeque::with_capacity(64), since: Instant::now(), registered: false, corked, failed: None };
        Ok(Arc::new(Outbox { stream, timeout, q: Mutex::new(q) }))
    }

    /// Send a control message: at once if the socket takes it, else queued
    /// (in order). Never waits.
    pub fn send(self: &Arc<Self>, body: &[u8]) -> Result<()> {
        self.put(body, false)
    }

    /// Queue a control message for the send thread: no I/O on this thread.
    pub fn post(self: &Arc<Self>, body: &[u8]) -> Result<()> {
        self.put(body, true)
    }

    /// Control messages queued that the peer has not wholly taken: a
    /// sender of many messages paces itself by it (`Listener::backlog`).
    pub fn backlog(&self) -> usize {
        self.q.lock().ends.len()
    }

    /// Why the connection failed here, if it did (its reader reports this
    /// rather than the bare end of file the shutdown caused).
    pub fn failure(&self) -> Option<Error> {
        self.q.lock().failed.clone()
    }

    /// Let queued messages go (after the handshake's reply).
    pub fn uncork(self: &Arc<Self>) {
        let register = {
            let mut q = self.q.lock();
            q.corked = false;
            let r = q.buf.len() > q.head && !q.registered;
            if r {
                q.registered = true;
                q.since = Instant::now();
            }
            r
        };
        if register {
            self.register();
        }
    }

    fn put(self: &Arc<Self>, body: &[u8], post: bool) -> Result<()> {
        if body.len() > MAX_FRAME {
            return Err(Error::InvalidArgument(format!("message of {} bytes exceeds {MAX_FRAME}", body.len())));
        }
        let mut head = [0u8; 5];
        head[..4].copy_from_slice(&((body.len() + 1) as u32).to_le_bytes());
        head[4] = KIND_MSG;
        let mut q = self.q.lock();
        if let Some(e) = &q.failed {
            return Err(e.clone());
        }
        let mut skip = 0;
        if !post && !q.corked && q.buf.len() == q.head {
            match send_now(self.stream.as_raw_fd(), &[&head, body]) {
                Ok(n) if n == head.len() + body.len() => return Ok(()),
                Ok(n) => skip = n,
                Err(e) => return Err(self.fail(&mut q, e)),
            }
        }
        let frame_len = head.len() + body.len();
        let queued = q.buf.len() - q.head;
        if queued + frame_len - skip > MAX_QUEUED {
            let e = Error::ResourceExhausted(format!("{queued} bytes of control messages wait for a peer that is not reading"));
            return Err(self.fail(&mut q, e));
        }
        if let Err(e) = q.buf.try_reserve(frame_len - skip).map_err(|e| e.to_string()).and_then(|()| q.ends.try_reserve(1).map_err(|e| e.to_string())) {
            return Err(self.fail(&mut q, Error::ResourceExhausted(format!("queueing a control message: {e}"))));
        }
        // Part of the frame may be out already (`skip`): queue the rest.
        if skip < head.len() {
            q.buf.extend_from_slice(&head[skip..]);
            q.buf.extend_from_slice(body);
        } else {
            q.buf.extend_from_slice(&body[skip - head.len()..]);
        }
        let end = q.buf.len();
        q.ends.push_back(end);
        let register = !q.registered && !q.corked;
        if register {
            q.registered = true;
            q.since = Instant::now();
        }
        drop(q);
        if register {
            self.register();
        }
        Ok(())
    }

    fn register(self: &Arc<Self>) {
        if let Err(e) = hand_to_sender(self.clone()) {
            let mut q = self.q.lock();
            q.registered = false;
            self.fail(&mut q, e);
        }
    }

    /// Mark the outbox failed and shut the socket down (its reader then
    /// reports the disconnect); returns the error.
    fn fail(&self, q: &mut Queue, e: Error) -> Error {
        if q.failed.is_none() {
            q.failed = Some(e.clone());
            let _ = self.stream.shutdown(std::net::Shutdown::Both);
        }
        q.buf = Vec::new();
        q.head = 0;
        q.ends = std::collections::VecDeque::new();
        e
    }
}

impl Backlog for Outbox {
    fn abandon(&self, why: Error) {
        let mut q = self.q.lock();
        q.registered = false;
        self.fail(&mut q, why);
    }

    fn flush(&self) -> Flushed {
        let mut q = self.q.lock();
        if q.failed.is_some() {
            q.registered = false;
            return Flushed::Done;
        }
        while q.head < q.buf.len() {
            match send_now(self.stream.as_raw_fd(), &[&q.buf[q.head..]]) {
                Ok(0) => break,
                Ok(n) => {
                    q.head += n;
                    q.since = Instant::now();
                    let head = q.head;
                    while q.ends.front().is_some_and(|&end| end <= head) {
                        q.ends.pop_front();
                    }
                }
                Err(e) => {
                    self.fail(&mut q, e);
                    q.registered = false;
                    return Flushed::Done;
                }
            }
        }
        if q.head == q.buf.len() {
            q.buf.clear();
            q.head = 0;
            q.ends.clear();
            if q.buf.capacity() > (1 << 20) {
                q.buf.shrink_to(64 << 10);
            }
            q.registered = false;
            return Flushed::Done;
        }
        if q.since.elapsed() >= self.timeout {
            let e = Error::PeerLost(format!(
                "the peer read nothing from its shm control socket for {} ms (stopped, or not draining it)",
                self.timeout.as_millis()
            ));
            self.fail(&mut q, e);
            q.registered = false;
            return Flushed::Done;
        }
        if q.head > (64 << 10) && q.head * 2 > q.buf.len() {
            let h = q.head;
            q.buf.drain(..h);
            q.head = 0;
            for end in q.ends.iter_mut() {
                *end -= h;
            }
        }
        Flushed::Waiting(Some(self.stream.as_raw_fd()))
    }
}

/// One non-blocking `sendmsg` of `parts`: the bytes the socket took (0
/// when it is full). MSG_NOSIGNAL: a dead peer is an error, never SIGPIPE.
fn send_now(fd: RawFd, parts: &[&[u8]]) -> Result<usize> {
    let mut iov = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; 2];
    let n = parts.len().min(2);
    for (v, p) in iov.iter_mut().zip(parts) {
        *v = libc::iovec { iov_base: p.as_ptr() as *mut _, iov_len: p.len() };
    }
    // SAFETY: msghdr is POD; we fill the fields sendmsg reads.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = n;
    loop {
        // SAFETY: msg points to live buffers for the duration of the call.
        let r = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock => return Ok(0),
            _ => return Err(Error::PeerLost(format!("shm socket write: {e}"))),
        }
    }
}

/// The process's send thread: what it must finish, and how to wake it.
struct Sender {
    new: Mutex<Vec<Arc<dyn Backlog>>>,
    wake: OwnedFd,
}

/// Initial capacity of the send thread's lists.
const LISTS: usize = 256;

static SENDER: OnceLock<std::result::Result<Sender, String>> = OnceLock::new();

/// Hand `b` to the send thread (started on first use).
pub(super) fn hand_to_sender(b: Arc<dyn Backlog>) -> Result<()> {
    let s = SENDER.get_or_init(start).as_ref().map_err(|e| Error::Io(e.clone()))?;
    s.new.lock().push(b);
    let one: u64 = 1;
    // SAFETY: 8 bytes from a live u64 to our eventfd; a full counter
    // already means "wake up".
    unsafe { libc::write(s.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    Ok(())
}

fn start() -> std::result::Result<Sender, String> {
    // SAFETY: plain eventfd(2).
    let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if raw < 0 {
        return Err(format!("eventfd for the shm send thread: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: a fresh fd we own.
    let wake = unsafe { OwnedFd::from_raw_fd(raw) };
    let fd = wake.as_raw_fd();
    std::thread::Builder::new()
        .name("rdev-shm-send".into())
        .spawn(move || send_loop(fd))
        .map_err(|e| format!("spawn the shm send thread: {e}"))?;
    Ok(Sender { new: Mutex::new(Vec::with_capacity(LISTS)), wake })
}

/// Flush every registered backlog; sleep in poll(2) until a socket has
/// room, a new backlog comes, or (for ring backlogs) a millisecond passes.
fn send_loop(wake: RawFd) {
    crate::fabric::mark_event_thread();
    // Room for as many busy connections as a task usually has, so a burst
    // of them allocates nothing (more grow the lists once).
    let mut waiting: Vec<Arc<dyn Backlog>> = Vec::with_capacity(LISTS);
    let mut fresh: Vec<Arc<dyn Backlog>> = Vec::with_capacity(LISTS);
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(LISTS + 1);
    loop {
        if let Some(Ok(s)) = SENDER.get() {
            std::mem::swap(&mut *s.new.lock(), &mut fresh);
        }
        waiting.append(&mut fresh);
        fds.clear();
        fds.push(libc::pollfd { fd: wake, events: libc::POLLIN, revents: 0 });
        let mut timeout_ms = -1;
        waiting.retain(|b| match crate::error::catch_panic("flushing an shm connection", || b.flush()) {
            Ok(Flushed::Done) => false,
            Ok(Flushed::Waiting(Some(fd))) => {
                fds.push(libc::pollfd { fd, events: libc::POLLOUT, revents: 0 });
                if timeout_ms < 0 {
                    // Wake up to fail a peer that never takes anything.
                    timeout_ms = 100;
                }
                true
            }
            Ok(Flushed::Waiting(None)) => {
                timeout_ms = 1;
                true
            }
            Err(e) => {
                log::error!("shm send thread: {e}");
                let _ = crate::error::catch_panic("abandoning an shm connection's backlog", || b.abandon(e));
                false
            }
        });
        // SAFETY: `fds` holds `fds.len()` valid pollfds.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
        if fds[0].revents & libc::POLLIN != 0 {
            let mut v: u64 = 0;
            // SAFETY: non-blocking read of 8 bytes into a live u64.
            unsafe { libc::read(wake, (&mut v as *mut u64).cast(), 8) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::shm::socket::recv_frame;

    /// A peer that reads nothing never makes a sender wait: every send
    /// returns at once (queued past what the socket holds), and the
    /// connection fails after the timeout with the reason, its socket shut
    /// down so the reader learns of it.
    #[test]
    fn a_peer_that_reads_nothing_never_blocks_a_sender_and_fails_after_the_timeout() {
        let (a, b) = UnixStream::pair().unwrap();
        let ob = Outbox::new(&a, Duration::from_millis(300), false).unwrap();
        let body = vec![7u8; 60_000];
        let t0 = Instant::now();
        for i in 0..200 {
            let t = Instant::now();
            ob.send(&body).unwrap();
            assert!(t.elapsed() < Duration::from_millis(100), "send {i} waited {:?}", t.elapsed());
        }
        assert!(t0.elapsed() < Duration::from_secs(1));
        let err = loop {
            if let Some(e) = ob.failure() {
                break e;
            }
            assert!(t0.elapsed() < Duration::from_secs(5), "never failed");
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(t0.elapsed() >= Duration::from_millis(300), "failed before its timeout");
        assert!(err.to_string().contains("read nothing from its shm control socket for 300 ms"), "{err}");
        assert!(ob.send(b"x").is_err(), "a failed outbox took a message");
        // The socket was shut down: the peer reads what arrived, then EOF.
        let mut n = 0;
        while recv_frame(&b).is_ok() {
            n += 1;
        }
        assert!(n < 200, "everything arrived ({n}) though the outbox failed");
    }

    /// Sent and posted messages, some far larger than the socket's buffer,
    /// arrive complete and in order once the peer reads.
    #[test]
    fn messages_arrive_whole_and_in_order() {
        let (a, b) = UnixStream::pair().unwrap();
        let ob = Outbox::new(&a, Duration::from_secs(10), false).unwrap();
        let n = 300u32;
        for i in 0..n {
            let len = [10usize, 60_000, 1, 33_333][i as usize % 4];
            let mut body = vec![(i % 251) as u8; len];
            body[..4.min(len)].copy_from_slice(&i.to_le_bytes()[..4.min(len)]);
            if i % 3 == 0 {
                ob.post(&body).unwrap();
            } else {
                ob.send(&body).unwrap();
            }
        }
        for i in 0..n {
            let (kind, body, _) = recv_frame(&b).unwrap();
            assert_eq!(kind, KIND_MSG);
            let len = [10usize, 60_000, 1, 33_333][i as usize % 4];
            assert_eq!(body.len(), len, "message {i}");
            let mut want = vec![(i % 251) as u8; len];
            want[..4.min(len)].copy_from_slice(&i.to_le_bytes()[..4.min(len)]);
            assert!(body == want, "message {i} differs");
        }
        assert!(ob.failure().is_none());
    }

    /// A corked outbox holds everything until `uncork`: what was sent
    /// before comes after whatever went on the socket directly.
    #[test]
    fn a_corked_outbox_sends_after_uncork() {
        let (a, b) = UnixStream::pair().unwrap();
        let ob = Outbox::new(&a, Duration::from_secs(10), true).unwrap();
        ob.send(b"second").unwrap();
        ob.post(b"third").unwrap();
        b.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        assert!(recv_frame(&b).is_err(), "a corked outbox sent");
        crate::fabric::shm::socket::send_frame(&a, KIND_MSG, b"first", &[]).unwrap();
        ob.uncork();
        b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        for want in [&b"first"[..], b"second", b"third"] {
            assert_eq!(recv_frame(&b).unwrap().1, want);
        }
    }

    /// The backlog counts the messages the peer has not wholly taken, so
    /// that a sender of many (a worker RPC's 1 GiB body, in 64 KiB parts)
    /// paces itself on shm as on verbs: 0 when the socket took everything,
    /// every queued message while the peer reads nothing, 0 again once it
    /// has read them all. (It was always 0 on shm: the pacer never held
    /// back, and a reader more than 1 GiB behind failed the link.)
    #[test]
    fn the_backlog_counts_the_messages_the_peer_has_not_taken() {
        let (a, b) = UnixStream::pair().unwrap();
        let ob = Outbox::new(&a, Duration::from_secs(30), false).unwrap();
        ob.send(b"small").unwrap();
        assert_eq!(ob.backlog(), 0, "the socket took it at once");
        assert_eq!(recv_frame(&b).unwrap().1, b"small");
        let body = vec![3u8; 64 << 10];
        let n = 100;
        for _ in 0..n {
            ob.send(&body).unwrap();
        }
        // The socket holds a few; the rest wait, each counted once (a
        // frame partly in the socket counts until it is wholly out).
        let waiting = ob.backlog();
        assert!(waiting > n / 2 && waiting <= n, "{waiting} of {n} counted as waiting");
        for i in 0..n {
            let (_, got, _) = recv_frame(&b).unwrap();
            assert_eq!(got.len(), body.len(), "message {i}");
        }
        let t0 = Instant::now();
        while ob.backlog() > 0 {
            assert!(t0.elapsed() < Duration::from_secs(5), "{} still counted after the peer read everything", ob.backlog());
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(ob.failure().is_none());
    }
}
