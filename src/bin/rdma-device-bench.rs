//! rdma-device-bench: measure the remote-memory device.
//!
//! `rdma-device-bench fabric [--transport shm|verbs] [--addr HOST:PORT]
//!  [--json] [--quick]`
//!
//! For each size (4 KiB … 64 MiB) it times bursts of one-sided writes, each
//! complete only when the receiver has seen its immediate, and, interleaved
//! with them in the same run, plain memcpy of the same sizes into a warm
//! buffer: the ceiling for a copy on this machine. It also measures one-way
//! latency: from posting a write to the receiver's progress thread seeing
//! it (one clock: sender and receiver live in this process; the receiver
//! still learns of writes only through the transport, as in production).
//! Medians over repetitions; throughput in GB/s (10^9 bytes per second).
//! The memcpy baseline is one thread; the shm backend copies writes of
//! 4 MiB and more with RDMA_DEVICE_SHM_COPY_THREADS threads (default
//! min(4, CPUs)), as a NIC would move them with its DMA engines.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_device::config::Config;
use rdma_device::error::{Error, Result};
use rdma_device::fabric::{self, Arena, ConnId, Endpoint, Fabric, FabricEvents, Segment};

const USAGE: &str = "usage: rdma-device-bench fabric [--transport shm|verbs] [--addr HOST:PORT] [--json] [--quick]\n\
  --transport  backend to measure (default shm)\n\
  --addr       address to listen on and connect to (default localhost:<free port>;\n\
               for verbs, an address of the RDMA interface)\n\
  --json       one JSON object per size: size, gbps, memcpy_gbps, ratio, p50_us, p99_us\n\
  --quick      fewer repetitions (a functional check, e.g. under emulation)";

struct Counter {
    closing: std::sync::atomic::AtomicBool,
    seen: AtomicU64,
    last_ns: AtomicU64,
    t0: Instant,
    /// The connection accepted last (+1; 0: none yet).
    accepted: AtomicU64,
}

impl FabricEvents for Counter {
    fn on_accept(&self, conn: ConnId, _: &[u8]) -> Result<Vec<u8>> {
        self.accepted.store(conn + 1, Ordering::Release);
        Ok(Vec::new())
    }
    fn on_write_imm(&self, _: ConnId, _: u32) {
        self.last_ns.store(self.t0.elapsed().as_nanos() as u64, Ordering::Release);
        self.seen.fetch_add(1, Ordering::AcqRel);
    }
    fn on_message(&self, _: ConnId, _: &[u8]) {}
    fn on_disconnect(&self, _: ConnId, why: Error) {
        if !self.closing.load(Ordering::Acquire) {
            eprintln!("connection lost: {why}");
        }
    }
}

/// `len` bytes at `skew` of a shared buffer.
struct Shared(Arc<Vec<u8>>, usize, usize);
impl AsRef<[u8]> for Shared {
    fn as_ref(&self) -> &[u8] {
        &self.0[self.1..self.1 + self.2]
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[v.len() / 2]
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// Post `n` writes of `size` and wait until the receiver saw all of them.
fn burst(ep: &dyn Endpoint, key: u32, c: &Counter, src: &Arc<Vec<u8>>, skew: usize, size: usize, n: u64) -> Result<Duration> {
    let start = c.seen.load(Ordering::Acquire);
    let t = Instant::now();
    for i in 0..n {
        let seg: Segment = Box::new(Shared(src.clone(), skew, size));
        ep.write_imm(0, key, vec![seg], i as u32, Box::new(|r| {
            if let Err(e) = r {
                eprintln!("write failed: {e}");
            }
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while c.seen.load(Ordering::Acquire) < start + n {
        if Instant::now() > deadline {
            return Err(Error::Timeout("writes did not complete within 60 s".into()));
        }
        std::hint::spin_loop();
    }
    Ok(t.elapsed())
}

fn memcpy_burst(dst: &mut [u8], src: &[u8], size: usize, n: u64) -> Duration {
    let t = Instant::now();
    for _ in 0..n {
        dst[..size].copy_from_slice(&src[..size]);
        std::hint::black_box(&mut dst[..size]);
    }
    t.elapsed()
}

fn run(transport: &str, addr: Option<String>, json: bool, quick: bool) -> Result<()> {
    let mut cfg = Config::from_env()?;
    cfg.transports = vec![transport.to_string()];
    let fab: Arc<dyn Fabric> = fabric::build_all(&cfg)
        .into_iter()
        .find(|f| f.kind().name() == transport)
        .ok_or_else(|| Error::NotViable(format!("transport {transport} is not in this build (build with --features verbs)")))?;
    fab.is_viable()?;
    let addr = addr.unwrap_or_else(|| {
        let p = std::net::TcpListener::bind("127.0.0.1:0").map(|l| l.local_addr().map(|a| a.port()).unwrap_or(0)).unwrap_or(0);
        format!("localhost:{p}")
    });
    let max = 64usize << 20;
    let arena = Arc::new(Arena::new("bench-arena", max)?);
    let c = Arc::new(Counter { closing: Default::default(), seen: AtomicU64::new(0), last_ns: AtomicU64::new(0), t0: Instant::now(), accepted: AtomicU64::new(0) });
    let l = fab.listen(&addr, arena.clone(), c.clone())?;
    let sink = Arc::new(Counter { closing: Default::default(), seen: AtomicU64::new(0), last_ns: AtomicU64::new(0), t0: Instant::now(), accepted: AtomicU64::new(0) });
    let ep = fab.connect(&addr, b"bench", sink.clone(), Duration::from_secs(10), true)?;
    // The writes below go anywhere in the arena, as if it were all slots
    // placed for this sender (the receive node grants each slot).
    let conn = c.accepted.load(Ordering::Acquire).checked_sub(1).ok_or_else(|| Error::Internal("no connection accepted".into()))?;
    let key = l.grant(conn, 0, arena.len() as u64)?.ok_or_else(|| Error::Internal("the listener does not know its connection".into()))?;
    let src = Arc::new((0..max + 64).map(|i| (i * 31 % 251) as u8).collect::<Vec<u8>>());
    let src_skew = src.as_ptr().align_offset(64);
    // Source and memcpy destination 64-byte aligned, as TensorFlow's CPU
    // allocator aligns tensors (and as receive slots are): glibc's malloc
    // would otherwise misalign large buffers by 16 bytes and make the
    // baseline copy src+16 → dst+16 while the fabric copies src+16 → slot.
    let mut heap = vec![1u8; max + 64];
    let skew = heap.as_ptr().align_offset(64);
    let dst = &mut heap[skew..skew + max];
    if !json {
        println!("rdma-device-bench fabric: transport {transport} at {addr}");
        if transport == "shm" {
            println!(
                "(shm copies writes >= 4 MiB with {} threads, RDMA_DEVICE_SHM_COPY_THREADS; the memcpy column is one thread)",
                cfg.shm_copy_threads
            );
        }
        println!("{:>10} {:>10} {:>12} {:>7} {:>9} {:>9}", "size", "GB/s", "memcpy GB/s", "ratio", "p50 us", "p99 us");
    }
    let sizes: Vec<usize> = (0..8).map(|i| 4096usize << (2 * i)).collect(); // 4K,16K,...,64M
    let reps = if quick { 3 } else { 9 };
    for &size in &sizes {
        // ~64 MiB per burst (at least 2 writes), warm-up first.
        let n = ((64usize << 20) / size).clamp(2, 4096) as u64;
        burst(&*ep, key, &c, &src, src_skew, size, n)?;
        memcpy_burst(dst, &src[src_skew..], size, n);
        let (mut f, mut m) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            let bytes = (size as u64 * n) as f64;
            f.push(bytes / burst(&*ep, key, &c, &src, src_skew, size, n)?.as_secs_f64() / 1e9);
            m.push(bytes / memcpy_burst(dst, &src[src_skew..], size, n).as_secs_f64() / 1e9);
        }
        let (gbps, mgbps) = (median(&mut f), median(&mut m));
        // One-way latency: post one write, wait until the receiver saw it.
        let iters = if quick { 50 } else { (2000 * 4096 / size).clamp(20, 2000) };
        let mut lat = Vec::with_capacity(iters);
        for i in 0..iters {
            let before = c.seen.load(Ordering::Acquire);
            let t_post = c.t0.elapsed().as_nanos() as u64;
            let seg: Segment = Box::new(Shared(src.clone(), src_skew, size));
            ep.write_imm(0, key, vec![seg], i as u32, Box::new(|_| {}));
            let deadline = Instant::now() + Duration::from_secs(10);
            while c.seen.load(Ordering::Acquire) == before {
                if Instant::now() > deadline {
                    return Err(Error::Timeout("latency write not seen within 10 s".into()));
                }
                std::hint::spin_loop();
            }
            lat.push((c.last_ns.load(Ordering::Acquire).saturating_sub(t_post)) as f64 / 1e3);
        }
        let (p50, p99) = (pct(&mut lat, 0.5), pct(&mut lat, 0.99));
        let ratio = gbps / mgbps;
        if json {
            println!(
                "{{\"size\": {size}, \"gbps\": {gbps:.3}, \"memcpy_gbps\": {mgbps:.3}, \"ratio\": {ratio:.3}, \"p50_us\": {p50:.2}, \"p99_us\": {p99:.2}}}"
            );
        } else {
            println!("{:>10} {gbps:>10.2} {mgbps:>12.2} {ratio:>7.2} {p50:>9.2} {p99:>9.2}", human(size));
        }
    }
    c.closing.store(true, Ordering::Release);
    sink.closing.store(true, Ordering::Release);
    if transport == "verbs" && !json {
        println!("(verbs numbers depend entirely on the device; under Soft-RoCE in an emulated VM they are a functional check, not RDMA speed)");
    }
    Ok(())
}

fn human(n: usize) -> String {
    if n >= 1 << 20 {
        format!("{} MiB", n >> 20)
    } else {
        format!("{} KiB", n >> 10)
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) != Some("fabric") {
        eprintln!("{USAGE}");
        std::process::exit(2);
    }
    let (mut transport, mut addr, mut json, mut quick) = ("shm".to_string(), None, false, false);
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--transport" => transport = it.next().cloned().unwrap_or_default(),
            "--addr" => addr = it.next().cloned(),
            "--json" => json = true,
            "--quick" => quick = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return;
            }
            other => {
                eprintln!("unknown argument {other:?}\n{USAGE}");
                std::process::exit(2);
            }
        }
    }
    if transport != "shm" && transport != "verbs" {
        eprintln!("--transport must be shm or verbs\n{USAGE}");
        std::process::exit(2);
    }
    if let Err(e) = run(&transport, addr, json, quick) {
        eprintln!("rdma-device-bench: {e}");
        std::process::exit(1);
    }
}
