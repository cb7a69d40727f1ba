//! The "remote memory device": the layer that moves bytes.
//!
//! A receiver exposes one [`Arena`] (registered memory) and *listens*; a
//! sender *connects* and may then write into the receiver's arena with
//! one-sided writes that carry a 32-bit immediate. The receiver learns of a
//! write only through [`FabricEvents::on_write_imm`], delivered after every
//! byte of it is visible. Small two-sided control messages flow both ways on
//! the same connection. There are no one-sided reads: a peer can only write,
//! and only where it was granted (`Listener::grant`).
//!
//! This layer owns connections, registration and completions. It knows
//! nothing of tensors, edges or steps (that is `rendezvous`), and it never
//! interprets the bytes it moves, including handshake payloads.
//!
//! Backends mirror each other (`shm/`, `verbs/`): the same file names and
//! the same type names, one [`Fabric`] trait, and [`Fabric::is_viable`] so
//! a backend can step aside with a reason instead of failing.

pub mod arena;
#[doc(hidden)]
pub mod conformance;
pub mod shm;
#[cfg(feature = "verbs")]
pub mod verbs;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use arena::Arena;

use crate::error::{Error, Result};

thread_local! {
    static EVENT_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Backends call this at the start of each thread that delivers
/// [`FabricEvents`] (progress, accept/reader threads). Work that may take
/// long or block (a tensor's copy or registration, TensorFlow's callbacks)
/// is then not done on it: the owner hands it to a thread of its own.
pub fn mark_event_thread() {
    EVENT_THREAD.with(|t| t.set(true));
}

/// Is the calling thread a backend's event thread (see `mark_event_thread`)?
pub fn on_event_thread() -> bool {
    EVENT_THREAD.with(|t| t.get())
}

/// While the returned guard lives, the calling thread counts as an event
/// thread (see `mark_event_thread`): a thread that delivers events for a
/// while (caller-driven progress, `Listener::poll`).
pub fn as_event_thread() -> AsEventThread {
    AsEventThread(EVENT_THREAD.with(|t| t.replace(true)))
}

pub struct AsEventThread(bool);

impl Drop for AsEventThread {
    fn drop(&mut self) {
        EVENT_THREAD.with(|t| t.set(self.0));
    }
}

thread_local! {
    static NO_BLOCKING: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// While the returned guard lives, the calling thread holds a lock that
/// others wait on (the node's protocol lock): backends treat it as an
/// event thread for work that may take long (registering or unpinning
/// memory), handing that work to a thread of their own. Nests.
pub fn no_blocking() -> NoBlocking {
    NO_BLOCKING.with(|d| d.set(d.get() + 1));
    NoBlocking(std::marker::PhantomData)
}

/// See [`no_blocking`]; not `Send`: it marks the thread that made it.
pub struct NoBlocking(std::marker::PhantomData<*const ()>);

impl Drop for NoBlocking {
    fn drop(&mut self) {
        NO_BLOCKING.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// Is the calling thread inside [`no_blocking`] (it holds the node's
/// protocol lock)? Then nothing may call back into the node here.
pub fn under_no_blocking() -> bool {
    NO_BLOCKING.with(|d| d.get() > 0)
}

/// May the calling thread do work that takes long (pin or unpin memory,
/// copy a tensor)? Not on an event thread, nor under [`no_blocking`].
pub fn may_block() -> bool {
    !on_event_thread() && !under_no_blocking()
}

/// Identifies one connection, unique within the process (across backends).
pub type ConnId = u64;

static NEXT_CONN_ID: AtomicU64 = AtomicU64::new(1);

/// A fresh process-unique connection id (backends call this).
pub fn next_conn_id() -> ConnId {
    NEXT_CONN_ID.fetch_add(1, Ordering::Relaxed)
}

/// Which backend serves a connection. Values are part of the C ABI.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransportKind {
    Shm,
    Verbs,
}

impl TransportKind {
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Shm => "shm",
            TransportKind::Verbs => "verbs",
        }
    }
}

/// One write: its source memory and its completion. The backend owns it
/// from [`Endpoint::write`] until it calls `complete`, exactly once, on
/// any thread, possibly before `write` returns (shm completes within the call); the
/// callee must not block for long. The segments stay valid and unchanged
/// until then (verbs may read them with the NIC).
pub trait WriteOp: Send {
    /// The bytes to write, back to back, in order (empty ones are skipped).
    fn segments(&self) -> Segs<'_>;
    fn complete(self: Box<Self>, r: Result<()>);
}

/// A write's source segments (a header and a payload, usually: inline).
pub type Segs<'a> = smallvec::SmallVec<[&'a [u8]; 4]>;

/// One piece of source memory for [`Endpoint::write_imm`].
pub type Segment = Box<dyn AsRef<[u8]> + Send>;

/// Completion of [`Endpoint::write_imm`] (as [`WriteOp::complete`]).
pub type WriteDone = Box<dyn crate::completion::Complete<Result<()>>>;

/// `write_imm`'s owned segments and closure as a [`WriteOp`]; the
/// segments are dropped before `done` runs.
struct SegWrite {
    segs: Vec<Segment>,
    done: WriteDone,
}

impl WriteOp for SegWrite {
    fn segments(&self) -> Segs<'_> {
        self.segs.iter().map(|s| (**s).as_ref()).collect()
    }

    fn complete(self: Box<Self>, r: Result<()>) {
        let SegWrite { segs, done } = *self;
        drop(segs);
        done.complete(r);
    }
}


/// Length of the nonce a receiver opens each connection with.
pub const NONCE_LEN: usize = 16;

/// A fresh random nonce for a connection being accepted (the kernel's
/// random source; never a counter or the clock: a nonce must not be
/// predictable by a peer that would pre-compute a proof).
pub fn new_nonce() -> Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    let mut got = 0;
    while got < NONCE_LEN {
        // SAFETY: writes at most NONCE_LEN - got bytes into n[got..].
        let r = unsafe { libc::getrandom(n[got..].as_mut_ptr().cast(), NONCE_LEN - got, 0) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::Internal(format!("getrandom for a connection nonce: {e}")));
        }
        got += r as usize;
    }
    Ok(n)
}

/// What a listener that is closing says to a connection it will not
/// take: a lost peer (it may come back: a server being deleted and made
/// again, a task restarting), not a task that does not run this transport.
/// A connect that waits for the listener retries it; none demotes the peer.
pub(crate) const LISTENER_CLOSING: &str = "the listener is shutting down";

/// A refusal's kind and message, for a handshake's refuse frame (both
/// backends): the sender gets the receiver's error as it was made.
pub(crate) fn encode_refusal(e: &Error) -> Vec<u8> {
    let code = match e {
        Error::InvalidArgument(_) => 1,
        // Strict mode is the sender's own to apply: the refusal says only
        // that this transport does not serve it.
        Error::NotViable(_) | Error::Strict(_) => 2,
        Error::PeerLost(_) => 3,
        Error::Aborted(_) | Error::PeerFailed(..) => 4,
        Error::Protocol(_) => 5,
        Error::ResourceExhausted(_) => 6,
        Error::Io(_) => 7,
        Error::Config(_) => 8,
        Error::Timeout(_) => 9,
        Error::Internal(_) => 10,
    };
    let mut v = vec![code];
    v.extend_from_slice(e.message().as_bytes());
    v
}

/// The error `encode_refusal` made (a malformed one is a protocol error).
pub(crate) fn decode_refusal(b: &[u8]) -> Error {
    let m = String::from_utf8_lossy(b.get(1..).unwrap_or_default()).into_owned();
    match b.first() {
        Some(1) => Error::InvalidArgument(m),
        Some(2) => Error::NotViable(m),
        Some(3) => Error::PeerLost(m),
        Some(4) => Error::Aborted(m),
        Some(6) => Error::ResourceExhausted(m),
        Some(7) => Error::Io(m),
        Some(8) => Error::Config(m),
        Some(9) => Error::Timeout(m),
        Some(10) => Error::Internal(m),
        _ => Error::Protocol(m),
    }
}

/// What a backend tells its owner. Calls come from the backend's own
/// threads (progress / connection threads); they must not block for long.
/// For one connection, `on_disconnect` is the last call.
pub trait FabricEvents: Send + Sync + 'static {
    /// A sender asks to connect with its handshake payload, on the
    /// connection this listener opened with `nonce` (fresh and random for
    /// each connection, [`NONCE_LEN`] bytes; see [`new_nonce`]). Return the
    /// reply payload to accept, or an error (sent back to the sender) to
    /// refuse.
    fn on_accept(&self, conn: ConnId, hello: &[u8], nonce: &[u8]) -> Result<Vec<u8>>;
    /// Sender side, before its hello goes out: the receiver opened this
    /// connection with `nonce`; return the hello to send (the node proves
    /// its cluster token over the nonce here). By default `hello` as given.
    fn sign_hello(&self, hello: &[u8], _nonce: &[u8]) -> Vec<u8> {
        hello.to_vec()
    }
    /// A write with immediate `imm` from `conn` has fully landed in our arena.
    fn on_write_imm(&self, conn: ConnId, imm: u32);
    /// A control message arrived on `conn` (either side of a connection).
    fn on_message(&self, conn: ConnId, msg: &[u8]);
    /// `conn` is gone (peer exited, connection error, local close).
    fn on_disconnect(&self, conn: ConnId, why: crate::error::Error);
    /// After `on_disconnect`: the sender of `conn` can no longer write into
    /// our arena (shm: its process is dead). Until then the slots it held
    /// stay quarantined. Backends whose disconnect already implies this
    /// (verbs: the QP is in error or destroyed, so no write of it can
    /// land) never call it; the node releases those slots at disconnect.
    fn on_sender_gone(&self, _conn: ConnId) {}
}

/// A backend.
pub trait Fabric: Send + Sync {
    fn kind(&self) -> TransportKind;

    /// `Ok` when this backend can run here; otherwise `Error::NotViable`
    /// with the reason (e.g. "no RDMA device found").
    fn is_viable(&self) -> Result<()>;

    /// `Ok` when this backend can reach the task at `remote` ("host:port"):
    /// shm only reaches tasks on this host. `Error::NotViable` says why not.
    fn reaches(&self, remote: &str) -> Result<()>;

    /// Accept senders at `local` ("host:port", the task's address) and let
    /// them write into `arena`.
    fn listen(
        &self,
        local: &str,
        arena: Arc<Arena>,
        events: Arc<dyn FabricEvents>,
    ) -> Result<Arc<dyn Listener>>;

    /// Connect as a sender to the receiver listening at `remote`.
    /// `hello` goes to the receiver's `on_accept`; its reply is
    /// [`Endpoint::peer_hello`]. Messages from the receiver and the
    /// disconnect arrive on `events` under the endpoint's id.
    /// `wait_for_listener`: nobody listening at `remote` is retried until
    /// `timeout` (a peer that is starting or restarting); when false it is
    /// final at once, `Error::NotViable` (the peer does not run this
    /// transport). Blocks the caller up to `timeout`.
    fn connect(
        &self,
        remote: &str,
        hello: &[u8],
        events: Arc<dyn FabricEvents>,
        timeout: Duration,
        wait_for_listener: bool,
    ) -> Result<Arc<dyn Endpoint>>;
}

/// Every backend this build has and the configuration allows, in the
/// configured order of preference. Backends that cannot run here are
/// still returned: the caller asks `is_viable()` and reports the reason.
pub fn build_all(cfg: &crate::config::Config) -> Vec<Arc<dyn Fabric>> {
    let mut out: Vec<Arc<dyn Fabric>> = Vec::new();
    for t in &cfg.transports {
        match t.as_str() {
            "shm" => out.push(Arc::new(
                shm::ShmFabric::new(Duration::from_micros(cfg.spin_us)).with_copy_threads(cfg.shm_copy_threads),
            )),
            #[cfg(feature = "verbs")]
            "verbs" => match verbs::VerbsFabric::from_config(cfg) {
                Ok(f) => out.push(f),
                Err(e) => log::info!("verbs backend unavailable: {e}"),
            },
            _ => {}
        }
    }
    out
}

/// Why `verbs` is absent from this build (for reports).
pub const VERBS_BUILT: bool = cfg!(feature = "verbs");

/// The receiving side: accepted connections.
pub trait Listener: Send + Sync {
    /// The address senders connect to (what `listen` was given).
    fn local_addr(&self) -> String;
    /// Send a control message to the sender on `conn`. Never waits for
    /// the peer.
    fn send_msg(&self, conn: ConnId, msg: &[u8]) -> Result<()>;
    /// `send_msg` that does no I/O on the calling thread where the backend
    /// can avoid it (shm: queued for its send thread; verbs: a post, as
    /// `send_msg`). For threads that must not touch the network at all
    /// (a received tensor's release on a TensorFlow thread).
    fn post_msg(&self, conn: ConnId, msg: &[u8]) -> Result<()> {
        self.send_msg(conn, msg)
    }
    /// Control messages and writes queued on `conn` that wait for the
    /// peer (shm: control messages its socket has not taken; verbs: work
    /// requests posted and not completed): a sender of many messages paces
    /// itself by it.
    fn backlog(&self, _conn: ConnId) -> usize {
        0
    }
    /// Let the sender on `conn` write `off..off+len` of the arena (a slot
    /// placed for it; page-aligned, not in use by anything else), and no
    /// one else: whatever any sender was granted there before is revoked.
    /// Returns the key the sender must pass to [`Endpoint::write_imm`] for
    /// that range; it reaches the sender in the Publish or Grow naming the
    /// range, which the caller sends only after this returned. shm: the
    /// range shows that sender's window (key unused, 0). verbs: a memory
    /// window bound to that sender's QP (key = its rkey), or on a device
    /// without type-2 windows the arena's shared region (see
    /// `verbs::listener`). `Ok(None)`: `conn` is not one of ours. On an
    /// event thread or under [`no_blocking`] (the node's protocol lock) it
    /// never blocks: what pins memory is handed to a backend thread and
    /// ordered before any message sent on `conn` afterwards; elsewhere it
    /// may pin, so the key is usable when it returns.
    fn grant(&self, conn: ConnId, off: u64, len: u64) -> Result<Option<u32>>;
    /// Drop one accepted connection (its `on_disconnect` follows).
    fn close_conn(&self, conn: ConnId);
    /// Stop accepting and close every connection.
    fn shutdown(&self);
    /// Caller-driven progress: deliver, on the calling thread, the writes
    /// that have landed and that no event thread has delivered yet, unless
    /// another thread is delivering them right now. Returns how many it
    /// delivered. Only between [`Listener::start_polling`] and
    /// [`Listener::stop_polling`]. The calling thread must hold no lock
    /// of the node's and may be made to run completions that run on an
    /// event thread (a waitable receive's wake-up).
    fn poll(&self) -> usize {
        0
    }
    /// A thread starts polling (see `poll`): senders stop waking this
    /// listener's event thread for every write while it does.
    fn start_polling(&self) {}
    /// The thread stops polling: a sleeping event thread is woken again by
    /// the next write, and what landed meanwhile is delivered.
    fn stop_polling(&self) {}
}

/// The sending side of one connection: may write into the peer's arena.
pub trait Endpoint: Send + Sync {
    fn id(&self) -> ConnId;
    fn kind(&self) -> TransportKind;
    /// The receiver's handshake reply.
    fn peer_hello(&self) -> &[u8];
    /// Length of the receiver's arena; writes must stay inside it.
    fn remote_len(&self) -> u64;
    /// Write `segs`, back to back, at `remote_off` in the peer's arena, then
    /// deliver `imm` to the peer. `key` is the one the receiver's
    /// `Listener::grant` gave for the range written (it travels with the
    /// slot); a write outside what that key grants fails (verbs: with a
    /// remote access error, and the connection breaks). `op` completes
    /// exactly once, whatever happens.
    fn write(&self, remote_off: u64, key: u32, imm: u32, op: Box<dyn WriteOp>);
    /// `write` of owned segments with a closure for completion (one
    /// allocation per write: for tests and tools, not the hot path).
    fn write_imm(&self, remote_off: u64, key: u32, segs: Vec<Segment>, imm: u32, done: WriteDone) {
        self.write(remote_off, key, imm, Box::new(SegWrite { segs, done }));
    }
    /// Send a control message (at most `constants::MAX_MSG_BYTES`). Never
    /// waits for the peer.
    fn send_msg(&self, msg: &[u8]) -> Result<()>;
    /// See `Listener::post_msg`.
    fn post_msg(&self, msg: &[u8]) -> Result<()> {
        self.send_msg(msg)
    }
    /// See `Listener::backlog`.
    fn backlog(&self) -> usize {
        0
    }
    /// Close the connection (the peer sees a disconnect).
    fn close(&self);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_blocking_nests_and_marks_only_its_thread() {
        assert!(may_block());
        let outer = no_blocking();
        let inner = no_blocking();
        assert!(!may_block());
        drop(inner);
        assert!(!may_block(), "the outer guard still holds");
        assert!(std::thread::spawn(may_block).join().unwrap(), "another thread is not marked");
        drop(outer);
        assert!(may_block());
        let t = std::thread::spawn(|| {
            mark_event_thread();
            may_block()
        });
        assert!(!t.join().unwrap(), "an event thread may not block");
    }
}
