//! Routes and strict mode at the library's level, with real nodes over
//! shm (src/node/routes.rs): what the TensorFlow shim relies on, now that it
//! keeps no route table, queue, demotion or strict flag of its own.
//! - a peer learnt without waiting (`set_peer`) has a pending route until
//!   it is chosen on `rdev-route`; sends made meanwhile queue and arrive;
//! - a peer no transport reaches goes over gRPC: `NotViable` (the caller's
//!   stock path), or `Strict` with RDMA_DEVICE_STRICT, for the route, a
//!   send, a receive and a fallback the caller found;
//! - a peer that does not run the transport is demoted on first contact,
//!   with the same two outcomes;
//! - a connect (so a placement) to a peer not yet added waits for it.

mod common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use rdma_device::config::Config;
use rdma_device::node::{Node, RouteNow};
use rdma_device::rendezvous::TensorMeta;
use rdma_device::Error;

fn meta(len: usize) -> TensorMeta {
    TensorMeta { dtype: 1, flags: 0, dims: [len as i64].as_slice().into() }
}

fn strict(on: bool) -> Config {
    Config { strict: on, ..small_config() }
}

/// A peer address that no transport reaches from here (TEST-NET-1, never
/// this host: shm refuses it at once, and no RDMA device exists here).
const FAR: &str = "192.0.2.1:1";

/// Waits until `peer`'s route on `n` is no longer pending.
fn chosen(n: &Node, peer: &str) -> Result<RouteNow, Error> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match n.route(peer) {
            Ok(RouteNow::Pending) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(2)),
            Ok(RouteNow::Pending) => panic!("the route to {peer} is still pending after 10 s"),
            r => return r,
        }
    }
}

/// Sends `data` and returns the send's outcome, whether the send refused at
/// once or its completion failed later.
fn send_outcome(n: &Node, peer: &str, key: &str, data: Vec<u8>) -> Result<(), Error> {
    let (tx, rx) = mpsc::channel();
    let len = data.len();
    n.send(peer, key, 1, meta(len), Box::new(data), Box::new(move |r| tx.send(r).unwrap()))?;
    rx.recv_timeout(Duration::from_secs(30)).expect("a send's completion never ran")
}

#[test]
fn sends_made_while_a_route_is_pending_queue_and_arrive() {
    // 20 rounds, each with a new receiver: the first sends race with the
    // choice (pending, or chosen just before), and every one must arrive.
    let tx_port = free_port();
    let a = Node::new(small_config(), &task(0), &addr(tx_port)).unwrap();
    for round in 0..20u64 {
        let (tb, pb) = (task(1 + round as usize), free_port());
        let b = Node::new(small_config(), &tb, &addr(pb)).unwrap();
        b.add_peer(&task(0), &addr(tx_port));
        assert!(a.set_peer(&tb, &addr(pb)), "a new peer starts a choice");
        assert!(!a.set_peer(&tb, &addr(pb)), "the same address again changes nothing");
        let mut pending = Vec::new();
        for k in 0..3 {
            let key = format!("edge;{k}");
            let data = pattern(round * 10 + k, 4096);
            let (done_tx, done_rx) = mpsc::channel();
            a.send(&tb, &key, 1, meta(4096), Box::new(data.clone()), Box::new(move |r| done_tx.send(r).unwrap()))
                .expect("a send to a peer being chosen queues");
            pending.push((key, data, done_rx));
        }
        for (key, data, done) in pending {
            let lease = recv_wait(&b, &task(0), &key, 1).unwrap();
            assert_eq!(lease.bytes(), &data[..], "round {round}, {key}");
            done.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
        }
        assert_eq!(chosen(&a, &tb).unwrap(), RouteNow::Device(rdma_device::fabric::TransportKind::Shm));
    }
}

fn far_peer_goes_over_grpc(is_strict: bool) {
    let a = Node::new(strict(is_strict), &task(0), &addr(free_port())).unwrap();
    let far = task(9);
    a.set_peer(&far, FAR);
    // A send made before the choice is in fails the same way as one after.
    let early = send_outcome(&a, &far, "early", pattern(1, 64));
    let route = chosen(&a, &far);
    let late = send_outcome(&a, &far, "late", pattern(2, 64));
    let recv = recv_wait(&a, &far, "in", 1).map(|_| ());
    let fallback = a.grpc_fallback(&far, "a chunk in device memory");
    let unknown = a.route(&task(8));
    if is_strict {
        for (what, r) in [("route", route.map(|_| ())), ("early send", early), ("late send", late), ("receive", recv), ("fallback", fallback), ("unknown task", unknown.map(|_| ()))] {
            match r {
                Err(Error::Strict(m)) => assert!(m.contains("RDMA_DEVICE_STRICT is set but tensors with"), "{what}: {m}"),
                other => panic!("{what}: want a strict-mode refusal, got {other:?}"),
            }
        }
    } else {
        match route {
            Ok(RouteNow::Grpc(why)) => assert!(why.contains("not on this host"), "{why}"),
            other => panic!("route: want gRPC, got {other:?}"),
        }
        for (what, r) in [("early send", early), ("late send", late), ("receive", recv)] {
            assert!(matches!(r, Err(Error::NotViable(_))), "{what}: want NotViable (the stock path), got {r:?}");
        }
        assert_eq!(fallback, Ok(()));
        match unknown {
            Ok(RouteNow::Grpc(why)) => assert!(why.contains("not in any cluster spec"), "{why}"),
            other => panic!("unknown task: want gRPC, got {other:?}"),
        }
    }
}

#[test]
fn a_peer_no_transport_reaches_goes_over_grpc() {
    far_peer_goes_over_grpc(false);
}

#[test]
fn in_strict_mode_every_way_to_grpc_is_refused() {
    far_peer_goes_over_grpc(true);
}

fn demoted_on_first_contact(is_strict: bool) {
    // On this host, but nothing listens: the peer does not run this
    // transport, which first contact shows; it is routed over gRPC for good.
    let a = Node::new(strict(is_strict), &task(0), &addr(free_port())).unwrap();
    let peer = task(1);
    let c = a.add_peer(&peer, &addr(free_port()));
    assert!(c.transport.is_some(), "chosen before contact: {}", c.reason);
    let first = send_outcome(&a, &peer, "k", pattern(3, 128));
    let after = a.route(&peer);
    if is_strict {
        assert!(matches!(first, Err(Error::Strict(_))), "{first:?}");
        assert!(matches!(after, Err(Error::Strict(_))), "{after:?}");
    } else {
        assert!(matches!(first, Err(Error::NotViable(_))), "{first:?}");
        assert!(matches!(after, Ok(RouteNow::Grpc(_))), "{after:?}");
        let again = send_outcome(&a, &peer, "k2", pattern(4, 128));
        assert!(matches!(again, Err(Error::NotViable(_))), "demoted for good: {again:?}");
    }
}

#[test]
fn a_peer_that_does_not_run_the_transport_is_demoted() {
    demoted_on_first_contact(false);
}

#[test]
fn in_strict_mode_a_demoted_peer_is_refused() {
    demoted_on_first_contact(true);
}

#[test]
fn a_placement_waits_for_a_peer_added_after_it_starts() {
    // Tasks learn of each other as they start: a placement towards a peer
    // not added yet waits for it (within its deadline), never fails at
    // random ("unknown peer: add it first" did, 3 of 10 starts of `bench py`).
    let (pa, pb) = (free_port(), free_port());
    let a = std::sync::Arc::new(Node::new(small_config(), &task(0), &addr(pa)).unwrap());
    let b = Node::new(small_config(), &task(1), &addr(pb)).unwrap();
    b.add_peer(&task(0), &addr(pa));
    let placer = {
        let a = a.clone();
        std::thread::spawn(move || a.place_ahead(&task(1), "edge;placed", 4096, Duration::from_secs(10)))
    };
    std::thread::sleep(Duration::from_millis(300));
    a.set_peer(&task(1), &addr(pb));
    assert_eq!(placer.join().unwrap(), Ok(true));
    // A peer never added: a clear error once the deadline passes.
    let t = Instant::now();
    match a.place_ahead(&task(7), "edge;nobody", 4096, Duration::from_millis(300)) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("was not added"), "{m}"),
        other => panic!("want an unknown-peer error, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}
