//! Memory safety, isolation and a control plane that cannot stall, against
//! real shared memory, real sockets and (for the uid checks) real processes
//! of another user.

mod common;

use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use rdma_device::fabric::conformance::{Ev, Recorder};
use rdma_device::fabric::shm::ShmFabric;
use rdma_device::fabric::{Endpoint, Fabric};
use rdma_device::node::Node;
use rdma_device::rendezvous::{Hello, Msg, TensorMeta};

const EVIL: &str = "/job:evil/replica:0/task:0";
/// `nobody` on Debian: a uid other than ours (tests run as root or a user).
const OTHER_UID: u32 = 65534;

fn meta(n: usize) -> TensorMeta {
    TensorMeta { dtype: 4, flags: 0, dims: vec![n as i64].into() }
}

fn pair() -> (Node, Node, String) {
    let (pa, pb) = (free_port(), free_port());
    let (aa, ba) = (format!("localhost:{pa}"), format!("localhost:{pb}"));
    let a = Node::new(small_config(), &task(0), &aa).unwrap();
    let b = Node::new(small_config(), &task(1), &ba).unwrap();
    a.add_peer(&task(1), &ba);
    b.add_peer(&task(0), &aa);
    b.add_peer(EVIL, "localhost:1");
    (a, b, ba)
}

fn evil(b_addr: &str) -> (Arc<dyn Endpoint>, Arc<Recorder>) {
    let ev = Recorder::new(b"", None);
    let hello = Hello { task: EVIL.into(), incarnation: 7, target: task(1), rpc: false, proof: vec![] }.encode();
    let ep = ShmFabric::new(Duration::ZERO).connect(b_addr, &hello, ev.clone(), Duration::from_secs(5), true).unwrap();
    (ep, ev)
}

fn replies(ev: &Recorder, n: usize) -> Vec<Msg> {
    let evs = ev.wait_for("replies", |e| e.iter().filter(|x| matches!(x, Ev::Msg(..))).count() >= n);
    evs.iter().filter_map(|x| if let Ev::Msg(_, m) = x { Some(Msg::decode(m).unwrap()) } else { None }).collect()
}

#[test]
fn lease_is_readable_after_the_node_is_freed() {
    let (a, b, _) = pair();
    let data = pattern(11, 1 << 20);
    let r = recv_async(&b, &task(0), "held", 1);
    send_wait(&a, &task(1), "held", 1, meta(1 << 18), data.clone()).unwrap();
    let lease = r.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
    assert!(lease.in_place(), "the tensor must alias the arena for this test to mean anything");
    drop(a);
    drop(b);
    // The node (and its listener, rings, endpoints) is gone; the lease
    // keeps the arena mapped, so its bytes are still the tensor's.
    assert_eq!(checksum(lease.bytes()), checksum(&data));
    drop(lease);
}

#[test]
fn announce_of_a_size_near_u64_max_is_refused_and_the_link_survives() {
    let (a, b, b_addr) = pair();
    let (ep, ev) = evil(&b_addr);
    let ks = [0u64, 1, 2, 255, 256, 257, 4095, 4096, 4097, 1 << 20];
    for (i, k) in ks.iter().enumerate() {
        let key = format!("huge{i}");
        ep.send_msg(&Msg::Announce { key: key.clone(), step: 1, need: u64::MAX - k, returned: vec![] }.encode()).unwrap();
        let got = replies(&ev, i + 1);
        match &got[i] {
            Msg::NoSpace { key: k2, need } => assert_eq!((k2, *need), (&key, u64::MAX - k)),
            m => panic!("need = u64::MAX - {k}: expected NoSpace, got {m:?}"),
        }
    }
    // The link is still up and a sane size is placed within the arena.
    ep.send_msg(&Msg::Announce { key: "sane".into(), step: 1, need: 64, returned: vec![] }.encode()).unwrap();
    let got = replies(&ev, ks.len() + 1);
    let Msg::Publish { slots, .. } = &got[ks.len()] else { panic!("expected a publish, got {:?}", got[ks.len()]) };
    for s in slots {
        assert!(s.offset + s.capacity <= small_config().arena_bytes as u64, "{s:?}");
    }
    assert!(!ev.events().iter().any(|e| matches!(e, Ev::Disconnect(..))));
    // And the node still moves tensors between well-behaved peers.
    let r = recv_async(&b, &task(0), "good", 2);
    send_wait(&a, &task(1), "good", 2, meta(100), pattern(2, 400)).unwrap();
    assert_eq!(r.recv_timeout(Duration::from_secs(10)).unwrap().unwrap().bytes(), &pattern(2, 400)[..]);
}

/// A raw shm connection to the task at `b_addr`, and the nonce its
/// listener opened it with (the challenge frame).
fn raw_connect(b_addr: &str) -> (UnixStream, Vec<u8>) {
    let port = b_addr.rsplit(':').next().unwrap();
    // SAFETY: getuid has no preconditions.
    let name = format!("rdma_device.{}.{port}", unsafe { libc::getuid() });
    let mut s = UnixStream::connect_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let (kind, nonce) = read_frame(&mut s);
    assert_eq!(kind, 5, "expected the listener's challenge frame first");
    assert_eq!(nonce.len(), rdma_device::fabric::NONCE_LEN);
    (s, nonce)
}

/// One frame's kind and body (descriptors are discarded by the plain read).
fn read_frame(s: &mut UnixStream) -> (u8, Vec<u8>) {
    let mut head = [0u8; 5];
    s.read_exact(&mut head).unwrap();
    let mut body = vec![0u8; u32::from_le_bytes(head[..4].try_into().unwrap()) as usize - 1];
    s.read_exact(&mut body).unwrap();
    (head[4], body)
}

/// Issue 30 (L3): a task may hold two incoming links at once (a reconnect
/// may overlap its old link's loss), not more: each link's caps are a
/// quarter of the node's, so more links would take a node-wide budget.
/// The third is refused in the handshake, naming the cap; another task
/// still connects, and a link that ends gives its place back.
#[test]
fn a_task_cannot_open_more_than_two_links_at_once() {
    let (_a, b, b_addr) = pair();
    let hello = |task: &str| Hello { task: task.into(), incarnation: 9, target: task_of_b(), rpc: false, proof: vec![] }.encode();
    let mut held = Vec::new();
    for i in 0..2 {
        let (mut s, _) = raw_connect(&b_addr);
        write_frame(&mut s, 1, &hello(EVIL));
        assert_eq!(read_frame(&mut s).0, 2, "link {i} of {EVIL} is accepted");
        held.push(s);
    }
    let (mut s, _) = raw_connect(&b_addr);
    write_frame(&mut s, 1, &hello(EVIL));
    let (kind, why) = read_frame(&mut s);
    let why = String::from_utf8_lossy(&why).into_owned();
    assert_eq!(kind, 3, "a third link of one task was accepted");
    assert!(why.contains("at most 2"), "{why}");
    // Another task is not held back.
    let (mut s, _) = raw_connect(&b_addr);
    write_frame(&mut s, 1, &hello(&task(0)));
    assert_eq!(read_frame(&mut s).0, 2, "another task's link is accepted");
    // One of EVIL's links ends: a new one is accepted.
    drop(held.pop());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (mut s, _) = raw_connect(&b_addr);
        write_frame(&mut s, 1, &hello(EVIL));
        if read_frame(&mut s).0 == 2 {
            held.push(s);
            break;
        }
        assert!(Instant::now() < deadline, "a link of {EVIL} that ended did not give its place back");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(b);
}

fn task_of_b() -> String {
    task(1)
}

/// Raw shm handshake as `EVIL`: returns the socket after the accept frame.
fn raw_handshake(b_addr: &str) -> UnixStream {
    let (mut s, _) = raw_connect(b_addr);
    let hello = Hello { task: EVIL.into(), incarnation: 9, target: task(1), rpc: false, proof: vec![] }.encode();
    write_frame(&mut s, 1, &hello);
    let (kind, _) = read_frame(&mut s);
    assert_eq!(kind, 2, "expected the accept frame");
    s
}

/// Issue 30 (token): a hello that proved the cluster token on one
/// connection is refused when replayed on another, because each proof
/// covers the nonce the listener opened its connection with. Control: the
/// same task signing over the new nonce is accepted.
#[test]
fn a_recorded_hello_is_refused_on_another_connection() {
    let token = "s3cret";
    let pb = free_port();
    let b_addr = format!("localhost:{pb}");
    let b = Node::new(rdma_device::config::Config { cluster_token: token.into(), ..small_config() }, &task(1), &b_addr).unwrap();
    b.add_peer(&task(0), "localhost:1");
    let hello_for = |nonce: &[u8]| {
        let proof = rdma_device::rendezvous::proof::hello(token, &task(0), &task(1), 5, nonce);
        Hello { task: task(0), incarnation: 5, target: task(1), rpc: false, proof }.encode()
    };
    // The recorded connection: accepted.
    let (mut s1, n1) = raw_connect(&b_addr);
    let recorded = hello_for(&n1);
    write_frame(&mut s1, 1, &recorded);
    assert_eq!(read_frame(&mut s1).0, 2, "the genuine hello is accepted");
    // Its hello replayed on a new connection: refused, naming the token.
    let (mut s2, n2) = raw_connect(&b_addr);
    assert_ne!(n1, n2, "two connections got one nonce");
    write_frame(&mut s2, 1, &recorded);
    let (kind, why) = read_frame(&mut s2);
    let why = String::from_utf8_lossy(&why).into_owned();
    assert_eq!(kind, 3, "the replayed hello was not refused: {why}");
    assert!(why.contains("RDMA_DEVICE_CLUSTER_TOKEN"), "{why}");
    // A hello signed over this connection's own nonce is accepted.
    let (mut s3, n3) = raw_connect(&b_addr);
    write_frame(&mut s3, 1, &hello_for(&n3));
    assert_eq!(read_frame(&mut s3).0, 2, "a hello signed over its own nonce is accepted");
    drop((s1, s2, s3));
}

fn write_frame(s: &mut UnixStream, kind: u8, body: &[u8]) {
    let mut f = ((body.len() + 1) as u32).to_le_bytes().to_vec();
    f.push(kind);
    f.extend_from_slice(body);
    s.write_all(&f).unwrap();
}

#[test]
fn a_failed_control_send_fails_the_link_and_its_waiters() {
    let (_a, b, b_addr) = pair();
    let mut s = raw_handshake(&b_addr);
    let waiter = recv_async(&b, EVIL, "never", 1);
    // We stop reading: the receiver's Publish cannot be delivered.
    s.shutdown(std::net::Shutdown::Read).unwrap();
    let t0 = Instant::now();
    write_frame(&mut s, 4, &Msg::Announce { key: "k".into(), step: 1, need: 64, returned: vec![] }.encode());
    let res = waiter.recv_timeout(Duration::from_secs(5)).expect("the waiter must fail, not hang");
    let e = res.expect_err("the waiter must fail");
    assert!(e.to_string().contains("Publish") && e.to_string().contains("not sent"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    drop(s);
}

#[test]
fn a_stale_write_fails_the_link() {
    let (_a, b, b_addr) = pair();
    let (ep, ev) = evil(&b_addr);
    ep.send_msg(&Msg::Announce { key: "s".into(), step: 1, need: 64, returned: vec![] }.encode()).unwrap();
    let Msg::Publish { slots, edge_id, .. } = replies(&ev, 1).remove(0) else { panic!("expected a publish") };
    let s = slots[0];
    let waiter = recv_async(&b, EVIL, "s", 1);
    // A header from another life of the sender (incarnation 8, not 7).
    let h = rdma_device::rendezvous::SlotHeader { edge_id, slot: s.id, gen: s.gen, incarnation: 8, step: 1, len: 8, meta: meta(2), chunk: None };
    let (tx, rx) = std::sync::mpsc::channel();
    ep.write_imm(s.offset, s.key, vec![Box::new(h.encode())], s.id, Box::new(move |r| tx.send(r).unwrap()));
    rx.recv_timeout(Duration::from_secs(5)).unwrap().unwrap();
    ev.wait_for("the node to close the connection", |e| e.iter().any(|x| matches!(x, Ev::Disconnect(..))));
    let e = waiter.recv_timeout(Duration::from_secs(5)).unwrap().expect_err("the waiter must fail");
    assert!(e.to_string().contains("stale write"), "{e}");
}

#[test]
fn a_key_longer_than_the_wire_allows_is_refused_at_the_sender() {
    let (a, _b, _) = pair();
    let key = "k".repeat(rdma_device::rendezvous::wire::MAX_KEY + 1);
    let r = a.send(&task(1), &key, 1, meta(1), Box::new(vec![0u8; 4]), Box::new(|_| panic!("done must not run")));
    assert!(matches!(r, Err(rdma_device::Error::InvalidArgument(_))), "{r:?}");
}

#[test]
fn ten_thousand_writes_wrap_the_doorbell_ring() {
    let (a, b, _) = pair();
    let n = rdma_device::constants::RING_ENTRIES as u64 + 2000;
    assert!(n > 10_000);
    for step in 1..=n {
        let data = (step as u32).to_le_bytes().repeat(16);
        let r = recv_async(&b, &task(0), "wrap", step);
        send_wait(&a, &task(1), "wrap", step, meta(16), data.clone()).unwrap();
        let l = r.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
        assert_eq!(l.bytes(), &data[..], "step {step}");
        assert!(l.in_place());
    }
    let (ta, tb) = (a.counters(), b.counters());
    assert_eq!(ta.tensors_pushed, n);
    assert_eq!(ta.inline_tensors, 0);
    assert_eq!(tb.tensors_received, n);
    assert_eq!(tb.rejected_writes, 0);
}

// ---- uid checks, with a real process of another user ----

fn abstract_addr(name: &[u8]) -> (libc::sockaddr_un, libc::socklen_t) {
    // SAFETY: sockaddr_un is plain old data.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (i, b) in name.iter().enumerate() {
        sa.sun_path[i + 1] = *b as libc::c_char;
    }
    (sa, (std::mem::size_of::<libc::sa_family_t>() + 1 + name.len()) as libc::socklen_t)
}

/// Run `body` in a forked child as `OTHER_UID`; its return value is the
/// child's exit status. `body` may only make raw system calls (no
/// allocation: the parent has other threads).
fn fork_as_other_user(body: impl FnOnce() -> i32) -> libc::pid_t {
    // SAFETY: the child only makes async-signal-safe calls and _exits.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork");
    if pid == 0 {
        // SAFETY: raw system calls in the child.
        unsafe {
            if libc::setgid(OTHER_UID) != 0 || libc::setuid(OTHER_UID) != 0 {
                libc::_exit(90);
            }
            libc::_exit(body());
        }
    }
    pid
}

fn wait_exit(pid: libc::pid_t) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut st = 0;
        // SAFETY: our own child.
        let r = unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) };
        if r == pid {
            return if libc::WIFEXITED(st) { libc::WEXITSTATUS(st) } else { -1 };
        }
        if Instant::now() > deadline {
            // SAFETY: our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("child {pid} did not finish");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn skip_unless_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        skipped("not root: cannot start a process of another user; the uid tests need root (CI runs as root)");
    }
    !root
}

#[test]
fn a_listener_refuses_a_process_of_another_user() {
    if skip_unless_root() {
        return;
    }
    let (_a, b, b_addr) = pair();
    let port = b_addr.rsplit(':').next().unwrap();
    // SAFETY: getuid has no preconditions.
    let (sa, len) = abstract_addr(format!("rdma_device.{}.{port}", unsafe { libc::getuid() }).as_bytes());
    let hello = Hello { task: EVIL.into(), incarnation: 5, target: task(1), rpc: false, proof: vec![] }.encode();
    let mut frame = ((hello.len() + 1) as u32).to_le_bytes().to_vec();
    frame.push(1);
    frame.extend_from_slice(&hello);
    let pid = fork_as_other_user(|| {
        // SAFETY: raw socket calls on buffers prepared before the fork.
        unsafe {
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            if fd < 0 || libc::connect(fd, (&sa as *const libc::sockaddr_un).cast(), len) != 0 {
                return 91;
            }
            libc::send(fd, frame.as_ptr().cast(), frame.len(), libc::MSG_NOSIGNAL);
            let mut head = [0u8; 5];
            let mut got = 0;
            while got < 5 {
                let n = libc::recv(fd, head.as_mut_ptr().add(got).cast(), 5 - got, 0);
                if n <= 0 {
                    return 92;
                }
                got += n as usize;
            }
            // 3: KIND_REFUSE; 2 (accept, with the arena) would be a breach.
            if head[4] == 3 { 0 } else { 1 }
        }
    });
    assert_eq!(wait_exit(pid), 0, "the listener must refuse a peer of another uid");
    assert!(!b.describe().contains(EVIL), "no link may exist for the refused peer:\n{}", b.describe());
}

#[test]
fn a_connector_refuses_a_listener_of_another_user() {
    if skip_unless_root() {
        return;
    }
    let port = free_port();
    // Another user squats the name our listener at `port` would have.
    // SAFETY: getuid has no preconditions.
    let (sa, len) = abstract_addr(format!("rdma_device.{}.{port}", unsafe { libc::getuid() }).as_bytes());
    let mut pipe = [0i32; 2];
    // SAFETY: pipe writes two fds into the array.
    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
    let pid = fork_as_other_user(|| {
        // SAFETY: raw socket calls on buffers prepared before the fork.
        unsafe {
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            if fd < 0 || libc::bind(fd, (&sa as *const libc::sockaddr_un).cast(), len) != 0 || libc::listen(fd, 4) != 0 {
                return 91;
            }
            libc::write(pipe[1], b"x".as_ptr().cast(), 1);
            let c = libc::accept(fd, std::ptr::null_mut(), std::ptr::null_mut());
            if c < 0 {
                return 92;
            }
            let mut p = libc::pollfd { fd: c, events: libc::POLLIN, revents: 0 };
            if libc::poll(&mut p, 1, 10_000) <= 0 {
                return 93;
            }
            let mut b = [0u8; 64];
            // 0: the connector hung up without saying anything (no hello,
            // no task name, no incarnation); > 0: it talked to a squatter.
            if libc::recv(c, b.as_mut_ptr().cast(), b.len(), 0) == 0 { 0 } else { 1 }
        }
    });
    let mut x = [0u8; 1];
    // SAFETY: reading one byte from our pipe.
    assert_eq!(unsafe { libc::read(pipe[0], x.as_mut_ptr().cast(), 1) }, 1, "squatter did not start");
    let hello = Hello { task: task(0), incarnation: 1, target: task(1), rpc: false, proof: vec![] }.encode();
    let r = ShmFabric::new(Duration::ZERO).connect(&format!("localhost:{port}"), &hello, Recorder::new(b"", None), Duration::from_secs(3), true);
    let e = r.err().expect("connecting to a listener of another uid must fail");
    assert!(e.to_string().contains("uid"), "{e}");
    assert_eq!(wait_exit(pid), 0, "the connector must not talk to another user's listener");
    // SAFETY: closing our pipe ends.
    unsafe {
        libc::close(pipe[0]);
        libc::close(pipe[1]);
    }
}

/// Bytes of `n`'s arena in use, as its state dump reports them.
fn in_use(n: &Node) -> u64 {
    let d = n.describe();
    let at = d.find("arena in use ").expect("describe reports the arena") + "arena in use ".len();
    d[at..].split(';').next().unwrap().trim().parse().unwrap()
}

fn wait_until(what: &str, timeout: Duration, f: impl Fn() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A raw shm sender as `EVIL`: its socket and its view of the receiver's
/// arena, mapped (what a sender that ignores the protocol can write).
fn raw_sender(b_addr: &str) -> (UnixStream, *mut u8, usize) {
    use rdma_device::fabric::shm::socket;
    let s = socket::connect(&socket::socket_name(b_addr).unwrap()).unwrap();
    let (kind, _nonce, _) = socket::recv_frame(&s).unwrap();
    assert_eq!(kind, socket::KIND_CHALLENGE);
    let hello = Hello { task: EVIL.into(), incarnation: 5, target: task(1), rpc: false, proof: vec![] }.encode();
    socket::send_frame(&s, socket::KIND_HELLO, &hello, &[]).unwrap();
    let (kind, body, fds) = socket::recv_frame(&s).unwrap();
    assert_eq!(kind, socket::KIND_ACCEPT);
    let len = u64::from_le_bytes(body[..8].try_into().unwrap()) as usize;
    use std::os::fd::AsRawFd;
    // SAFETY: a fresh shared mapping of the descriptor we were given.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fds[0].as_raw_fd(), 0) };
    assert_ne!(p, libc::MAP_FAILED);
    (s, p.cast(), len)
}

/// Scribble 0xEE over every byte the sender can reach.
fn scribble(p: usize, len: usize) {
    // SAFETY: the whole mapping made by raw_sender, still mapped.
    unsafe { std::ptr::write_bytes(p as *mut u8, 0xEE, len) };
}

#[test]
fn a_sender_writes_only_the_slots_placed_for_it() {
    let (a, b, b_addr) = pair();
    let base = in_use(&b);
    // An honest tensor, held by the application (in place in the arena).
    let data = pattern(5, 1 << 20);
    let r = recv_async(&b, &task(0), "held", 1);
    send_wait(&a, &task(1), "held", 1, meta(1 << 18), data.clone()).unwrap();
    let held = r.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
    assert!(held.in_place());
    // A sender that ignores the protocol: it has slots of its own placed,
    // then overwrites everything it can reach, again and again, while
    // honest tensors keep arriving.
    let (s, p, len) = raw_sender(&b_addr);
    let announce = Msg::Announce { key: "e".into(), step: 1, need: 1 << 20, returned: vec![] }.encode();
    rdma_device::fabric::shm::socket::send_frame(&s, rdma_device::fabric::shm::socket::KIND_MSG, &announce, &[]).unwrap();
    let (_, publish, _) = rdma_device::fabric::shm::socket::recv_frame(&s).unwrap();
    assert!(matches!(Msg::decode(&publish).unwrap(), Msg::Publish { .. }));
    assert!(in_use(&b) > base, "the evil sender's slots are placed");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (st, pp) = (stop.clone(), p as usize);
    let scribbler = std::thread::spawn(move || {
        let mut rounds = 0u64;
        while !st.load(std::sync::atomic::Ordering::Relaxed) {
            scribble(pp, len);
            rounds += 1;
        }
        rounds
    });
    let check = |from: u64, to: u64, key: &str| {
        for step in from..to {
            let d = pattern(step, 64 << 10);
            let r = recv_async(&b, &task(0), key, step);
            send_wait(&a, &task(1), key, step, meta(16 << 10), d.clone()).unwrap();
            let l = r.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
            assert!(l.bytes() == &d[..], "{key} step {step}: an honest tensor was corrupted");
        }
    };
    check(2, 50, "v");
    assert_eq!(checksum(held.bytes()), checksum(&data), "a held tensor was overwritten by another sender");
    // It hangs up but its process (ours) lives on and keeps writing: its
    // slots are free at once (nothing it writes reaches a slot placed for
    // anyone else), and the freed ranges are placed again for others.
    let before = in_use(&b);
    drop(s);
    let linked = || b.describe().lines().any(|l| l.starts_with("rx link") && l.contains(EVIL));
    wait_until("the evil link to be dropped", Duration::from_secs(5), || !linked());
    wait_until("its slots to be freed", Duration::from_secs(5), || in_use(&b) <= before - (2 << 20));
    check(50, 80, "v");
    check(1, 30, "w");
    check(1, 10, "x");
    assert_eq!(checksum(held.bytes()), checksum(&data), "a held tensor was overwritten by another sender");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(scribbler.join().unwrap() > 0);
    // SAFETY: the mapping made by raw_sender.
    unsafe { libc::munmap(p.cast(), len) };
}

/// Issue 18, N4: a peer cannot queue placements on our behalf without
/// bound (each may wait for a connect, on a pool the whole process
/// shares): past `MAX_PLACEMENTS_PER_LINK` queued at once each further
/// request is answered at once with an error naming the cap, and the node
/// goes on serving others.
///
/// The receiver the requests name is a task that hangs: its socket takes
/// connections into the backlog and never answers, so every placement waits
/// for its connect and the requests pile up on any machine. (Towards an
/// address with no listener each one fails at once, and whether the cap is
/// reached was a race between this loop and the pool.)
#[test]
fn a_flood_of_placement_requests_is_refused_with_the_cap_named() {
    let (a, b, b_addr) = pair();
    const HUNG: &str = "/job:hung/replica:0/task:0";
    let hung_addr = format!("localhost:{}", free_port());
    use rdma_device::fabric::shm::socket;
    let _hung = socket::listen(&socket::socket_name(&hung_addr).unwrap()).unwrap();
    b.add_peer(HUNG, &hung_addr);
    let (ep, ev) = evil(&b_addr);
    let t0 = Instant::now();
    let mut sent = 0;
    for req in 0..20_000u64 {
        let m = Msg::PlaceFor { req, receiver: HUNG.into(), key: format!("flood{req}"), bytes: 64 };
        if ep.send_msg(&m.encode()).is_err() {
            break;
        }
        sent += 1;
    }
    let cap = rdma_device::constants::MAX_PLACEMENTS_PER_LINK;
    assert!(sent > cap, "only {sent} requests went out");
    // Every request past those under way is answered without waiting.
    let answers = replies(&ev, sent - cap);
    let took = t0.elapsed();
    let refused = answers
        .iter()
        .filter(|m| matches!(m, Msg::PlaceDone { outcome: 2, error, .. } if error.contains(&format!("at most {cap} per peer"))))
        .count();
    assert!(refused > 0, "no answer named the cap: {:?}", answers.first());
    assert!(!ev.events().iter().any(|x| matches!(x, Ev::Disconnect(..))), "the link stays up");
    // The node still moves tensors between well-behaved peers, promptly.
    let t1 = Instant::now();
    let r = recv_async(&b, &task(0), "after-flood", 3);
    send_wait(&a, &task(1), "after-flood", 3, meta(100), pattern(3, 400)).unwrap();
    assert_eq!(r.recv_timeout(Duration::from_secs(10)).unwrap().unwrap().bytes(), &pattern(3, 400)[..]);
    println!("flood: {sent} requests sent, {refused} refused naming the cap, {} answers after {took:?}; a good transfer then took {:?}", answers.len(), t1.elapsed());
}
