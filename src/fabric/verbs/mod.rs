//! The RDMA verbs backend (libibverbs + librdmacm through `rdma-sys`): RC
//! queue pairs bootstrapped by rdma_cm on the task's "host:port".
//!
//! Owns: device discovery and viability, registration (the receiver's arena
//! per device in chunk-aligned extents registered as slots are placed
//! (`mr::arena`), reached by peers only through type-2 memory windows bound
//! per granted range to the sender's QP, see `mw`; no remote read;
//! per-connection buffer slabs; the sender's cache of write-source
//! registrations, `mr::cache`, kept safe by `mr::watch`), QPs and
//! their completions, and the connection handshake. Must not touch: what the
//! bytes mean (rendezvous), handshake payload contents, anything TF.
//! This is the only module that imports `rdma_sys`.
//!
//! Shape, in import order (each module imports only those above it; the
//! root's constants and pinned-memory account excepted):
//! - `wr`: the tagged `wr_id`s.
//! - `device`: probe/viability (device list, active ports, memlock) and
//!   the base objects: context, PD, completion channel, CQs.
//! - `mr`: regions, the pinned-memory account (RLIMIT_MEMLOCK), buffer
//!   slabs, the arena's lazy registration, the write-source cache, and
//!   `rdev-verbs-dereg` (regions dropped where unpinning must not run).
//! - `hca`: an opened device: the shared receive queue, the send CQs, the
//!   arena registrations and the write-source cache its connections share.
//! - `cm`: rdma_cm ids, addresses, the private data of REQ/REP.
//! - `mw`: type-2 memory windows, one per granted range: what keeps one
//!   verbs sender out of another's slots (and the fallback without them).
//! - `conn`: one connection's QP, buffers, ops and ordered work queue;
//!   posting (`conn::post`) and what comes back (`conn::events`).
//! - `progress`: the one thread that reads CM events and polls CQs (spins
//!   [`SPIN`], then blocks on the completion channel), and the listeners'
//!   shared state; it never registers or deregisters memory, copies a
//!   tensor or waits: connection bring-up, arena extents and `on_accept`
//!   go to `rdev-verbs-setup`, staged copies to `rdev-verbs-copy`
//!   (`progress::worker`), deregistrations to `rdev-verbs-dereg`.
//! - `endpoint` / `listener`: the [`Endpoint`] / [`Listener`] faces.
//!
//! Handshake: CM REQ carries {magic, MTU, receive depth, buffer size}; the
//! REP carries the arena's length and the listener's MTU (rdma_cm moves
//! both QPs to RTS with the path MTU of the route, the minimum of both
//! ports and the netdev, logged on connect). Then the sender's `hello` goes
//! as the first control message, `on_accept` runs on the receiver (on
//! `rdev-verbs-setup`: it may wait for its node to finish starting, which
//! the progress thread must not) and its reply (or refusal) comes back the same way, after the arena's address
//! and its region's rkey (which grants no remote access where windows are
//! used: each slot's key comes with the Publish naming it, from
//! `Listener::grant`); only then is the endpoint
//! handed out, so no write can precede acceptance.
//!
//! Control messages are SENDs into the device's shared receive queue
//! (one SRQ per device: [`VerbsOptions::srq_depth`] buffers of
//! [`SLOT_BYTES`], each reposted as soon as its completion is handled);
//! a longer message travels as ordered fragments. WRITE_WITH_IMM also
//! consumes a receive buffer. Fragments up to the QP's inline size go
//! inline and unsignalled; at most [`SEND_BUFFERS`] larger fragments are
//! in flight per connection; more wait in the connection's FIFO. A burst
//! past the SRQ's free buffers is absorbed by RC's RNR retry, which is
//! finite ([`VerbsOptions::rnr_retry`], default 6): a receiver that stops
//! reposting fails its senders' QPs instead of stalling them forever.
//!
//! Scale: receives share the SRQ and one receive CQ sized to it; each
//! connection reserves only its send queue ([`SQ_DEPTH`]) on a send CQ,
//! and a device opens another send CQ when one is fully promised, so the
//! number of connections per task is bounded by memory (tested: 256 in
//! the Soft-RoCE VM), not by one CQ's size.
//!
//! Timeouts: the ACK timeout and retry count bound how long a QP resends
//! to a dead host ([`VerbsOptions::dead_peer_bound`]: 4.096 us x
//! 2^ack_timeout x (retry_count + 1), ~3.76 s by default). The default
//! ACK timeout (17: 537 ms a try) rides through network blips of a few
//! seconds, as TCP under stock gRPC does: with 14 (67 ms, ~0.47 s in all)
//! a pause of half a second failed the link, and with it every waiting
//! receive (an eager MultiWorkerMirroredStrategy's standing one included,
//! which aborts its collectives for good); tests/softroce/two_hosts.sh
//! pauses a host's VM for 1.5 s mid-exchange. A process that dies is
//! found sooner, by its kernel's disconnect, whatever the timeout. The retry
//! count defaults to 6, not the maximum 7: Soft-RoCE (rdma_rxe) treats 7
//! as "retry forever" (as the RNR retry count does), so a QP to a vanished
//! host never failed there (found by tests/softroce/two_hosts.sh).
//!
//! Failure: a DISCONNECTED event (peer closed or died: its kernel sends the
//! DREQ when the process exits), a CM error or any failed completion tears
//! the connection down on the progress thread: QP and id destroyed first
//! (the NIC stops touching our buffers), then every pending write/read gets
//! `done(Err(PeerLost))`, then `on_disconnect(conn, PeerLost)`.
//!
//! Send-side strategy: see `conn` and the measurements in
//! `tests/softroce/README.md`.

pub(crate) mod cm;
mod conn;
pub mod device;
mod endpoint;
mod hca;
mod listener;
mod mr;
mod mw;
mod progress;
mod wr;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

pub use endpoint::VerbsEndpoint;
pub use listener::VerbsListener;

use crate::error::{Error, Result};
use crate::fabric::{Arena, Endpoint, Fabric, FabricEvents, Listener, TransportKind};

/// Bytes of one receive/send buffer for control messages (fragment
/// header included). Small, because the shared receive queue pins
/// `srq_depth` of them per device; typical control messages are tens of
/// bytes and longer ones are fragmented.
pub const SLOT_BYTES: usize = 4096;
/// Control-message fragments in flight per connection that need a send
/// buffer (fragments up to the QP's inline size need none); the rest wait
/// in order.
pub const SEND_BUFFERS: u32 = 16;
/// Work items (messages, writes) that may wait in one connection's queue
/// for send slots; past that `send_msg` fails instead of growing without
/// bound behind a peer that stopped consuming.
pub const MAX_QUEUED_WORK: usize = 16384;
/// Send-queue depth per QP.
pub const SQ_DEPTH: u32 = 128;
/// Every this many unsignalled send work requests one is signalled, so
/// its completion retires the ones before it (a send queue's work requests
/// complete in order). Below `SQ_DEPTH`, so a full send queue always holds
/// a signalled request whose completion frees it. A write's last request
/// and any request whose buffer must come back are always signalled.
pub const SIGNAL_EVERY: u32 = 16;
/// Inline data asked of each QP: control fragments (credits, publications)
/// and writes up to this size are copied into the work request by the CPU
/// instead of DMA'd from a buffer, so they need no registered buffer and
/// no completion. The device may grant more (the QP's cap says) or none.
pub const INLINE_BYTES: u32 = 256;
/// Entries of each send completion queue; a device opens another when the
/// connections' reservations (`SQ_DEPTH` each) fill one (capped by the
/// device's max_cqe), so connections are limited by memory, not one CQ.
pub const CQ_ENTRIES: u32 = 32768;
/// Default receive buffers in a device's shared receive queue (see
/// RDMA_DEVICE_VERBS_SRQ_DEPTH): 16 MiB pinned; enough for 256 peers with
/// 16 messages or immediates each in flight at once. Every completion
/// reposts its buffer at once; a longer burst waits in the senders' RNR
/// retries (bounded by RDMA_DEVICE_VERBS_RNR_RETRY).
pub const SRQ_DEPTH: u32 = 4096;
/// How long `reaches()` waits for rdma_cm to resolve a peer's address and
/// route through an RDMA port: local work (routing table, ARP/ND of the
/// next hop), so a short bound; a slower answer means "use gRPC".
pub const REACH_TIMEOUT_MS: i32 = 500;
/// Largest single work request (well below the 2 GiB RC message limit).
pub const MAX_WR_BYTES: usize = 1 << 30;
/// How long the progress thread busy-polls after the last completion before
/// it blocks on the completion channel: long enough to catch the next
/// completion of a pipelined transfer, short enough not to burn a core.
pub const SPIN: Duration = Duration::from_micros(50);
/// Chunk of the receive arena registered on the first slot placed in it
/// (see `mr::arena`): large enough that a training job's slots need a
/// handful of registrations, small enough that a job using a few hundred
/// MiB of a 1 GiB arena pins about that much.
pub const ARENA_CHUNK: u64 = 64 << 20;
/// Default bound of the write-source registration cache (`mr::cache`):
/// the tensors a training step sends from one task fit, and it is
/// evicted from (least recently used first) under RLIMIT_MEMLOCK pressure.
pub const MR_CACHE_BYTES: u64 = 1 << 30;
/// Scatter/gather entries per write work request: a write is a slot
/// header and a payload (2), with room for a split source.
pub const WRITE_SGES: u32 = 4;
/// Memory the backend must be able to pin at start (a few connections'
/// buffer slabs); below that it reports "not viable" with the fix.
pub const MIN_MEMLOCK_BYTES: u64 = 16 << 20;
/// rdma_cm listen backlog (pending connect requests).
pub const LISTEN_BACKLOG: i32 = 128;
/// The reason given when rdma_cm rejects a connection for lack of a
/// listener (the peer does not run the transport, or not yet).
/// How long rdma_cm must keep saying "nobody listens" before a first
/// contact concludes the peer does not run the transport.
const NO_LISTENER_GRACE: Duration = Duration::from_secs(2);
pub(crate) const NO_LISTENER: &str = "no rdma_device verbs listener at that address (it does not run this transport)";
/// rdma_cm address and route resolution timeout.
pub const RESOLVE_TIMEOUT_MS: i32 = 2000;

/// The largest control message (`constants::MAX_MSG_BYTES`).
pub fn max_msg_bytes() -> usize {
    crate::constants::MAX_MSG_BYTES
}

/// Knobs of the verbs backend (filled from the `RDMA_DEVICE_VERBS_*`
/// config entries by the node; defaults are right for most setups).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsOptions {
    /// Only use this device (e.g. "mlx5_0"); `None` = whichever device
    /// carries the task's address.
    pub device: Option<String>,
    /// Only use this port number.
    pub port: Option<u8>,
    /// Require this GID index (checked against what rdma_cm chose for the
    /// address: a mismatch is an error naming both).
    pub gid_index: Option<u32>,
    /// Added to the task's port for rdma_cm (iWARP shares TCP's port space
    /// with gRPC, so it needs an offset; IB/RoCE do not).
    pub cm_port_offset: u16,
    /// Writes of at least this many bytes go zero-copy from their source
    /// memory, through the registration cache; smaller ones copy into
    /// staging chunks.
    pub register_threshold: usize,
    /// Pinned bytes of write sources the registration cache may keep
    /// (0: register per write, no cache).
    pub mr_cache_bytes: u64,
    /// Chunk of the receive arena registered at once (see `mr::arena`).
    pub arena_chunk: u64,
    /// Tests only: cache registrations without watching the mappings
    /// (demonstrates the stale-page hazard the watch prevents).
    #[doc(hidden)]
    pub mr_cache_trust_mappings: bool,
    /// Size of one staging chunk.
    pub staging_chunk: usize,
    /// Staging chunks per connection (0 = always register).
    pub staging_chunks: u32,
    /// How long the progress thread busy-polls before it blocks.
    pub spin: Duration,
    /// Local ACK timeout exponent: each try waits 4.096 us x 2^n.
    pub ack_timeout: u8,
    /// Resends after an ACK timeout before the QP fails (0-7).
    pub retry_count: u8,
    /// Resends after an RNR NAK before the QP fails (7 = forever).
    pub rnr_retry: u8,
    /// IP TOS of RoCE v2 traffic (`None`: the kernel's default).
    pub tos: Option<u8>,
    /// Receive buffers in each device's shared receive queue.
    pub srq_depth: u32,
    /// Isolate senders with type-2 memory windows where the device has
    /// them (see `mw`); off: every sender writes through the arena's one
    /// shared region (what a device without windows gets anyway).
    pub memory_windows: bool,
    /// How long an incoming connection may take from its connect request
    /// to being accepted (its hello sent and checked) before it is closed.
    pub hello_timeout: Duration,
    /// Incoming connections brought up (a QP and registered buffers each)
    /// and not yet accepted, at most; further requests wait for room
    /// holding nothing but their rdma_cm id (see `progress::handshakes`).
    pub max_handshakes: usize,
}

impl Default for VerbsOptions {
    fn default() -> Self {
        VerbsOptions {
            device: None,
            port: None,
            gid_index: None,
            cm_port_offset: 0,
            register_threshold: 1 << 20,
            mr_cache_bytes: MR_CACHE_BYTES,
            arena_chunk: ARENA_CHUNK,
            mr_cache_trust_mappings: false,
            staging_chunk: 256 << 10,
            staging_chunks: 8,
            spin: SPIN,
            ack_timeout: 17,
            // Not 7: Soft-RoCE (rdma_rxe) retries forever at 7, like RNR.
            retry_count: 6,
            rnr_retry: 6,
            tos: None,
            srq_depth: SRQ_DEPTH,
            memory_windows: true,
            hello_timeout: HELLO_TIMEOUT,
            max_handshakes: MAX_HANDSHAKES,
        }
    }
}

/// Default [`VerbsOptions::hello_timeout`] (as shm's listener).
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Default [`VerbsOptions::max_handshakes`].
pub const MAX_HANDSHAKES: usize = 64;

impl VerbsOptions {
    /// The options the `RDMA_DEVICE_VERBS_*` (and spin) settings ask for.
    pub fn from_config(cfg: &crate::config::Config) -> VerbsOptions {
        VerbsOptions {
            device: Some(cfg.verbs_device.clone()).filter(|d| !d.is_empty()),
            port: Some(cfg.verbs_port).filter(|p| *p != 0),
            gid_index: u32::try_from(cfg.verbs_gid_index).ok(),
            cm_port_offset: cfg.verbs_cm_port_offset,
            spin: Duration::from_micros(cfg.spin_us),
            register_threshold: cfg.verbs_register_bytes,
            mr_cache_bytes: cfg.verbs_mr_cache_bytes as u64,
            ack_timeout: cfg.verbs_ack_timeout,
            retry_count: cfg.verbs_retry_count,
            rnr_retry: cfg.verbs_rnr_retry,
            tos: u8::try_from(cfg.verbs_tos).ok(),
            srq_depth: cfg.verbs_srq_depth,
            ..VerbsOptions::default()
        }
    }
}

/// The verbs [`Fabric`]. Creating one never fails: without a usable device
/// it reports why through [`Fabric::is_viable`]. The progress thread and
/// rdma_cm channel start on the first `listen`/`connect`.
pub struct VerbsFabric {
    opts: VerbsOptions,
    devices: Vec<device::DeviceInfo>,
    viable: Result<()>,
    /// The progress thread, started on first use. Every listener and
    /// endpoint holds it too, so a connection outlives a dropped fabric.
    rt: OnceLock<Result<Arc<progress::Runtime>>>,
    /// `reaches()` answers by peer address: successes for good, failures
    /// for [`REACH_RETRY_AFTER`] (a route may appear later).
    reach_cache: parking_lot::Mutex<std::collections::HashMap<String, (std::time::Instant, Result<()>)>>,
}

/// How long a "cannot reach" answer is reused before asking rdma_cm again.
pub const REACH_RETRY_AFTER: Duration = Duration::from_secs(30);

/// `ibv_fork_init()`, once per process, before any registration: without
/// it a child forked while memory is registered (TF's `subprocess`, data
/// loaders) can corrupt the parent's DMA target pages (copy-on-write moves
/// them). rdma-core >= 35 on kernels >= 5.13 needs nothing (it then
/// returns 0 without doing anything); older ones mark registered ranges
/// MADV_DONTFORK. Failure is logged, not fatal.
fn fork_init() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        // SAFETY: no preconditions; called once, before any registration
        // this library makes.
        let rc = unsafe { rdma_sys::ibv_fork_init() };
        if rc != 0 {
            log::warn!(
                "verbs: ibv_fork_init failed ({}); forking while RDMA memory is registered is unsafe in this process",
                std::io::Error::from_raw_os_error(rc.abs())
            );
        } else {
            log::debug!("verbs: ibv_fork_init ok");
        }
    });
}

impl VerbsFabric {
    pub fn new(opts: VerbsOptions) -> VerbsFabric {
        fork_init();
        let (devices, viable) = match device::probe() {
            Ok(d) => {
                let v = device::check_viable(&d, opts.device.as_deref(), opts.port);
                (d, v)
            }
            Err(e) => (Vec::new(), Err(Error::NotViable(e.to_string()))),
        };
        match &viable {
            Ok(()) => log::info!(
                "verbs: viable; devices: {}; memlock {}",
                devices.iter().map(|d| d.describe()).collect::<Vec<_>>().join("; "),
                device::memlock_limit().map(|l| format!("{l} bytes")).unwrap_or_else(|| "unlimited".into())
            ),
            Err(e) => log::info!("verbs: not viable: {}", e.message()),
        }
        VerbsFabric { opts, devices, viable, rt: OnceLock::new(), reach_cache: Default::default() }
    }

    /// The backend as the configuration asks for it. Never fails for lack
    /// of a device (that is [`Fabric::is_viable`]'s answer); the `Result`
    /// is for configuration errors.
    pub fn from_config(cfg: &crate::config::Config) -> Result<Arc<VerbsFabric>> {
        Ok(Arc::new(VerbsFabric::new(VerbsOptions::from_config(cfg))))
    }

    /// The rkeys of the arena's own registrations (one per device and
    /// listener). With memory windows they grant no remote access; tests
    /// check that a peer cannot write with them.
    #[doc(hidden)]
    pub fn arena_rkeys(&self) -> Vec<u32> {
        self.rt.get().and_then(|r| r.as_ref().ok()).map(|r| r.shared.arena_rkeys()).unwrap_or_default()
    }

    /// (entries, pinned bytes) of each opened device's registration cache
    /// (tests and diagnostics).
    #[doc(hidden)]
    pub fn mr_cache_usage(&self) -> Vec<(usize, u64)> {
        self.rt.get().and_then(|r| r.as_ref().ok()).map(|r| r.shared.mr_cache_usage()).unwrap_or_default()
    }

    /// (incoming connections in the handshake, connect requests waiting
    /// for room) (tests and diagnostics).
    #[doc(hidden)]
    pub fn handshakes_in_progress(&self) -> (usize, usize) {
        self.rt.get().and_then(|r| r.as_ref().ok()).map(|r| r.shared.handshakes.lock().counts()).unwrap_or_default()
    }

    /// What was found at start (for diagnostics and the bench).
    pub fn devices(&self) -> &[device::DeviceInfo] {
        &self.devices
    }

    /// The send-side strategies' primitive costs for one `len`-byte buffer
    /// on the first device, averaged over `iters`: (register + deregister,
    /// copy into a staging buffer). For the bench and the measurement test.
    pub fn measure_primitives(&self, len: usize, iters: u32) -> Result<(Duration, Duration)> {
        self.viable.clone()?;
        let ctx = device::Context::first()?;
        let pd = device::Pd::new(ctx)?;
        let src = vec![0x5au8; len.max(1)];
        let mut dst = vec![0u8; len.max(1)];
        let iters = iters.max(1);
        let t = std::time::Instant::now();
        for _ in 0..iters {
            // SAFETY: `src` outlives the MR, which is dropped at once.
            drop(unsafe { mr::Mr::register(&pd, src.as_ptr(), src.len(), mr::ACCESS_LOCAL_READ)? });
        }
        let reg = t.elapsed() / iters;
        let t = std::time::Instant::now();
        for _ in 0..iters {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
        }
        Ok((reg, t.elapsed() / iters))
    }

    /// The registration cache's costs for one `len`-byte buffer on the
    /// first device: (a miss: watch + register, a hit), the hit averaged
    /// over `iters`. For the measurement test.
    pub fn measure_cache(&self, len: usize, iters: u32) -> Result<(Duration, Duration)> {
        self.viable.clone()?;
        let ctx = device::Context::first()?;
        let pd = device::Pd::new(ctx)?;
        let cache = mr::cache::RegCache::new(pd, 1 << 30, false);
        if !cache.caching() {
            return Err(Error::NotViable("the registration cache is off here (no userfaultfd)".into()));
        }
        let src = vec![0x5au8; len.max(1)];
        let t = std::time::Instant::now();
        let first = cache.get(src.as_ptr(), src.len()).map_err(|m| Error::ResourceExhausted(m.to_string()))?;
        let miss = t.elapsed();
        drop(first);
        let iters = iters.max(1);
        let t = std::time::Instant::now();
        for _ in 0..iters {
            let r = cache.get(std::hint::black_box(src.as_ptr()), src.len()).map_err(|m| Error::ResourceExhausted(m.to_string()))?;
            std::hint::black_box(&r);
        }
        Ok((miss, t.elapsed() / iters))
    }

    pub fn options(&self) -> &VerbsOptions {
        &self.opts
    }

    fn runtime(&self) -> Result<Arc<progress::Runtime>> {
        self.viable.clone()?;
        self.rt
            .get_or_init(|| progress::Runtime::start(self.opts.clone()).map(Arc::new))
            .clone()
    }
}

impl Fabric for VerbsFabric {
    fn kind(&self) -> TransportKind {
        TransportKind::Verbs
    }

    fn is_viable(&self) -> Result<()> {
        self.viable.clone()
    }

    /// rdma_cm resolves the peer's address and route (at most
    /// [`REACH_TIMEOUT_MS`] each, on this thread, on a temporary id): a
    /// peer that no RDMA port (or not the configured device) can reach is
    /// `NotViable` now, so it gets gRPC before the first step instead of a
    /// failed connect later. Cached per address.
    fn reaches(&self, remote: &str) -> Result<()> {
        self.viable.clone()?;
        if let Some((at, r)) = self.reach_cache.lock().get(remote) {
            if r.is_ok() || at.elapsed() < REACH_RETRY_AFTER {
                return r.clone();
            }
        }
        let r = cm::resolve(remote, self.opts.cm_port_offset).and_then(|addr| {
            let dev = cm::probe_route(&addr, REACH_TIMEOUT_MS, self.opts.tos)?;
            match &self.opts.device {
                Some(want) if *want != dev => Err(Error::NotViable(format!(
                    "the route to {addr} leaves through RDMA device {dev}, but RDMA_DEVICE_VERBS_DEVICE={want}"
                ))),
                _ => Ok(()),
            }
        });
        match &r {
            Ok(()) => log::debug!("verbs: {remote} is reachable"),
            Err(e) => log::info!("verbs: {remote}: {}", e.message()),
        }
        self.reach_cache.lock().insert(remote.to_string(), (std::time::Instant::now(), r.clone()));
        r
    }

    fn listen(&self, local: &str, arena: Arc<Arena>, events: Arc<dyn FabricEvents>) -> Result<Arc<dyn Listener>> {
        let rt = self.runtime()?;
        let mut l = listener::listen(&rt.shared, local, arena, events)?;
        l.keep_alive(rt);
        Ok(Arc::new(l))
    }

    // rdma_cm makes one attempt either way: a peer with no listener is
    // reported by a REJECTED/UNREACHABLE event within `timeout`.
    fn connect(&self, remote: &str, hello: &[u8], events: Arc<dyn FabricEvents>, timeout: Duration, wait_for_listener: bool) -> Result<Arc<dyn Endpoint>> {
        let rt = self.runtime()?;
        let deadline = std::time::Instant::now() + timeout;
        let mut first_rejection: Option<std::time::Instant> = None;
        // As shm does: nobody listening is final at once unless the caller
        // waits for a peer that is (re)starting; then retried until the
        // deadline.
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match endpoint::connect(&rt.shared, remote, hello, events.clone(), left) {
                Ok(mut ep) => {
                    ep.keep_alive(rt);
                    return Ok(Arc::new(ep));
                }
                // A listener that is closing (see `fabric::LISTENER_CLOSING`)
                // is waited for as one not yet there.
                Err(Error::NotViable(m) | Error::PeerLost(m))
                    if (m.contains(NO_LISTENER) || m.contains(crate::fabric::LISTENER_CLOSING)) && wait_for_listener =>
                {
                    if std::time::Instant::now() + Duration::from_millis(20) >= deadline {
                        return Err(Error::Timeout(format!("connecting to {remote} over verbs for {timeout:?}: {m}")));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                // rdma_cm also rejects for a moment while a listener's
                // port is being (re)bound or a peer's earlier connection is
                // torn down: "nobody listens" is final only when it holds
                // for NO_LISTENER_GRACE (unlike shm's socket, which
                // answers for certain).
                Err(Error::NotViable(m))
                    if m.contains(NO_LISTENER)
                        && first_rejection.get_or_insert_with(std::time::Instant::now).elapsed() < NO_LISTENER_GRACE
                        && std::time::Instant::now() + Duration::from_millis(150) < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl VerbsOptions {
    /// Upper bound of how long a QP keeps resending to a peer that does
    /// not answer (host dead, cable pulled) before its work fails:
    /// 4.096 us x 2^ack_timeout x (retry_count + 1). The NIC may round the
    /// timeout up (never below its port's packet lifetime).
    pub fn dead_peer_bound(&self) -> Duration {
        let per_try_ns = 4096u128 << self.ack_timeout.min(31);
        let ns = per_try_ns * (u128::from(self.retry_count) + 1);
        Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_peer_bound_follows_the_formula() {
        // 4.096 us x 2^17 x 7 = 3758.096384 ms (the documented ~3.76 s).
        assert_eq!(VerbsOptions::default().dead_peer_bound(), Duration::from_nanos(3_758_096_384));
        let o = VerbsOptions { ack_timeout: 10, retry_count: 0, ..Default::default() };
        assert_eq!(o.dead_peer_bound(), Duration::from_nanos(4096 * 1024));
        const { assert!(SIGNAL_EVERY < SQ_DEPTH) };
    }

    #[test]
    fn options_follow_the_config() {
        let mut cfg = crate::config::Config::default();
        let o = VerbsOptions::from_config(&cfg);
        assert_eq!((o.ack_timeout, o.retry_count, o.rnr_retry, o.tos, o.srq_depth), (17, 6, 6, None, SRQ_DEPTH));
        cfg.verbs_tos = 106;
        cfg.verbs_rnr_retry = 7;
        let o = VerbsOptions::from_config(&cfg);
        assert_eq!((o.tos, o.rnr_retry), (Some(106), 7));
    }
}
