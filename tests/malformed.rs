//! Hostile or broken peers: malformed, truncated and out-of-protocol
//! control messages, bad handshakes, bogus writes. Each must be rejected
//! with an error (the offending connection closed), never a panic, and the
//! node must keep serving well-behaved peers.

mod common;

use std::io::Write;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use rdma_device::fabric::conformance::{Ev, Recorder};
use rdma_device::fabric::{Endpoint, Fabric};
use rdma_device::node::Node;
use rdma_device::rendezvous::{Hello, Msg, SlotHeader, TensorMeta};
use rdma_device::stats::Stats;

static PANICS: AtomicUsize = AtomicUsize::new(0);

fn count_panics() {
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        prev(info);
    }));
}

struct Fixture {
    b: Node,
    b_addr: String,
    a: Node,
}

fn fixture() -> Fixture {
    let (pa, pb) = (free_port(), free_port());
    let b_addr = addr(pb);
    let b = Node::new(small_config(), &task(1), &b_addr).unwrap();
    let a = Node::new(small_config(), &task(0), &addr(pa)).unwrap();
    a.add_peer(&task(1), &b_addr);
    b.add_peer(&task(0), &addr(pa));
    b.add_peer("/job:evil/replica:0/task:0", &addr(1));
    Fixture { b, b_addr, a }
}

/// The node still moves a tensor between well-behaved peers.
fn still_serves(f: &Fixture, step: u64) {
    let data = pattern(step, 10_000);
    let r = recv_async(&f.b, &task(0), "good", step);
    send_wait(&f.a, &task(1), "good", step, TensorMeta { dtype: 1, flags: 0, dims: vec![10_000].into() }, data.clone()).unwrap();
    let l = r.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
    assert_eq!(l.bytes(), &data[..]);
}

fn evil(f: &Fixture) -> (Arc<dyn Endpoint>, Arc<Recorder>) {
    let ev = Recorder::new(b"", None);
    let hello = Hello { task: "/job:evil/replica:0/task:0".into(), incarnation: 7, target: task(1), rpc: false, proof: vec![] }.encode();
    let ep = evil_fabric().connect(&f.b_addr, &hello, ev.clone(), Duration::from_secs(5), true).unwrap();
    (ep, ev)
}

/// The fabric the hostile peer speaks: the node's own first transport (shm,
/// or verbs when the suite runs over verbs: RDMA_DEVICE_TRANSPORTS=verbs).
fn evil_fabric() -> Arc<dyn Fabric> {
    rdma_device::fabric::build_all(&small_config()).remove(0)
}

fn closed(ev: &Recorder) {
    ev.wait_for("the node to close the connection", |e| e.iter().any(|x| matches!(x, Ev::Disconnect(..))));
}

#[test]
fn hostile_inputs_are_rejected_without_panics() {
    count_panics();
    let f = fixture();
    still_serves(&f, 1);

    // 1. Garbage and truncated control messages.
    let good = Msg::Announce { key: "k".into(), step: 1, need: 100, returned: vec![(1, 1)] }.encode().into_vec();
    for bad in [vec![], vec![0xff], vec![1, 200, 0, 0], good[..good.len() - 1].to_vec(), [good.clone(), vec![0]].concat()] {
        let (ep, ev) = evil(&f);
        ep.send_msg(&bad).unwrap();
        closed(&ev);
    }
    still_serves(&f, 2);

    // 2. A message the receiver side never accepts (Publish sent to it).
    let (ep, ev) = evil(&f);
    ep.send_msg(&Msg::Publish { key: "k".into(), edge_id: 1, slots: vec![] }.encode()).unwrap();
    closed(&ev);

    // 3. An absurd size: refused with NoSpace, the connection survives.
    let (ep, ev) = evil(&f);
    ep.send_msg(&Msg::Announce { key: "huge".into(), step: 1, need: 1 << 60, returned: vec![] }.encode()).unwrap();
    let evs = ev.wait_for("a reply", |e| e.iter().any(|x| matches!(x, Ev::Msg(..))));
    let reply = evs.iter().find_map(|x| if let Ev::Msg(_, m) = x { Some(Msg::decode(m).unwrap()) } else { None }).unwrap();
    assert!(matches!(reply, Msg::NoSpace { .. }), "{reply:?}");

    // 4. A stream claiming an absurd total: refused with a reason, the
    // connection survives. Stream data out of order, or of a stream never
    // begun, closes it.
    ep.send_msg(&Msg::StreamBegin { stream: 1, key: "i".into(), step: 1, meta: TensorMeta::default(), total: u64::MAX }.encode()).unwrap();
    let evs = ev.wait_for("a refusal", |e| e.iter().filter(|x| matches!(x, Ev::Msg(..))).count() >= 2);
    let refused = evs.iter().filter_map(|x| if let Ev::Msg(_, m) = x { Msg::decode(m).ok() } else { None }).any(|m| matches!(m, Msg::StreamReady { outcome: rdma_device::rendezvous::wire::STREAM_REFUSED, .. }));
    assert!(refused, "{evs:?}");
    ep.send_msg(&Msg::StreamData { stream: 7, offset: 0, bytes: vec![1] }.encode()).unwrap();
    closed(&ev);
    let (ep, ev) = evil(&f);
    ep.send_msg(&Msg::StreamBegin { stream: 1, key: "i".into(), step: 1, meta: TensorMeta::default(), total: 10 }.encode()).unwrap();
    ep.send_msg(&Msg::StreamData { stream: 1, offset: 5, bytes: vec![1] }.encode()).unwrap();
    closed(&ev);

    // 5. Writes into slots never published, and with a forged header.
    // shm delivers the bogus write and the receiver rejects it; over verbs
    // with memory windows the NIC already refuses it (no key grants that
    // range: a remote access error at the sender). Either way the
    // connection is closed.
    let verbs = evil_fabric().kind() == rdma_device::fabric::TransportKind::Verbs;
    let rejected_before = Stats::global().get("rejected_writes").unwrap();
    let (ep, ev) = evil(&f);
    let (tx, rx) = std::sync::mpsc::channel();
    ep.write_imm(0, 0, vec![Box::new(vec![0u8; 512])], 12345, Box::new(move |r| tx.send(r).unwrap()));
    match rx.recv_timeout(Duration::from_secs(5)).unwrap() {
        Ok(()) => {}
        Err(e) => assert!(verbs && e.message().contains("remote access error"), "{e}"),
    }
    closed(&ev);
    let (ep, ev) = evil(&f);
    ep.send_msg(&Msg::Announce { key: "forged".into(), step: 1, need: 64, returned: vec![] }.encode()).unwrap();
    let evs = ev.wait_for("publish", |e| e.iter().any(|x| matches!(x, Ev::Msg(..))));
    let Some(Msg::Publish { slots, edge_id, .. }) = evs.iter().find_map(|x| if let Ev::Msg(_, m) = x { Some(Msg::decode(m).unwrap()) } else { None }) else {
        panic!("expected a publish")
    };
    let s = slots[0];
    let forged = SlotHeader { edge_id, slot: s.id, gen: s.gen, incarnation: 7, step: 1, len: s.capacity + 1, meta: TensorMeta::default(), chunk: None };
    let (tx, rx) = std::sync::mpsc::channel();
    ep.write_imm(s.offset, s.key, vec![Box::new(forged.encode())], s.id, Box::new(move |r| tx.send(r).unwrap()));
    // Over verbs the receiver may close the connection before the write's
    // own completion reaches the sender: then the write reports that.
    if let Err(e) = rx.recv_timeout(Duration::from_secs(5)).unwrap() {
        assert!(verbs, "{e}");
    }
    closed(&ev);
    // The bogus writes that reached the receiver were counted as rejected
    // (both on shm; the forged header at least over verbs).
    let rejected = Stats::global().get("rejected_writes").unwrap() - rejected_before;
    assert!(rejected >= if verbs { 1 } else { 2 }, "rejected_writes = {rejected}");

    // 6. Bad handshakes: garbage hello, wrong target, wrong version, a
    // sender in RDMA_DEVICE_MODE=rpc connecting to a task that pushes.
    let fab = evil_fabric();
    for hello in [
        b"garbage".to_vec(),
        Hello { task: "x".into(), incarnation: 1, target: "/job:someone/else".into(), rpc: false, proof: vec![] }.encode(),
        { let mut h = Hello { task: "x".into(), incarnation: 1, target: String::new(), rpc: false, proof: vec![] }.encode(); h[4] = h[4].wrapping_add(1); h },
        Hello { task: "x".into(), incarnation: 1, target: String::new(), rpc: true, proof: vec![] }.encode(),
    ] {
        let r = fab.connect(&f.b_addr, &hello, Recorder::new(b"", None), Duration::from_secs(5), true);
        assert!(r.is_err(), "a bad handshake must be refused");
    }

    // 7. Raw socket abuse: truncated frames, an absurd frame length (the
    // shm control socket; rdma_cm frames its own private data).
    if local_transport() == "shm" {
    let port = f.b_addr.rsplit(':').next().unwrap();
    // SAFETY: getuid has no preconditions.
    let name = format!("rdma_device.{}.{port}", unsafe { libc::getuid() });
    for bytes in [vec![10u8, 0, 0], vec![0xff, 0xff, 0xff, 0x7f, 1, 0, 0], vec![3, 0, 0, 0, 1, b'x']] {
        let mut s = UnixStream::connect_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
        s.write_all(&bytes).unwrap();
        drop(s);
    }
    }

    std::thread::sleep(Duration::from_millis(200));
    still_serves(&f, 3);
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "no input may cause a panic");
}
