//! rdma-device-bench: measure the remote-memory device.
//!
//! `rdma-device-bench fabric [--transport shm|verbs] [--addr HOST:PORT]
//!  [--json] [--quick]`
//!
//! For each size (4 KiB … 64 MiB) it times bursts of one-sided writes, each
//! complete only when the receiver has seen its immediate, and, interleaved
//! with them in the same run (rotating order), plain memcpy of the same
//! sizes: the ceiling for a copy on this machine. Destinations rotate
//! through the whole arena (and the memcpy's through a buffer as large);
//! each region is poisoned before and compared with its source after every
//! timed burst, outside the timing, so every write's bytes are checked.
//! It also measures one-way
//! latency: from posting a write to the receiver's progress thread seeing
//! it (one clock: sender and receiver live in this process; the receiver
//! still learns of writes only through the transport, as in production).
//! Medians over repetitions; throughput in GB/s (10^9 bytes per second).
//! The shm backend copies writes of 4 MiB and more with
//! RDMA_DEVICE_SHM_COPY_THREADS threads (default min(4, CPUs)), as a NIC
//! would move them with its DMA engines; the memcpy baseline uses as many
//! threads as the write at each size (each thread copying its share of
//! every write, with no synchronisation: the best case), and a one-thread
//! memcpy is reported beside it.

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
  --json       one JSON object per size: size, gbps, memcpy_gbps, memcpy_threads, ratio,\n\
               memcpy1_gbps, ratio1, p50_us, p99_us, checked_writes\n\
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
    fn on_accept(&self, conn: ConnId, _: &[u8], _nonce: &[u8]) -> Result<Vec<u8>> {
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

/// `len` bytes at `off` of a shared buffer.
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

/// Writes of at least this size are shared with the shm backend's copy
/// threads (its `PARALLEL_COPY_MIN`); the memcpy baseline uses as many
/// threads as the write does at each size.
const SHM_PARALLEL_COPY_MIN: usize = 4 << 20;

/// Bytes no source region holds in full (the source is pseudo-random).
const POISON: u8 = 0xA5;

/// A source no two regions of which are alike (splitmix64 of each 8-byte
/// word's index), so a write that lands at the wrong offset, or not at
/// all, leaves bytes that differ from its source region.
fn pattern(len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len + 8);
    let mut i: u64 = 0;
    while v.len() < len {
        let mut z = i.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        v.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
        i += 1;
    }
    v.truncate(len);
    v
}

/// Where a burst's writes go: `n` writes of `size` back to back from `off`
/// in the destination and from the same offset in the source. Successive
/// bursts rotate through the whole destination (its length is a multiple
/// of every burst's bytes, so a burst never wraps).
#[derive(Clone, Copy)]
struct Region {
    off: usize,
    size: usize,
    n: usize,
}

impl Region {
    fn bytes(&self) -> usize {
        self.size * self.n
    }
}

/// Overwrite the arena's part of `r` with `POISON` (untimed).
fn poison_arena(arena: &Arena, r: Region, chunk: &[u8]) -> Result<()> {
    let mut at = r.off;
    while at < r.off + r.bytes() {
        let k = chunk.len().min(r.off + r.bytes() - at);
        arena.copy_in(at, &chunk[..k])?;
        at += k;
    }
    Ok(())
}

/// Every write of `r` arrived intact: the arena holds the source's bytes
/// (untimed).
fn check_arena(arena: &Arena, src: &[u8], r: Region, scratch: &mut [u8]) -> Result<()> {
    let mut at = r.off;
    while at < r.off + r.bytes() {
        let k = scratch.len().min(r.off + r.bytes() - at);
        arena.read_into(at, &mut scratch[..k])?;
        compare(&scratch[..k], &src[at..at + k], at, r)?;
        at += k;
    }
    Ok(())
}

fn compare(got: &[u8], want: &[u8], at: usize, r: Region) -> Result<()> {
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => {
            let byte = at + i;
            Err(Error::Internal(format!(
                "write {} of {} bytes (offset {}): byte {} differs from the source",
                (byte - r.off) / r.size,
                r.size,
                r.off + (byte - r.off) / r.size * r.size,
                (byte - r.off) % r.size
            )))
        }
    }
}

/// Post the writes of `r` and wait until the receiver saw all of them.
fn burst(ep: &dyn Endpoint, key: u32, c: &Counter, src: &Arc<Vec<u8>>, skew: usize, r: Region) -> Result<Duration> {
    let start = c.seen.load(Ordering::Acquire);
    let failed = Arc::new(AtomicU64::new(0));
    let t = Instant::now();
    for i in 0..r.n {
        let off = r.off + i * r.size;
        let seg: Segment = Box::new(Shared(src.clone(), skew + off, r.size));
        let f = failed.clone();
        ep.write_imm(off as u64, key, vec![seg], i as u32, Box::new(move |res| {
            if let Err(e) = res {
                eprintln!("write failed: {e}");
                f.fetch_add(1, Ordering::AcqRel);
            }
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while c.seen.load(Ordering::Acquire) < start + r.n as u64 {
        if failed.load(Ordering::Acquire) > 0 {
            return Err(Error::Internal("a write failed".into()));
        }
        if Instant::now() > deadline {
            return Err(Error::Timeout("writes did not complete within 60 s".into()));
        }
        std::hint::spin_loop();
    }
    Ok(t.elapsed())
}

/// The same copies as a burst, by `threads` threads: each copies its part
/// (1/threads, 64-byte aligned) of every write, with no synchronisation
/// between writes (a copier's best case). Poisons first and checks after,
/// both untimed, as for the fabric.
fn memcpy_burst(dst: &mut [u8], src: &[u8], r: Region, threads: usize) -> Result<Duration> {
    let (d, s) = (&mut dst[r.off..r.off + r.bytes()], &src[r.off..r.off + r.bytes()]);
    d.fill(POISON);
    let elapsed = if threads <= 1 {
        let t = Instant::now();
        for (dw, sw) in d.chunks_mut(r.size).zip(s.chunks(r.size)) {
            dw.copy_from_slice(sw);
            std::hint::black_box(&mut *dw);
        }
        t.elapsed()
    } else {
        let piece = (r.size.div_ceil(threads)).next_multiple_of(64);
        let mut parts: Vec<Vec<(&mut [u8], &[u8])>> = (0..threads).map(|_| Vec::with_capacity(r.n)).collect();
        for (dw, sw) in d.chunks_mut(r.size).zip(s.chunks(r.size)) {
            for (k, (dp, sp)) in dw.chunks_mut(piece).zip(sw.chunks(piece)).enumerate() {
                parts[k].push((dp, sp));
            }
        }
        let go = std::sync::Barrier::new(threads);
        std::thread::scope(|scope| {
            let mut mine = parts.swap_remove(0);
            let copy = |list: &mut Vec<(&mut [u8], &[u8])>| {
                for (dp, sp) in list.iter_mut() {
                    dp.copy_from_slice(sp);
                    std::hint::black_box(&mut **dp);
                }
            };
            let handles: Vec<_> = parts
                .into_iter()
                .map(|mut list| {
                    let go = &go;
                    scope.spawn(move || {
                        go.wait();
                        copy(&mut list);
                    })
                })
                .collect();
            go.wait();
            let t = Instant::now();
            copy(&mut mine);
            for h in handles {
                if h.join().is_err() {
                    eprintln!("a memcpy thread panicked");
                }
            }
            t.elapsed()
        })
    };
    compare(d, s, r.off, r)?;
    Ok(elapsed)
}

struct Row {
    size: usize,
    gbps: f64,
    memcpy_gbps: f64,
    memcpy_threads: usize,
    memcpy1_gbps: f64,
    p50: f64,
    p99: f64,
    checked: u64,
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
    // Destinations rotate through an arena of 4 (--quick: 2) bursts of the
    // largest size; the memcpy baseline rotates through a buffer as large.
    let span = if quick { 2 * max } else { 4 * max };
    let arena = Arc::new(Arena::new("bench-arena", span)?);
    let c = Arc::new(Counter { closing: Default::default(), seen: AtomicU64::new(0), last_ns: AtomicU64::new(0), t0: Instant::now(), accepted: AtomicU64::new(0) });
    let l = fab.listen(&addr, arena.clone(), c.clone())?;
    let sink = Arc::new(Counter { closing: Default::default(), seen: AtomicU64::new(0), last_ns: AtomicU64::new(0), t0: Instant::now(), accepted: AtomicU64::new(0) });
    let ep = fab.connect(&addr, b"bench", sink.clone(), Duration::from_secs(10), true)?;
    // The writes below go anywhere in the arena, as if it were all slots
    // placed for this sender (the receive node grants each slot).
    let conn = c.accepted.load(Ordering::Acquire).checked_sub(1).ok_or_else(|| Error::Internal("no connection accepted".into()))?;
    let key = l.grant(conn, 0, arena.len() as u64)?.ok_or_else(|| Error::Internal("the listener does not know its connection".into()))?;
    // Source and memcpy destination 64-byte aligned, as TensorFlow's CPU
    // allocator aligns tensors (and as receive slots are): glibc's malloc
    // would otherwise misalign large buffers by 16 bytes and make the
    // baseline copy src+16 → dst+16 while the fabric copies src+16 → slot.
    let src = Arc::new(pattern(span + 64));
    let src_skew = src.as_ptr().align_offset(64);
    let mut heap = vec![1u8; span + 64];
    let skew = heap.as_ptr().align_offset(64);
    let dst = &mut heap[skew..skew + span];
    let (poison, mut scratch) = (vec![POISON; 1 << 20], vec![0u8; 1 << 20]);
    let copy_threads = if transport == "shm" { cfg.shm_copy_threads } else { 1 };
    if !json {
        println!("rdma-device-bench fabric: transport {transport} at {addr}");
        println!(
            "(writes >= 4 MiB are copied by {copy_threads} thread(s){}; \"memcpy\" uses as many threads as the write at each size, \"1-thr\" one; destinations rotate through {} MiB; every write's bytes are checked)",
            if transport == "shm" { ", RDMA_DEVICE_SHM_COPY_THREADS" } else { " (the NIC)" },
            span >> 20
        );
        println!("{:>8} {:>7} {:>11} {:>6} {:>10} {:>6} {:>8} {:>8}", "size", "GB/s", "memcpy GB/s", "ratio", "1-thr GB/s", "ratio1", "p50 us", "p99 us");
    }
    let sizes: Vec<usize> = (0..8).map(|i| 4096usize << (2 * i)).collect(); // 4K,16K,...,64M
    let reps = if quick { 3 } else { 9 };
    let mut cursor = 0usize;
    let mut next = |size: usize, n: usize| {
        if cursor + size * n > span {
            cursor = 0;
        }
        let r = Region { off: cursor, size, n };
        cursor = (cursor + r.bytes()) % span;
        r
    };
    for &size in &sizes {
        let threads = if transport == "shm" && size >= SHM_PARALLEL_COPY_MIN { copy_threads } else { 1 };
        // ~64 MiB per burst (at least 2 writes), warm-up first.
        let n = ((64usize << 20) / size).clamp(2, 4096);
        let mut checked = 0u64;
        let r = next(size, n);
        poison_arena(&arena, r, &poison)?;
        burst(&*ep, key, &c, &src, src_skew, r)?;
        check_arena(&arena, &src[src_skew..], r, &mut scratch)?;
        memcpy_burst(dst, &src[src_skew..], r, 1)?;
        memcpy_burst(dst, &src[src_skew..], r, threads)?;
        let (mut f, mut m, mut m1) = (Vec::new(), Vec::new(), Vec::new());
        let bytes = (size * n) as f64;
        for rep in 0..reps {
            // The three in a rotating order, each on the next region.
            for k in 0..3 {
                let r = next(size, n);
                match (rep + k) % 3 {
                    0 => {
                        poison_arena(&arena, r, &poison)?;
                        f.push(bytes / burst(&*ep, key, &c, &src, src_skew, r)?.as_secs_f64() / 1e9);
                        check_arena(&arena, &src[src_skew..], r, &mut scratch)?;
                        checked += n as u64;
                    }
                    1 => m1.push(bytes / memcpy_burst(dst, &src[src_skew..], r, 1)?.as_secs_f64() / 1e9),
                    _ if threads > 1 => m.push(bytes / memcpy_burst(dst, &src[src_skew..], r, threads)?.as_secs_f64() / 1e9),
                    _ => {}
                }
            }
        }
        let mgbps1 = median(&mut m1);
        let mgbps = if threads > 1 { median(&mut m) } else { mgbps1 };
        // One-way latency: post one write, wait until the receiver saw it;
        // each to the next place in the arena, poisoned before and checked
        // after (both outside the timed part).
        let iters = if quick { 50 } else { (2000 * 4096 / size).clamp(20, 2000) };
        let mut lat = Vec::with_capacity(iters);
        for i in 0..iters {
            let r = next(size, 1);
            poison_arena(&arena, r, &poison)?;
            let before = c.seen.load(Ordering::Acquire);
            let t_post = c.t0.elapsed().as_nanos() as u64;
            let seg: Segment = Box::new(Shared(src.clone(), src_skew + r.off, size));
            ep.write_imm(r.off as u64, key, vec![seg], i as u32, Box::new(|_| {}));
            let deadline = Instant::now() + Duration::from_secs(10);
            while c.seen.load(Ordering::Acquire) == before {
                if Instant::now() > deadline {
                    return Err(Error::Timeout("latency write not seen within 10 s".into()));
                }
                std::hint::spin_loop();
            }
            lat.push((c.last_ns.load(Ordering::Acquire).saturating_sub(t_post)) as f64 / 1e3);
            check_arena(&arena, &src[src_skew..], r, &mut scratch)?;
            checked += 1;
        }
        let row = Row { size, gbps: median(&mut f), memcpy_gbps: mgbps, memcpy_threads: threads, memcpy1_gbps: mgbps1, p50: pct(&mut lat, 0.5), p99: pct(&mut lat, 0.99), checked };
        print_row(&row, json);
    }
    c.closing.store(true, Ordering::Release);
    sink.closing.store(true, Ordering::Release);
    if transport == "verbs" && !json {
        println!("(verbs numbers depend entirely on the device; under Soft-RoCE in an emulated VM they are a functional check, not RDMA speed)");
    }
    Ok(())
}

fn print_row(r: &Row, json: bool) {
    let (ratio, ratio1) = (r.gbps / r.memcpy_gbps, r.gbps / r.memcpy1_gbps);
    if json {
        println!(
            "{{\"size\": {}, \"gbps\": {:.3}, \"memcpy_gbps\": {:.3}, \"memcpy_threads\": {}, \"ratio\": {ratio:.3}, \"memcpy1_gbps\": {:.3}, \"ratio1\": {ratio1:.3}, \"p50_us\": {:.2}, \"p99_us\": {:.2}, \"checked_writes\": {}}}",
            r.size, r.gbps, r.memcpy_gbps, r.memcpy_threads, r.memcpy1_gbps, r.p50, r.p99, r.checked
        );
    } else {
        let m = format!("{:.2} ({}t)", r.memcpy_gbps, r.memcpy_threads);
        println!("{:>8} {:>7.2} {m:>11} {ratio:>6.2} {:>10.2} {ratio1:>6.2} {:>8.2} {:>8.2}", human(r.size), r.gbps, r.memcpy1_gbps, r.p50, r.p99);
    }
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
