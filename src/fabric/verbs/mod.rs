//! The RDMA verbs backend (libibverbs + librdmacm through `rdma-sys`): RC
//! queue pairs bootstrapped by rdma_cm on the task's "host:port".
//!
//! Owns: device discovery and viability, registration (the receiver's arena
//! as one MR with remote write/read; per-connection buffer slabs), QPs and
//! their completions, and the connection handshake. Must not touch: what the
//! bytes mean (rendezvous), handshake payload contents, anything TF.
//! This is the only module that imports `rdma_sys`.
//!
//! Shape:
//! - `device`: probe/viability (device list, active ports, memlock), and
//!   the per-device PD + completion channel + one shared CQ.
//! - `cm`: rdma_cm ids, addresses, the private data of REQ/REP.
//! - `conn`: one connection's QP, buffers, ops, ordered work queue.
//! - `progress`: the one thread that reads CM events and polls CQs (spins
//!   [`SPIN`], then blocks on the completion channel).
//! - `endpoint` / `listener`: the [`Endpoint`] / [`Listener`] faces.
//!
//! Handshake: CM REQ carries {magic, MTU, receive depth, buffer size}; the
//! REP carries the arena's {addr, rkey, len} and the listener's MTU (rdma_cm
//! moves both QPs to RTS with the path MTU of the route, the minimum of both
//! ports and the netdev, logged on connect). Then the sender's `hello` goes
//! as the first control message, `on_accept` runs on the receiver and its
//! reply (or refusal) comes back the same way; only then is the endpoint
//! handed out, so no write can precede acceptance.
//!
//! Control messages are SENDs into pre-posted receive buffers of
//! [`SLOT_BYTES`]; a longer message travels as ordered fragments. At most
//! [`SEND_BUFFERS`] fragments are in flight per connection; more wait in the
//! connection's FIFO. WRITE_WITH_IMM also consumes a receive buffer on the
//! receiver; overload is absorbed by RC's RNR retry (set to "infinite", so
//! it never turns into an error), not by losing messages.
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
mod listener;
mod mr;
mod progress;
mod wr;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

pub use endpoint::VerbsEndpoint;
pub use listener::VerbsListener;

use crate::error::{Error, Result};
use crate::fabric::{Arena, Endpoint, Fabric, FabricEvents, Listener, TransportKind};

/// Bytes of one control-message buffer (fragment header included). Small,
/// because every connection pins `RECV_BUFFERS` of them; typical control
/// messages are tens of bytes and longer ones are fragmented.
pub const SLOT_BYTES: usize = 4096;
/// Receive buffers posted per connection: messages and write-immediates
/// both consume one; 64 keeps a burst of small writes clear of RNR waits.
pub const RECV_BUFFERS: u32 = 64;
/// Control-message fragments in flight per connection (the bound on
/// outstanding sends; the rest wait in order).
pub const SEND_BUFFERS: u32 = 16;
/// Work items (messages, writes) that may wait in one connection's queue
/// for send slots; past that `send_msg` fails instead of growing without
/// bound behind a peer that stopped consuming.
pub const MAX_QUEUED_WORK: usize = 16384;
/// Send-queue depth per QP (writes are signalled per work request).
pub const SQ_DEPTH: u32 = 128;
/// Entries of each device's shared CQ; each connection reserves
/// `SQ_DEPTH + RECV_BUFFERS`, so a device serves ~170 connections.
pub const CQ_ENTRIES: u32 = 32768;
/// Largest single work request (well below the 2 GiB RC message limit).
pub const MAX_WR_BYTES: usize = 1 << 30;
/// How long the progress thread busy-polls after the last completion before
/// it blocks on the completion channel: long enough to catch the next
/// completion of a pipelined transfer, short enough not to burn a core.
pub const SPIN: Duration = Duration::from_micros(50);
/// Memory the backend must be able to pin at start (a few connections'
/// buffer slabs); below that it reports "not viable" with the fix.
pub const MIN_MEMLOCK_BYTES: u64 = 16 << 20;
/// rdma_cm listen backlog (pending connect requests).
pub const LISTEN_BACKLOG: i32 = 128;
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
    /// Writes of at least this many bytes register their source memory per
    /// write (zero-copy); smaller ones copy into staging chunks.
    pub register_threshold: usize,
    /// Size of one staging chunk.
    pub staging_chunk: usize,
    /// Staging chunks per connection (0 = always register).
    pub staging_chunks: u32,
    /// How long the progress thread busy-polls before it blocks.
    pub spin: Duration,
}

impl Default for VerbsOptions {
    fn default() -> Self {
        VerbsOptions {
            device: None,
            port: None,
            gid_index: None,
            cm_port_offset: 0,
            register_threshold: 1 << 20,
            staging_chunk: 256 << 10,
            staging_chunks: 8,
            spin: SPIN,
        }
    }
}

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
    rt: OnceLock<Result<progress::Runtime>>,
}

impl VerbsFabric {
    pub fn new(opts: VerbsOptions) -> VerbsFabric {
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
        VerbsFabric { opts, devices, viable, rt: OnceLock::new() }
    }

    /// The backend as the configuration asks for it. Never fails for lack
    /// of a device (that is [`Fabric::is_viable`]'s answer); the `Result`
    /// is for configuration errors.
    pub fn from_config(cfg: &crate::config::Config) -> Result<Arc<VerbsFabric>> {
        Ok(Arc::new(VerbsFabric::new(VerbsOptions::from_config(cfg))))
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

    pub fn options(&self) -> &VerbsOptions {
        &self.opts
    }

    fn runtime(&self) -> Result<&progress::Runtime> {
        self.viable.clone()?;
        self.rt
            .get_or_init(|| progress::Runtime::start(self.opts.clone()))
            .as_ref()
            .map_err(|e| e.clone())
    }
}

impl Fabric for VerbsFabric {
    fn kind(&self) -> TransportKind {
        TransportKind::Verbs
    }

    fn is_viable(&self) -> Result<()> {
        self.viable.clone()
    }

    fn reaches(&self, remote: &str) -> Result<()> {
        self.viable.clone()?;
        // Whether the route really leaves through an RDMA port is rdma_cm's
        // answer at connect time (a clear error then); here: resolvable.
        cm::resolve(remote, self.opts.cm_port_offset).map(|_| ())
    }

    fn listen(&self, local: &str, arena: Arc<Arena>, events: Arc<dyn FabricEvents>) -> Result<Arc<dyn Listener>> {
        let rt = self.runtime()?;
        Ok(Arc::new(listener::listen(&rt.shared, local, arena, events)?))
    }

    // rdma_cm makes one attempt either way: a peer with no listener is
    // reported by a REJECTED/UNREACHABLE event within `timeout`.
    fn connect(&self, remote: &str, hello: &[u8], events: Arc<dyn FabricEvents>, timeout: Duration, _wait_for_listener: bool) -> Result<Arc<dyn Endpoint>> {
        let rt = self.runtime()?;
        Ok(Arc::new(endpoint::connect(&rt.shared, remote, hello, events, timeout)?))
    }
}
