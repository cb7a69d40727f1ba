//! The verbs backend on a real RDMA device (Soft-RoCE in the test VM:
//! `tests/softroce/run.sh`).
//!
//! `RDMA_DEVICE_TEST_VERBS=1` selects the device tests and makes a missing
//! device a failure. Without it only the "no device → not viable" check
//! runs (and passes on a host without RDMA hardware).
//! `RDMA_DEVICE_TEST_VERBS_ADDR` (default: the IPv4 address of the first
//! RoCE GID found) is the local address to listen on.
#![cfg(feature = "verbs")]

mod common;

use std::io::{BufRead, BufReader, Write};

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use rdma_device::error::{Error, Result};
use rdma_device::fabric::verbs::{VerbsFabric, VerbsOptions};
use rdma_device::fabric::{Arena, ConnId, Endpoint, Fabric, FabricEvents, Listener, Segment};

fn selected() -> bool {
    std::env::var("RDMA_DEVICE_TEST_VERBS").is_ok_and(|v| v == "1")
}

/// The fabric under test, or `None` when verbs tests are not selected.
/// Selected but no device: a failure, not a skip.
fn fabric_with(opts: VerbsOptions) -> Option<Arc<VerbsFabric>> {
    if !selected() {
        eprintln!("RDMA_DEVICE_TEST_VERBS is not 1: skipping the device test");
        return None;
    }
    let f = VerbsFabric::new(opts);
    if let Err(e) = f.is_viable() {
        panic!("RDMA_DEVICE_TEST_VERBS=1 but the verbs backend is not viable: {e}");
    }
    Some(Arc::new(f))
}

fn fabric() -> Option<Arc<VerbsFabric>> {
    fabric_with(VerbsOptions::default())
}

/// Where to listen: the env override or the first IPv4 RoCE GID's address.
fn local_ip(f: &VerbsFabric) -> String {
    if let Ok(a) = std::env::var("RDMA_DEVICE_TEST_VERBS_ADDR") {
        return a;
    }
    f.devices()
        .iter()
        .flat_map(|d| d.ports.iter())
        .filter(|p| p.active)
        .flat_map(|p| p.gids.iter())
        .find_map(|g| g.ipv4())
        .map(|ip| ip.to_string())
        .expect("no IPv4 address on any RDMA port; set RDMA_DEVICE_TEST_VERBS_ADDR")
}

#[derive(Debug, Clone, PartialEq)]
enum Ev {
    Accept(ConnId, Vec<u8>),
    Imm(ConnId, u32),
    Msg(ConnId, Vec<u8>),
    Disc(ConnId, Error),
}

/// Records every event; answers `on_accept` with `reply` (or refuses).
struct Rec {
    evs: Mutex<Vec<Ev>>,
    cv: Condvar,
    refuse: bool,
    arena: Mutex<Option<Arc<Arena>>>,
    /// Checksums of arena ranges at the moment each imm arrived.
    seen: Mutex<Vec<(u32, u64)>>,
}

impl Rec {
    fn new(refuse: bool) -> Arc<Rec> {
        Arc::new(Rec { evs: Mutex::new(Vec::new()), cv: Condvar::new(), refuse, arena: Mutex::new(None), seen: Mutex::new(Vec::new()) })
    }

    fn push(&self, e: Ev) {
        self.evs.lock().push(e);
        self.cv.notify_all();
    }

    fn wait<T>(&self, what: &str, timeout: Duration, mut f: impl FnMut(&[Ev]) -> Option<T>) -> T {
        let deadline = Instant::now() + timeout;
        let mut evs = self.evs.lock();
        loop {
            if let Some(t) = f(&evs) {
                return t;
            }
            if self.cv.wait_until(&mut evs, deadline).timed_out() {
                panic!("timed out waiting for {what}; events: {:?}", *evs);
            }
        }
    }
}

impl FabricEvents for Rec {
    fn on_accept(&self, conn: ConnId, hello: &[u8]) -> Result<Vec<u8>> {
        self.push(Ev::Accept(conn, hello.to_vec()));
        if self.refuse {
            return Err(Error::InvalidArgument("refused by test".into()));
        }
        let mut r = b"reply:".to_vec();
        r.extend_from_slice(hello);
        Ok(r)
    }
    fn on_write_imm(&self, conn: ConnId, imm: u32) {
        // imm = (offset / 4096) << 8 | len_class: check the data is there
        // when the imm arrives, not later.
        if let Some(a) = self.arena.lock().as_ref() {
            let off = (imm >> 8) as usize * 4096;
            let len = LENS[(imm & 0xff) as usize % LENS.len()];
            let sum = a.copy_out(off, len).map(|v| fnv(&v)).unwrap_or(0);
            self.seen.lock().push((imm, sum));
        }
        self.push(Ev::Imm(conn, imm));
    }
    fn on_message(&self, conn: ConnId, msg: &[u8]) {
        self.push(Ev::Msg(conn, msg.to_vec()));
    }
    fn on_disconnect(&self, conn: ConnId, why: Error) {
        self.push(Ev::Disc(conn, why));
    }
}

fn fnv(b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for x in b {
        h ^= u64::from(*x);
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(31).wrapping_add(seed as u32) as u8).collect()
}

const LENS: [usize; 7] = [0, 1, 4095, 4096, 100_000, (1 << 20) + 3, 3 << 20];

type Pair = (Arc<dyn Listener>, Arc<dyn Endpoint>, Arc<Rec>, Arc<Rec>, Arc<Arena>);

fn pair(f: &Arc<VerbsFabric>, arena_len: usize) -> Pair {
    let arena = Arc::new(Arena::new("verbs-test", arena_len).unwrap());
    let rx = Rec::new(false);
    *rx.arena.lock() = Some(arena.clone());
    let l = f.listen(&format!("{}:0", local_ip(f)), arena.clone(), rx.clone()).unwrap();
    let tx = Rec::new(false);
    let ep = f.connect(&l.local_addr(), b"hello", tx.clone(), Duration::from_secs(20), true).unwrap();
    (l, ep, rx, tx, arena)
}

fn write_sync(ep: &dyn Endpoint, off: u64, segs: Vec<Segment>, imm: u32) -> Result<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    ep.write_imm(off, segs, imm, Box::new(move |r| tx.send(r).unwrap()));
    rx.recv_timeout(Duration::from_secs(60)).expect("write completion")
}

// ---- The backend-agnostic conformance suite, on verbs -----------------

/// A conformance harness on the device, or `None` when not selected.
/// `pair` connects to the address it listened on, so each gets a fresh
/// fixed port (rdma_cm's port space, not TCP's).
fn conformance_harness() -> Option<rdma_device::fabric::conformance::Harness> {
    let f = fabric()?;
    let ip = local_ip(&f);
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
    let base = 20_000 + (std::process::id() % 2000) as u16 * 16;
    Some(rdma_device::fabric::conformance::Harness {
        fabric: f,
        addr: Box::new(move || {
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            format!("{ip}:{}", base + n % 16 + 1)
        }),
    })
}

/// Each case of `fabric::conformance`, guarded by the device selection
/// (the crate's `fabric_conformance_tests!` cannot skip on a host without
/// a device; keep this list in step with it).
macro_rules! verbs_conformance {
    ($($case:ident),* $(,)?) => {
        mod conformance {
            $(
                #[test]
                #[cfg_attr(not(feature = "verbs-device-tests"), ignore = "needs an RDMA device: tests/softroce/run.sh runs it on Soft-RoCE")]
                fn $case() {
                    if let Some(h) = super::conformance_harness() {
                        rdma_device::fabric::conformance::$case(&h);
                    }
                }
            )*
        }
    };
}

verbs_conformance!(
    handshake,
    refused_connect,
    writes_land_before_completion,
    gather_segments,
    immediates_in_order,
    out_of_range_write_fails,
    messages_both_ways,
    disconnects,
    two_senders,
);

#[test]
fn not_viable_without_device_names_the_reason() {
    let f = VerbsFabric::new(VerbsOptions::default());
    if selected() {
        f.is_viable().expect("device present");
        println!("verbs devices: {}", f.devices().iter().map(|d| d.describe()).collect::<Vec<_>>().join("; "));
        return;
    }
    match f.is_viable() {
        Ok(()) => eprintln!("an RDMA device is present on this host; nothing to check"),
        Err(Error::NotViable(m)) => {
            println!("verbs not viable: {m}");
            assert!(m.contains("RDMA") || m.contains("memlock"), "{m}");
        }
        Err(e) => panic!("wrong error kind: {e}"),
    }
    // Never panics, never aborts: listen/connect say why too.
    let a = Arc::new(Arena::new("t", 4096).unwrap());
    if f.is_viable().is_err() {
        assert!(matches!(f.listen("127.0.0.1:0", a, Rec::new(false)), Err(Error::NotViable(_))));
        assert!(matches!(
            f.connect("127.0.0.1:1", b"", Rec::new(false), Duration::from_millis(10), true),
            Err(Error::NotViable(_))
        ));
    }
}

#[test]
#[cfg_attr(not(feature = "verbs-device-tests"), ignore = "needs an RDMA device: tests/softroce/run.sh runs it on Soft-RoCE")]
fn bad_override_is_not_viable() {
    if !selected() {
        return;
    }
    let f = VerbsFabric::new(VerbsOptions { device: Some("nosuchdev9".into()), ..Default::default() });
    let e = f.is_viable().unwrap_err();
    assert!(e.message().contains("nosuchdev9"), "{e}");
}

#[test]
#[cfg_attr(not(feature = "verbs-device-tests"), ignore = "needs an RDMA device: tests/softroce/run.sh runs it on Soft-RoCE")]
fn handshake_messages_and_writes() {
    let Some(f) = fabric() else { return };
    let (l, ep, rx, tx, arena) = pair(&f, 32 << 20);
    assert_eq!(ep.peer_hello(), b"reply:hello");
    assert_eq!(ep.remote_len(), 32 << 20);
    let conn = rx.wait("accept", Duration::from_secs(10), |e| {
        e.iter().find_map(|x| if let Ev::Accept(c, h) = x { (h == b"hello").then_some(*c) } else { None })
    });

    // Messages both ways, including the largest allowed and a burst.
    let max = rdma_device::constants::MAX_MSG_BYTES;
    let big = pattern(max, 7);
    ep.send_msg(b"ping").unwrap();
    ep.send_msg(&big).unwrap();
    for i in 0..100u32 {
        ep.send_msg(&i.to_le_bytes()).unwrap();
    }
    assert!(ep.send_msg(&vec![0; max + 1]).is_err());
    rx.wait("messages", Duration::from_secs(30), |e| {
        let m: Vec<&Vec<u8>> = e.iter().filter_map(|x| if let Ev::Msg(_, m) = x { Some(m) } else { None }).collect();
        (m.len() == 102).then_some(())
    });
    {
        let evs = rx.evs.lock();
        let m: Vec<&Vec<u8>> = evs.iter().filter_map(|x| if let Ev::Msg(_, m) = x { Some(m) } else { None }).collect();
        assert_eq!(m[0].as_slice(), b"ping");
        assert_eq!(*m[1], big);
        for (i, v) in m[2..].iter().enumerate() {
            assert_eq!(v.as_slice(), (i as u32).to_le_bytes(), "message order");
        }
    }
    l.send_msg(conn, b"pong").unwrap();
    l.send_msg(conn, &big).unwrap();
    tx.wait("pong", Duration::from_secs(30), |e| {
        let n = e.iter().filter(|x| matches!(x, Ev::Msg(_, m) if m == b"pong" || *m == big)).count();
        (n == 2).then_some(())
    });

    // Writes of every size class, single- and multi-segment; each imm must
    // find its bytes already in place.
    for (k, len) in LENS.iter().enumerate() {
        let off = 4096 + (k as u64) * (4 << 20);
        let data = pattern(*len, k as u8);
        let segs: Vec<Segment> = if *len > 10 {
            let (a, b) = data.split_at(len / 3);
            vec![Box::new(a.to_vec()), Box::new(Vec::<u8>::new()), Box::new(b.to_vec())]
        } else {
            vec![Box::new(data.clone())]
        };
        let imm = ((off / 4096) as u32) << 8 | k as u32;
        write_sync(&*ep, off, segs, imm).unwrap();
        rx.wait("imm", Duration::from_secs(30), |e| e.contains(&Ev::Imm(conn, imm)).then_some(()));
        assert_eq!(fnv(&arena.copy_out(off as usize, *len).unwrap()), fnv(&data), "data of len {len}");
        let seen = rx.seen.lock().iter().find(|(i, _)| *i == imm).map(|s| s.1);
        assert_eq!(seen, Some(fnv(&data)), "bytes visible when imm {imm:#x} arrived");
    }

    // Outside the arena: an error through `done`, connection unharmed.
    let e = write_sync(&*ep, (32 << 20) - 2, vec![Box::new(vec![1u8; 3])], 1).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    ep.send_msg(b"still alive").unwrap();
    rx.wait("still alive", Duration::from_secs(10), |e| {
        e.iter().any(|x| matches!(x, Ev::Msg(_, m) if m == b"still alive")).then_some(())
    });

    // Close: both sides hear of it, later writes fail.
    ep.close();
    rx.wait("receiver disconnect", Duration::from_secs(5), |e| {
        e.iter().any(|x| matches!(x, Ev::Disc(c, _) if *c == conn)).then_some(())
    });
    tx.wait("sender disconnect", Duration::from_secs(5), |e| {
        e.iter().any(|x| matches!(x, Ev::Disc(c, _) if *c == ep.id())).then_some(())
    });
    assert!(write_sync(&*ep, 0, vec![Box::new(vec![1u8])], 0).is_err());
    assert!(ep.send_msg(b"x").is_err());
    l.shutdown();
}

#[test]
#[cfg_attr(not(feature = "verbs-device-tests"), ignore = "needs an RDMA device: tests/softroce/run.sh runs it on Soft-RoCE")]
fn many_writes_in_flight_complete_once_each() {
    let Some(f) = fabric_with(VerbsOptions { staging_chunks: 2, staging_chunk: 8192, register_threshold: 64 << 10, ..Default::default() }) else { return };
    let (l, ep, rx, _tx, arena) = pair(&f, 8 << 20);
    let n = 300u32;
    let (dtx, drx) = std::sync::mpsc::channel();
    for i in 0..n {
        // Mix staged (small, more than the chunks) and registered writes.
        let len = if i % 10 == 0 { 100_000 } else { 20_000 };
        let off = (i as u64 % 64) * 100_000;
        let d = dtx.clone();
        ep.write_imm(off, vec![Box::new(pattern(len, i as u8))], i, Box::new(move |r| d.send((i, r)).unwrap()));
    }
    let mut done = vec![0u32; n as usize];
    for _ in 0..n {
        let (i, r) = drx.recv_timeout(Duration::from_secs(120)).expect("all completions");
        r.unwrap();
        done[i as usize] += 1;
    }
    assert!(done.iter().all(|c| *c == 1), "each done exactly once");
    assert!(drx.recv_timeout(Duration::from_millis(200)).is_err(), "no extra completions");
    rx.wait("all imms", Duration::from_secs(60), |e| {
        (e.iter().filter(|x| matches!(x, Ev::Imm(..))).count() == n as usize).then_some(())
    });
    // Imms arrive in posting order (RC).
    let imms: Vec<u32> = rx.evs.lock().iter().filter_map(|x| if let Ev::Imm(_, i) = x { Some(*i) } else { None }).collect();
    assert_eq!(imms, (0..n).collect::<Vec<_>>());
    let _ = arena;
    l.shutdown();
}

#[test]
#[cfg_attr(not(feature = "verbs-device-tests"), ignore = "needs an RDMA device: tests/softroce/run.sh runs it on Soft-RoCE")]
fn refusal_reaches_the_sender() {
    let Some(f) = fabric() else { return };
    let arena = Arc::new(Arena::new("verbs-refuse", 1 << 20).unwrap());
    let rx = Rec::new(true);
    let l = f.listen(&format!("{}:0", local_ip(&f)), arena, rx.clone()).unwrap();
    let e = match f.connect(&l.local_addr(), b"let me in", Rec::new(false), Duration::from_secs(20), true) {
        Ok(_) => panic!("refused connection succeeded"),
        Err(e) => e,
    };
    assert!(matches!(e, Error::InvalidArgument(_)) && e.message().contains("refused by test"), "{e}");
    // Nobody listening: a prompt, clear error rather than a hang.
    let t = Instant::now();
    let port = l.local_addr().rsplit_once(':').unwrap().1.parse::<u16>().unwrap();
    let nobody = format!("{}:{}", local_ip(&f), port.wrapping_add(1).max(1));
    assert!(f.connect(&nobody, b"", Rec::new(false), Duration::from_secs(10), true).is_err());
    assert!(t.elapsed() < Duration::from_secs(10));
    l.shutdown();
}

#[test]
#[cfg_attr(not(feature = "verbs-device-tests"), ignore = "needs an RDMA device: tests/softroce/run.sh runs it on Soft-RoCE")]
fn listener_shutdown_fails_pending_and_disconnects() {
    let Some(f) = fabric() else { return };
    let (l, ep, rx, tx, _arena) = pair(&f, 4 << 20);
    rx.wait("accept", Duration::from_secs(10), |e| e.iter().any(|x| matches!(x, Ev::Accept(..))).then_some(()));
    l.shutdown();
    tx.wait("sender disconnect", Duration::from_secs(5), |e| {
        e.iter().any(|x| matches!(x, Ev::Disc(c, Error::PeerLost(_)) if *c == ep.id())).then_some(())
    });
    rx.wait("receiver disconnect", Duration::from_secs(5), |e| e.iter().any(|x| matches!(x, Ev::Disc(..))).then_some(()));
    assert!(write_sync(&*ep, 0, vec![Box::new(vec![0u8; 10])], 0).is_err());
}

// ---- Transport choice and the whole protocol over verbs (node level) --

/// A peer on another host gets verbs when the device is viable; without a
/// device the choice is gRPC and the reason names what is missing.
#[test]
fn node_chooses_verbs_for_a_remote_peer() {
    use rdma_device::node::Node;
    let mut cfg = common::small_config();
    cfg.arena_bytes = 8 << 20;
    let (ip, viable) = match fabric() {
        Some(f) => (local_ip(&f), true),
        None => ("127.0.0.1".to_string(), VerbsFabric::new(VerbsOptions::default()).is_viable().is_ok()),
    };
    let me = format!("{ip}:{}", common::free_port());
    let n = Node::new(cfg, &common::task(0), &me).unwrap();
    // TEST-NET-1 (RFC 5737): never an address of this host; nothing is sent
    // there (the choice is made without connecting).
    let c = n.add_peer(&common::task(1), "192.0.2.1:2222");
    println!("transport for a remote peer: {:?} ({})", c.transport.map(|k| k.name()), c.reason);
    if viable {
        assert_eq!(c.transport.map(|k| k.name()), Some("verbs"), "{}", c.reason);
    } else {
        assert_eq!(c.transport, None);
        assert!(c.reason.contains("verbs: "), "the reason must say why not verbs: {}", c.reason);
    }
    // A peer on this host still gets shm.
    let local = n.add_peer(&common::task(2), &format!("{ip}:{}", common::free_port()));
    assert_eq!(local.transport.map(|k| k.name()), Some("shm"), "{}", local.reason);
}

/// Two nodes exchange tensors with only verbs allowed: the rendezvous
/// protocol end to end over real RDMA writes.
#[test]
#[cfg_attr(not(feature = "verbs-device-tests"), ignore = "needs an RDMA device: tests/softroce/run.sh runs it on Soft-RoCE")]
fn node_pair_over_verbs_only() {
    use rdma_device::node::Node;
    use rdma_device::rendezvous::TensorMeta;
    let Some(f) = fabric() else { return };
    let ip = local_ip(&f);
    let mut cfg = common::small_config();
    cfg.arena_bytes = 64 << 20;
    cfg.transports = vec!["verbs".into()];
    let (pa, pb) = (common::free_port(), common::free_port());
    let (ta, tb) = (common::task(0), common::task(1));
    let a = Node::new(cfg.clone(), &ta, &format!("{ip}:{pa}")).unwrap();
    let b = Node::new(cfg, &tb, &format!("{ip}:{pb}")).unwrap();
    let ca = a.add_peer(&tb, &format!("{ip}:{pb}"));
    let cb = b.add_peer(&ta, &format!("{ip}:{pa}"));
    assert_eq!(ca.transport.map(|k| k.name()), Some("verbs"), "{}", ca.reason);
    assert_eq!(cb.transport.map(|k| k.name()), Some("verbs"), "{}", cb.reason);
    for step in 1..=40u64 {
        let len = [4usize, 4096, 100_000, 3 << 20][step as usize % 4];
        let data = common::pattern(step, len);
        let r = common::recv_async(&b, &ta, "edge;v", step);
        common::send_wait(&a, &tb, "edge;v", step, TensorMeta { dtype: 1, flags: 0, dims: vec![len as i64] }, data.clone()).unwrap();
        let lease = r.recv_timeout(Duration::from_secs(30)).unwrap().unwrap();
        assert_eq!(common::checksum(lease.bytes()), common::checksum(&data), "step {step}");
        assert!(lease.in_place(), "received in place (one-sided write into the slot)");
    }
    println!("node over verbs: {}", a.describe().lines().next().unwrap_or(""));
}

// ---- Two processes: checksummed exchange, then SIGKILL ----------------

/// Child role: listen, print the address, answer "sum OFF LEN" with the
/// arena checksum, run until killed.
#[test]
#[ignore = "a child process role of the two-process tests, run by them"]
fn child_receiver() {
    if std::env::var("RDMA_DEVICE_TEST_CHILD").as_deref() != Ok("receiver") {
        return;
    }
    let f = fabric().expect("child needs the device");
    let arena = Arc::new(Arena::new("verbs-child", 16 << 20).unwrap());
    struct Child {
        arena: Arc<Arena>,
        l: Mutex<Option<Arc<dyn Listener>>>,
    }
    impl FabricEvents for Child {
        fn on_accept(&self, _c: ConnId, h: &[u8]) -> Result<Vec<u8>> {
            Ok(h.to_vec())
        }
        fn on_write_imm(&self, _c: ConnId, _imm: u32) {}
        fn on_message(&self, c: ConnId, m: &[u8]) {
            let s = String::from_utf8_lossy(m);
            let v: Vec<usize> = s.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
            let sum = fnv(&self.arena.copy_out(v[0], v[1]).unwrap());
            if let Some(l) = self.l.lock().as_ref() {
                l.send_msg(c, format!("{sum}").as_bytes()).unwrap();
            }
        }
        fn on_disconnect(&self, _c: ConnId, _w: Error) {}
    }
    let ev = Arc::new(Child { arena: arena.clone(), l: Mutex::new(None) });
    let l = f.listen(&format!("{}:0", local_ip(&f)), arena, ev.clone()).unwrap();
    *ev.l.lock() = Some(l.clone());
    println!("CHILD-ADDR {}", l.local_addr());
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(600));
}

/// Child role: connect to RDMA_DEVICE_TEST_PEER, print "CONNECTED", keep
/// writing until killed.
#[test]
#[ignore = "a child process role of the two-process tests, run by them"]
fn child_sender() {
    if std::env::var("RDMA_DEVICE_TEST_CHILD").as_deref() != Ok("sender") {
        return;
    }
    let f = fabric().expect("child needs the device");
    let peer = std::env::var("RDMA_DEVICE_TEST_PEER").unwrap();
    let ep = f.connect(&peer, b"child", Rec::new(false), Duration::from_secs(20), true).unwrap();
    println!("CONNECTED");
    std::io::stdout().flush().unwrap();
    let mut i = 0u32;
    loop {
        let _ = write_sync(&*ep, 0, vec![Box::new(pattern(4096, i as u8))], i);
        i += 1;
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A child test process, SIGKILLed if the test ends early.
struct ChildProc(std::process::Child);

impl Drop for ChildProc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_child(role: &str, test: &str, peer: Option<&str>) -> (ChildProc, std::sync::mpsc::Receiver<String>) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", test, "--ignored", "--nocapture", "--test-threads=1"])
        .env("RDMA_DEVICE_TEST_CHILD", role)
        .stdout(Stdio::piped());
    if let Some(p) = peer {
        cmd.env("RDMA_DEVICE_TEST_PEER", p);
    }
    let mut child = cmd.spawn().unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in out.lines().map_while(|l| l.ok()) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (ChildProc(child), rx)
}

/// The rest of the child's first line containing `marker` (libtest may
/// print "test name ... " in front of it), within 60 s.
fn read_until(out: &std::sync::mpsc::Receiver<String>, marker: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match out.recv_timeout(left) {
            Ok(line) => {
                if let Some(i) = line.find(marker) {
                    return line[i + marker.len()..].trim().to_string();
                }
            }
            Err(e) => panic!("child did not print {marker}: {e:?}"),
        }
    }
}

#[test]
#[cfg_attr(not(feature = "verbs-device-tests"), ignore = "needs an RDMA device: tests/softroce/run.sh runs it on Soft-RoCE")]
fn two_process_checksums_then_sigkill_receiver() {
    let Some(f) = fabric() else { return };
    let (mut child, out) = spawn_child("receiver", "child_receiver", None);
    let addr = read_until(&out, "CHILD-ADDR");
    let tx = Rec::new(false);
    let ep = f.connect(&addr, b"parent", tx.clone(), Duration::from_secs(20), true).unwrap();
    assert_eq!(ep.peer_hello(), b"parent");
    for (k, len) in [1usize, 4096, 300_000, (2 << 20) + 17].into_iter().enumerate() {
        let off = k * (2 << 20) + 64;
        let data = pattern(len, 40 + k as u8);
        let (a, b) = data.split_at(len / 2);
        write_sync(&*ep, off as u64, vec![Box::new(a.to_vec()), Box::new(b.to_vec())], k as u32).unwrap();
        ep.send_msg(format!("sum {off} {len}").as_bytes()).unwrap();
        let want = fnv(&data).to_string().into_bytes();
        tx.wait("checksum reply", Duration::from_secs(30), |e| {
            e.iter().any(|x| matches!(x, Ev::Msg(_, m) if *m == want)).then_some(())
        });
        println!("two-process: {len} bytes at {off}: checksum matches");
    }
    // SIGKILL the receiver: its kernel tears the connection down; the
    // survivor hears within 5 s and writes fail.
    let t = Instant::now();
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    tx.wait("disconnect after SIGKILL", Duration::from_secs(5), |e| {
        e.iter().any(|x| matches!(x, Ev::Disc(c, Error::PeerLost(_)) if *c == ep.id())).then_some(())
    });
    println!("two-process: receiver SIGKILLed, sender saw on_disconnect after {:?}", t.elapsed());
    let e = write_sync(&*ep, 0, vec![Box::new(vec![1u8; 100])], 0).unwrap_err();
    assert!(matches!(e, Error::PeerLost(_)), "{e}");
}

#[test]
#[cfg_attr(not(feature = "verbs-device-tests"), ignore = "needs an RDMA device: tests/softroce/run.sh runs it on Soft-RoCE")]
fn two_process_sigkill_sender() {
    let Some(f) = fabric() else { return };
    let arena = Arc::new(Arena::new("verbs-kill-sender", 1 << 20).unwrap());
    let rx = Rec::new(false);
    let l = f.listen(&format!("{}:0", local_ip(&f)), arena, rx.clone()).unwrap();
    let (mut child, out) = spawn_child("sender", "child_sender", Some(&l.local_addr()));
    read_until(&out, "CONNECTED");
    let conn = rx.wait("writes from the child", Duration::from_secs(30), |e| {
        e.iter().find_map(|x| if let Ev::Imm(c, i) = x { (*i > 3).then_some(*c) } else { None })
    });
    let t = Instant::now();
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    rx.wait("disconnect after SIGKILL", Duration::from_secs(5), |e| {
        e.iter().any(|x| matches!(x, Ev::Disc(c, Error::PeerLost(_)) if *c == conn)).then_some(())
    });
    println!("two-process: sender SIGKILLed, receiver saw on_disconnect after {:?}", t.elapsed());
    l.shutdown();
}

// ---- Measurement (prints; asserts nothing about speed) ----------------

/// A source buffer shared by many writes (no per-write copy in the test).
#[derive(Clone)]
struct SharedBuf(Arc<Vec<u8>>);

impl AsRef<[u8]> for SharedBuf {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

#[test]
#[ignore = "a measurement, not a test: SOFTROCE_MEASURE=1 tests/softroce/run.sh"]
fn measure_send_strategies() {
    if std::env::var("RDMA_DEVICE_TEST_VERBS_MEASURE").as_deref() != Ok("1") {
        return;
    }
    let Some(f) = fabric() else { return };
    for len in [4096usize, 65536, 1 << 20, 8 << 20] {
        let iters = (64usize << 20).div_ceil(len).clamp(4, 200) as u32;
        let (reg, copy) = f.measure_primitives(len, iters).unwrap();
        println!(
            "verbs-measure: primitives {len:>8} B: ibv_reg_mr+dereg {:9.1} us, memcpy {:9.1} us",
            reg.as_secs_f64() * 1e6,
            copy.as_secs_f64() * 1e6
        );
    }
    for (name, thr) in [("staging", usize::MAX), ("register", 0)] {
        let f = fabric_with(VerbsOptions { register_threshold: thr, ..Default::default() }).unwrap();
        // A receiver that does no work per imm (the measurement's subject
        // is the sender).
        let arena = Arc::new(Arena::new("verbs-measure", 64 << 20).unwrap());
        let l = f.listen(&format!("{}:0", local_ip(&f)), arena, Rec::new(false)).unwrap();
        let ep = f.connect(&l.local_addr(), b"m", Rec::new(false), Duration::from_secs(20), true).unwrap();
        for len in [4096usize, 65536, 1 << 20, 8 << 20] {
            let data = SharedBuf(Arc::new(pattern(len, 1)));
            let iters = (32usize << 20).div_ceil(len).clamp(8, 256);
            write_sync(&*ep, 0, vec![Box::new(data.clone())], 0).unwrap();
            let t = Instant::now();
            for i in 0..iters {
                write_sync(&*ep, 0, vec![Box::new(data.clone())], i as u32).unwrap();
            }
            let el = t.elapsed();
            println!(
                "verbs-measure: {name:8} {len:>8} B x {iters:3}: {:8.1} us/write {:7.1} MB/s",
                el.as_secs_f64() * 1e6 / iters as f64,
                (len * iters) as f64 / el.as_secs_f64() / 1e6
            );
        }
        l.shutdown();
    }
}
