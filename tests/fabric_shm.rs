//! The backend conformance suite on the shm backend.

use std::sync::Arc;
use std::time::Duration;

use rdma_device::fabric::conformance::Harness;
use rdma_device::fabric::shm::ShmFabric;

fn harness() -> Harness {
    Harness {
        fabric: Arc::new(ShmFabric::new(Duration::from_micros(50))),
        addr: Box::new(|| {
            let p = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            format!("localhost:{p}")
        }),
    }
}

rdma_device::fabric_conformance_tests!(harness);

#[test]
fn shm_reaches_only_this_host() {
    use rdma_device::fabric::Fabric;
    let f = ShmFabric::new(Duration::ZERO);
    assert!(f.reaches("localhost:1").is_ok());
    assert!(f.reaches("127.0.0.1:1").is_ok());
    assert!(f.reaches("192.0.2.1:1").is_err(), "TEST-NET address is never local");
}

/// Forwards to a `Recorder`, after running `before_imm` on the thread
/// that delivers each immediate.
struct Hooked {
    inner: Arc<rdma_device::fabric::conformance::Recorder>,
    before_imm: Box<dyn Fn(u32) + Send + Sync>,
}

impl rdma_device::fabric::FabricEvents for Hooked {
    fn on_accept(&self, c: u64, h: &[u8], nonce: &[u8]) -> rdma_device::Result<Vec<u8>> {
        self.inner.on_accept(c, h, nonce)
    }
    fn on_write_imm(&self, c: u64, imm: u32) {
        (self.before_imm)(imm);
        self.inner.on_write_imm(c, imm)
    }
    fn on_message(&self, c: u64, m: &[u8]) {
        self.inner.on_message(c, m)
    }
    fn on_disconnect(&self, c: u64, why: rdma_device::Error) {
        self.inner.on_disconnect(c, why)
    }
}

/// A gate: `wait` blocks (at most 30 s) until `open`.
#[derive(Default)]
struct Gate {
    open: parking_lot::Mutex<bool>,
    cv: parking_lot::Condvar,
}

impl Gate {
    fn wait(&self) {
        let mut g = self.open.lock();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !*g && !self.cv.wait_until(&mut g, deadline).timed_out() {}
    }
    fn open(&self) {
        *self.open.lock() = true;
        self.cv.notify_all();
    }
}

/// Issue 17: a receiver that takes no immediates fills the doorbell ring;
/// the writes after that are queued, so the writing thread never waits
/// (no spinning on the ring), and once the receiver drains again every
/// write completes and every immediate arrives, in order.
#[test]
fn a_full_doorbell_ring_queues_writes_instead_of_blocking_the_writer() {
    use rdma_device::fabric::conformance::{Ev, Recorder};
    use rdma_device::fabric::{Arena, Fabric};
    use std::sync::mpsc;
    use std::time::Instant;

    let fabric = ShmFabric::new(Duration::from_micros(50));
    let arena = Arc::new(Arena::new("ring-full", 1 << 20).unwrap());
    let rec = Recorder::new(b"r", None);
    // The receiver's progress thread blocks on its first immediate until
    // the gate opens (a stopped receiver).
    let gate = Arc::new(Gate::default());
    let g = gate.clone();
    let gated = Arc::new(Hooked { inner: rec.clone(), before_imm: Box::new(move |_| g.wait()) });
    let addr = harness_addr();
    let listener = fabric.listen(&addr, arena.clone(), gated.clone()).unwrap();
    let ep = fabric.connect(&addr, b"h", Recorder::new(b"", None), Duration::from_secs(10), true).unwrap();
    let evs = rec.wait_for("accept", |e| e.iter().any(|x| matches!(x, Ev::Accept(..))));
    let conn = evs.iter().find_map(|x| if let Ev::Accept(c, _) = x { Some(*c) } else { None }).unwrap();
    let key = listener.grant(conn, 0, arena.len() as u64).unwrap().unwrap();

    // One in the progress thread's hands (blocked), a ring's worth behind
    // it, and 500 more than the ring holds.
    let n = rdma_device::constants::RING_ENTRIES as u32 + 501;
    let (tx, rx) = mpsc::channel();
    let mut slowest = Duration::ZERO;
    let t0 = Instant::now();
    for i in 0..n {
        let tx = tx.clone();
        let t = Instant::now();
        ep.write_imm((i as u64 % 256) * 64, key, vec![Box::new(vec![i as u8; 64])], i, Box::new(move |r| tx.send((i, r)).unwrap()));
        slowest = slowest.max(t.elapsed());
    }
    let issued = t0.elapsed();
    assert!(slowest < Duration::from_millis(200), "a write waited {slowest:?} for a full ring");
    assert!(issued < Duration::from_secs(5), "{n} writes took {issued:?} to issue");
    // The ones past the ring's capacity are queued: not complete yet.
    std::thread::sleep(Duration::from_millis(200));
    let early: Vec<_> = rx.try_iter().collect();
    assert!(early.iter().all(|(_, r)| r.is_ok()), "a write failed while queued");
    assert!(early.len() < n as usize, "all {n} writes completed while the receiver took none");
    gate.open();
    let mut done = early.len();
    while done < n as usize {
        let (i, r) = rx.recv_timeout(Duration::from_secs(10)).expect("every write completes once the receiver drains");
        r.unwrap_or_else(|e| panic!("write {i}: {e}"));
        done += 1;
    }
    let evs = rec.wait_for("every immediate", |e| e.iter().filter(|x| matches!(x, Ev::Imm(..))).count() == n as usize);
    let imms: Vec<u32> = evs.iter().filter_map(|x| if let Ev::Imm(_, i, _) = x { Some(*i) } else { None }).collect();
    assert_eq!(imms, (0..n).collect::<Vec<_>>(), "immediates out of order");
}

fn harness_addr() -> String {
    let p = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    format!("localhost:{p}")
}

/// A listener that closes connections before answering (a task dying or
/// shutting down between our connect and its accept) counts as nobody
/// listening: a connect that waits for the listener retries until a real
/// one answers, and a first contact that does not wait says NotViable.
#[test]
fn a_listener_that_hangs_up_before_answering_counts_as_nobody_listening() {
    use rdma_device::fabric::conformance::Recorder;
    use rdma_device::fabric::shm::socket;
    use rdma_device::fabric::Fabric;
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixListener};
    use std::time::Instant;

    let fabric = ShmFabric::new(Duration::from_micros(50));
    let addr = harness_addr();
    let name = socket::socket_name(&addr).unwrap();
    let dying = UnixListener::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
    let hangups = std::thread::spawn(move || {
        // Hang up on the first few connections (for 10 s at most), then go
        // away.
        dying.set_nonblocking(true).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut n = 0;
        while n < 3 && Instant::now() < deadline {
            match dying.accept() {
                Ok((c, _)) => {
                    drop(c);
                    n += 1;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(1)),
            }
        }
    });

    // First contact: a hang-up is final at once (the peer does not run us).
    let t = Instant::now();
    let e = fabric.connect(&addr, b"h", Recorder::new(b"", None), Duration::from_secs(10), false).err().expect("hung up");
    assert!(matches!(e, rdma_device::Error::NotViable(_)), "{e}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());

    // Waiting for the listener: the remaining hang-ups are retried until
    // the real listener (bound once the dying one is gone) answers.
    connect_waiting_for(&fabric, &addr, hangups, "the waiting connect gave up");
}

/// A connect that waits for the listener at `addr`, while a thread binds
/// a real listener there once `before` (a fake one's thread) ended: the
/// connect must reach the real one.
fn connect_waiting_for(fabric: &ShmFabric, addr: &str, before: std::thread::JoinHandle<()>, what: &str) {
    use rdma_device::fabric::conformance::Recorder;
    use rdma_device::fabric::{Arena, Fabric};
    use std::time::Instant;

    let real_addr = addr.to_string();
    let real = std::thread::spawn(move || {
        before.join().unwrap();
        let arena = Arc::new(Arena::new("reopened", 1 << 16).unwrap());
        let f = ShmFabric::new(Duration::from_micros(50));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match f.listen(&real_addr, arena.clone(), Recorder::new(b"r", None)) {
                Ok(l) => return l,
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
                Err(e) => panic!("{e}"),
            }
        }
    });
    let ep = fabric.connect(addr, b"h", Recorder::new(b"", None), Duration::from_secs(10), true);
    let listener = real.join().unwrap();
    let ep = ep.unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(ep.peer_hello(), b"r");
    drop(listener);
}

/// A listener that is closing refuses a connection whose hello arrives
/// after it began to close, and says so as a lost peer (code 3 of
/// `encode_refusal`), not as a task that does not run this transport
/// (NotViable, code 2): a server being deleted and made again keeps its
/// peers on the transport.
#[test]
fn a_closing_listener_refuses_as_a_lost_peer_not_as_a_stranger() {
    use rdma_device::fabric::conformance::Recorder;
    use rdma_device::fabric::shm::socket::{self, KIND_CHALLENGE, KIND_HELLO, KIND_REFUSE};
    use rdma_device::fabric::{Arena, Fabric};

    let fabric = ShmFabric::new(Duration::from_micros(50));
    let addr = harness_addr();
    let arena = Arc::new(Arena::new("closing", 1 << 16).unwrap());
    let listener = fabric.listen(&addr, arena, Recorder::new(b"r", None)).unwrap();
    let stream = socket::connect(&socket::socket_name(&addr).unwrap()).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let (kind, _nonce, _) = socket::recv_frame(&stream).unwrap();
    assert_eq!(kind, KIND_CHALLENGE);
    // The listener begins to close while our hello is still to come.
    listener.shutdown();
    socket::send_frame(&stream, KIND_HELLO, b"h", &[]).unwrap();
    let (kind, body, _) = socket::recv_frame(&stream).unwrap();
    assert_eq!(kind, KIND_REFUSE);
    let msg = String::from_utf8_lossy(&body[1..]).into_owned();
    assert_eq!(body[0], 3, "refused as code {} ({msg}), not as a lost peer (3)", body[0]);
    assert!(msg.contains("shutting down"), "{msg}");
}

/// The connecting side of the same: a closing listener's refusal is a
/// lost peer on first contact (never NotViable, which would route the peer
/// over gRPC for good), and a connect that waits for the listener retries
/// it until a listener takes the connection.
#[test]
fn a_closing_listeners_refusal_is_retried_and_never_demotes() {
    use rdma_device::fabric::conformance::Recorder;
    use rdma_device::fabric::shm::socket::{self, KIND_CHALLENGE, KIND_REFUSE};
    use rdma_device::fabric::{Fabric, NONCE_LEN};
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixListener};
    use std::time::Instant;

    let fabric = ShmFabric::new(Duration::from_micros(50));
    let addr = harness_addr();
    let name = socket::socket_name(&addr).unwrap();
    let closing = UnixListener::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
    // Refuse the first 3 connections as a closing listener does, then go
    // away (10 s at most).
    let refusals = std::thread::spawn(move || {
        closing.set_nonblocking(true).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut n = 0;
        while n < 3 && Instant::now() < deadline {
            match closing.accept() {
                Ok((c, _)) => {
                    c.set_nonblocking(false).unwrap();
                    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                    socket::send_frame(&c, KIND_CHALLENGE, &[7u8; NONCE_LEN], &[]).unwrap();
                    let _hello = socket::recv_frame(&c).unwrap();
                    let mut refusal = vec![3u8];
                    refusal.extend_from_slice(b"the listener is shutting down");
                    socket::send_frame(&c, KIND_REFUSE, &refusal, &[]).unwrap();
                    n += 1;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(1)),
            }
        }
    });

    let e = fabric.connect(&addr, b"h", Recorder::new(b"", None), Duration::from_secs(10), false).err().expect("refused");
    assert!(matches!(e, rdma_device::Error::PeerLost(_)), "first contact with a closing listener: {e}");

    connect_waiting_for(&fabric, &addr, refusals, "the waiting connect gave up on a closing listener");
}

/// Issue 33 (caller-driven progress): while a thread polls the listener,
/// it delivers the writes that land itself (no event thread wakes for
/// them, the senders ring no doorbell), and when it stops, a write that
/// landed meanwhile is delivered and the sleeping progress thread gets its
/// doorbell back: the next writes wake it at once. A lost wake-up would
/// show as a write delivered only by the progress thread's 200 ms timer.
#[test]
fn a_polling_thread_delivers_writes_itself_and_hands_the_doorbell_back() {
    use rdma_device::fabric::conformance::Recorder;
    use rdma_device::fabric::{Arena, Fabric};
    use std::time::Instant;

    let me = std::thread::current().name().unwrap().to_string();
    let fabric = ShmFabric::new(Duration::ZERO); // the progress thread sleeps as soon as it is idle
    let arena = Arc::new(Arena::new("polling", 1 << 20).unwrap());
    let rec = Recorder::new(b"r", None);
    // Which thread delivered each immediate, and when.
    let threads = Arc::new(parking_lot::Mutex::new(Vec::<(u32, String, Instant)>::new()));
    let t = threads.clone();
    let ev = Arc::new(Hooked {
        inner: rec.clone(),
        before_imm: Box::new(move |imm| t.lock().push((imm, std::thread::current().name().unwrap_or("?").to_string(), Instant::now()))),
    });
    let addr = harness_addr();
    let listener = fabric.listen(&addr, arena.clone(), ev.clone()).unwrap();
    let ep = fabric.connect(&addr, b"h", Recorder::new(b"", None), Duration::from_secs(10), true).unwrap();
    let evs = rec.wait_for("accept", |e| e.iter().any(|x| matches!(x, rdma_device::fabric::conformance::Ev::Accept(..))));
    let conn = evs.iter().find_map(|x| if let rdma_device::fabric::conformance::Ev::Accept(c, _) = x { Some(*c) } else { None }).unwrap();
    let key = listener.grant(conn, 0, arena.len() as u64).unwrap().unwrap();
    let delivered = |imm: u32| threads.lock().iter().find(|(i, ..)| *i == imm).cloned();
    let write = |imm: u32| ep.write_imm(0, key, vec![Box::new(vec![imm as u8; 64])], imm, Box::new(|r: rdma_device::Result<()>| r.unwrap()));

    for round in 0..5u32 {
        std::thread::sleep(Duration::from_millis(20)); // the progress thread is asleep
        // Polling: this thread delivers the write.
        listener.start_polling();
        let imm = 100 * round + 1;
        write(imm);
        let t0 = Instant::now();
        let mut got = 0;
        while got == 0 && t0.elapsed() < Duration::from_secs(5) {
            got = listener.poll();
        }
        assert_eq!(got, 1, "round {round}: the polling thread delivered nothing");
        assert_eq!(delivered(imm).map(|d| d.1), Some(me.clone()), "round {round}: delivered by another thread");
        // A write that lands while the rings say "awake" and nobody polls
        // is delivered when polling stops, at the latest.
        write(imm + 1);
        std::thread::sleep(Duration::from_millis(2));
        listener.stop_polling();
        let t0 = Instant::now();
        while delivered(imm + 1).is_none() && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(t0.elapsed() < Duration::from_millis(100), "round {round}: the write that landed while polling took {:?}", t0.elapsed());
        // Not polling: the progress thread is woken by the next write.
        std::thread::sleep(Duration::from_millis(20));
        let sent = Instant::now();
        write(imm + 2);
        while delivered(imm + 2).is_none() && sent.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_micros(200));
        }
        let (_, thread, at) = delivered(imm + 2).expect("delivered");
        assert_eq!(thread, "rdev-shm-progress", "round {round}");
        assert!(at - sent < Duration::from_millis(100), "round {round}: the progress thread took {:?} (its doorbell was not handed back)", at - sent);
    }
}
