//! Calls over the transport (`node::rpc`): what the shim's worker RPCs rely
//! on. Two nodes: calls both ways, each over the connection its caller
//! dialled, bodies of several parts intact, deadlines, cancellation both
//! sides, a lost peer, no connection at all (the caller goes another way),
//! and an impostor that connects first under another task's name.

mod common;

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use rdma_device::node::rpc::{Server, CODE_CANCELLED, CODE_DEADLINE_EXCEEDED, CODE_UNAVAILABLE};
use rdma_device::node::Node;
use rdma_device::Error;

/// Echoes method 1 (reversed body), never answers method 2, fails method 3.
struct Echo {
    node: Mutex<Option<std::sync::Weak<Node>>>,
    cancelled: mpsc::Sender<u64>,
    held: Mutex<Vec<u64>>,
}

impl Server for Echo {
    fn call(&self, handle: u64, method: u32, mut body: Vec<u8>) {
        let n = self.node.lock().unwrap().as_ref().and_then(|w| w.upgrade()).expect("node");
        match method {
            1 => {
                body.reverse();
                n.rpc_reply(handle, 0, &body);
            }
            2 => self.held.lock().unwrap().push(handle),
            _ => n.rpc_reply(handle, 3, b"bad argument"),
        }
    }

    fn cancel(&self, handle: u64) {
        let _ = self.cancelled.send(handle);
    }
}

fn pair() -> (Arc<Node>, Arc<Node>, String, String, Arc<Echo>, mpsc::Receiver<u64>) {
    let (pa, pb) = (free_port(), free_port());
    let (ta, tb) = (task(0), task(1));
    let a = Arc::new(Node::new(small_config(), &ta, &addr(pa)).unwrap());
    let b = Arc::new(Node::new(small_config(), &tb, &addr(pb)).unwrap());
    a.add_peer(&tb, &addr(pb));
    b.add_peer(&ta, &addr(pa));
    let (tx, rx) = mpsc::channel();
    let echo = Arc::new(Echo { node: Mutex::new(None), cancelled: tx, held: Mutex::new(Vec::new()) });
    for n in [&a, &b] {
        *echo.node.lock().unwrap() = Some(Arc::downgrade(n));
    }
    (a, b, ta, tb, echo, rx)
}

fn call(n: &Node, peer: &str, method: u32, body: &[u8], timeout: Option<Duration>) -> (u64, mpsc::Receiver<(u32, Vec<u8>)>) {
    let (tx, rx) = mpsc::channel();
    let id = n
        .rpc_call(peer, method, body, timeout, Box::new(move |code, reply| {
            let _ = tx.send((code, reply));
        }))
        .expect("the call starts");
    (id, rx)
}

#[test]
fn calls_go_both_ways_over_dialled_connections_with_large_bodies() {
    let (a, b, ta, tb, echo, _cancelled) = pair();
    // No connection yet: refused at once, so the caller goes another way.
    let e = a.rpc_call(&tb, 1, b"x", None, Box::new(|_, _| panic!("must not run"))).unwrap_err();
    assert!(matches!(e, Error::NotViable(_)), "{e}");
    a.connect(&tb).unwrap(); // one connection, a → b
    // b did not dial a: a connection a opened is not b's to call over (the
    // task at its other end named itself).
    let e = b.rpc_call(&ta, 1, b"x", None, Box::new(|_, _| panic!("must not run"))).unwrap_err();
    assert!(matches!(e, Error::NotViable(_)), "{e}");
    b.connect(&ta).unwrap(); // and b → a
    for (caller, callee, peer) in [(&a, &b, &tb), (&b, &a, &ta)] {
        *echo.node.lock().unwrap() = Some(Arc::downgrade(callee));
        callee.rpc_serve(Some(echo.clone()));
        for len in [0usize, 5, 64 << 10, 300_000] {
            let body = pattern(len as u64, len);
            let (_, rx) = call(caller, peer, 1, &body, None);
            let (code, reply) = rx.recv_timeout(Duration::from_secs(10)).expect("reply");
            let mut want = body.clone();
            want.reverse();
            assert_eq!(code, 0);
            assert!(reply == want, "{len}-byte body came back altered");
        }
        let (_, rx) = call(caller, peer, 3, b"", None);
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), (3, b"bad argument".to_vec()));
        callee.rpc_serve(None);
    }
    let s = rdma_device::stats::Stats::global();
    assert!(s.get("worker_rpcs_over_transport").unwrap() >= 10);
}

/// Records every call it is handed, answers each "impostor".
struct Impostor {
    node: Mutex<Option<std::sync::Weak<Node>>>,
    got: Mutex<Vec<Vec<u8>>>,
}

impl Server for Impostor {
    fn call(&self, handle: u64, _method: u32, body: Vec<u8>) {
        self.got.lock().unwrap().push(body);
        if let Some(n) = self.node.lock().unwrap().as_ref().and_then(|w| w.upgrade()) {
            n.rpc_reply(handle, 0, b"impostor");
        }
    }
    fn cancel(&self, _handle: u64) {}
}

#[test]
fn calls_go_only_to_the_task_dialled_at_its_address_never_to_an_impostor() {
    let (a, b, ta, tb, echo, _cancelled) = pair();
    *echo.node.lock().unwrap() = Some(Arc::downgrade(&b));
    b.rpc_serve(Some(echo.clone()));
    // A process at another address that calls itself b connects to a
    // first (a's cluster spec has b at b's address).
    let pi = free_port();
    let imp = Arc::new(Node::new(small_config(), &tb, &addr(pi)).unwrap());
    let srv = Arc::new(Impostor { node: Mutex::new(Some(Arc::downgrade(&imp))), got: Mutex::new(Vec::new()) });
    imp.rpc_serve(Some(srv.clone()));
    imp.add_peer(&ta, a.addr());
    imp.connect(&ta).expect("the impostor connects to a");
    // a has a connection from "b" but dialled none: refused, so the
    // caller goes another way (TF's gRPC dials b's address).
    let e = a.rpc_call(&tb, 1, b"run this graph", None, Box::new(|_, _| panic!("must not run"))).unwrap_err();
    assert!(matches!(e, Error::NotViable(_)), "{e}");
    a.connect(&tb).unwrap();
    let (_, rx) = call(&a, &tb, 1, b"run this graph", None);
    let (code, reply) = rx.recv_timeout(Duration::from_secs(10)).expect("reply");
    assert_eq!((code, reply), (0, b"hparg siht nur".to_vec()), "the call went to the impostor");
    assert!(srv.got.lock().unwrap().is_empty(), "the impostor was handed {} calls", srv.got.lock().unwrap().len());
}

#[test]
fn deadlines_and_cancellation_reach_both_sides() {
    let (a, b, _ta, tb, echo, cancelled) = pair();
    *echo.node.lock().unwrap() = Some(Arc::downgrade(&b));
    b.rpc_serve(Some(echo.clone()));
    a.connect(&tb).unwrap();
    // A deadline: DEADLINE_EXCEEDED within the check interval (1 s) of it,
    // and the callee's call is cancelled.
    let t0 = Instant::now();
    let (_, rx) = call(&a, &tb, 2, b"hang", Some(Duration::from_millis(300)));
    let (code, _) = rx.recv_timeout(Duration::from_secs(5)).expect("the deadline fires");
    assert_eq!(code, CODE_DEADLINE_EXCEEDED);
    assert!(t0.elapsed() < Duration::from_millis(300 + 1500), "{:?}", t0.elapsed());
    cancelled.recv_timeout(Duration::from_secs(5)).expect("the callee saw the cancel");
    // The caller cancels: CANCELLED at once, the callee told.
    let (id, rx) = call(&a, &tb, 2, b"hang", None);
    std::thread::sleep(Duration::from_millis(50));
    a.rpc_cancel(id);
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap().0, CODE_CANCELLED);
    cancelled.recv_timeout(Duration::from_secs(5)).expect("the callee saw the cancel");
}

#[test]
fn a_lost_peer_fails_its_calls() {
    let (a, b, _ta, tb, echo, _cancelled) = pair();
    *echo.node.lock().unwrap() = Some(Arc::downgrade(&b));
    b.rpc_serve(Some(echo.clone()));
    a.connect(&tb).unwrap();
    let (_, rx) = call(&a, &tb, 2, b"hang", None);
    std::thread::sleep(Duration::from_millis(50));
    let t0 = Instant::now();
    b.rpc_serve(None);
    drop(echo);
    drop(b);
    let (code, msg) = rx.recv_timeout(Duration::from_secs(5)).expect("the call fails");
    assert_eq!(code, CODE_UNAVAILABLE, "{}", String::from_utf8_lossy(&msg));
    assert!(t0.elapsed() < Duration::from_secs(5));
}

/// Replies to every method but 3 with its body reversed (3: an error), and
/// records for each call whether it ran on the transport's event thread.
struct Where {
    node: Mutex<Option<std::sync::Weak<Node>>>,
    seen: Mutex<Vec<(u32, bool)>>,
}

impl Server for Where {
    fn call(&self, handle: u64, method: u32, mut body: Vec<u8>) {
        self.seen.lock().unwrap().push((method, rdma_device::fabric::on_event_thread()));
        let n = self.node.lock().unwrap().as_ref().and_then(|w| w.upgrade()).expect("node");
        if method == 3 {
            n.rpc_reply(handle, 3, b"bad argument");
        } else {
            body.reverse();
            n.rpc_reply(handle, 0, &body);
        }
    }

    fn cancel(&self, _handle: u64) {}
}

#[test]
fn methods_served_and_calls_completed_on_the_event_thread_run_there_failures_and_large_replies_do_not() {
    use rdma_device::node::rpc::EVENT_THREAD_REPLY_MAX;
    let (a, b, _ta, tb, _echo, _cancelled) = pair();
    let srv = Arc::new(Where { node: Mutex::new(Some(Arc::downgrade(&b))), seen: Mutex::new(Vec::new()) });
    b.rpc_serve_on_event_thread(1).unwrap();
    let e = b.rpc_serve_on_event_thread(64).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    b.rpc_serve(Some(srv.clone()));
    a.connect(&tb).unwrap();
    // (method, body length, caller fit for the event thread) -> (code, did done run on the event thread)
    let run = |method: u32, len: usize, on_event_thread: bool| {
        let (tx, rx) = mpsc::channel();
        let done = Box::new(move |code: u32, reply: Vec<u8>| {
            let _ = tx.send((code, reply.len(), rdma_device::fabric::on_event_thread()));
        });
        let body = pattern(len as u64, len);
        if on_event_thread {
            a.rpc_call_on_event_thread(&tb, method, &body, None, done).unwrap();
        } else {
            a.rpc_call(&tb, method, &body, None, done).unwrap();
        }
        rx.recv_timeout(Duration::from_secs(10)).expect("the call completes")
    };
    // Served (method 1) and completed on the event thread: both there.
    assert_eq!(run(1, 100, true), (0, 100, true));
    // A plain call of the same method: its done on rdev-callbacks.
    assert_eq!(run(1, 100, false), (0, 100, false));
    // A method not served on the event thread: on rdev-callbacks.
    assert_eq!(run(5, 100, true), (0, 100, true));
    // A reply larger than EVENT_THREAD_REPLY_MAX, an error: on rdev-callbacks.
    assert_eq!(run(1, EVENT_THREAD_REPLY_MAX + 1, true), (0, EVENT_THREAD_REPLY_MAX + 1, false));
    assert_eq!(run(3, 10, true), (3, 12, false));
    let seen = srv.seen.lock().unwrap().clone();
    assert_eq!(seen, vec![(1, true), (1, true), (5, false), (1, true), (3, false)]);
}

/// Issue 31 (B): a call and a reply of more than 1 GiB (stock gRPC carries
/// up to 2 GiB; the transport once failed the whole link on a reply past
/// 1 GiB) arrive whole, byte for byte, and the link stays up for the next
/// call. TensorFlow 2.21 itself puts no fetched tensor in a remote RunGraph
/// reply (the master receives fetches on its own device, as tensors), so
/// this is shown here, at the transport's call channel.
#[test]
fn a_call_and_a_reply_over_1_gib_arrive_whole_and_the_link_stays_up() {
    const LEN: usize = 1_200_000_000;
    let (a, b, _ta, tb, echo, _cancelled) = pair();
    a.connect(&tb).unwrap();
    *echo.node.lock().unwrap() = Some(Arc::downgrade(&b));
    b.rpc_serve(Some(echo.clone()));
    let body = pattern(7, LEN);
    // The caller's thread (TF's master, in the shim) only starts the call:
    // it copies the body once and sends its first parts, leaving the rest
    // to the pacing thread; it never waits for the link to take 1.2 GB.
    // Bounded by what one copy of the body costs here, measured first,
    // with room for a busy machine (emulated verbs in a VM under load:
    // one copy 23 s, the call's start 158 s; the call's whole transfer,
    // which the start waited for before the pacing thread, 287 s).
    let t0 = Instant::now();
    let copy = std::hint::black_box(body.clone());
    let one_copy = t0.elapsed();
    drop(copy);
    let t0 = Instant::now();
    let (_, rx) = call(&a, &tb, 1, &body, None);
    let started = t0.elapsed();
    assert!(started < 8 * one_copy + Duration::from_secs(10), "starting the call held its thread {started:?} (one copy of the body: {one_copy:?})");
    // Soft-RoCE under emulation moves a few MB/s: its run sets a longer wait.
    let wait = std::env::var("NODE_RPC_BIG_WAIT_S").ok().and_then(|s| s.parse().ok()).unwrap_or(300);
    let (code, reply) = rx.recv_timeout(Duration::from_secs(wait)).unwrap_or_else(|e| panic!("no reply within {wait} s: {e}"));
    assert_eq!(code, 0, "{}", String::from_utf8_lossy(&reply[..reply.len().min(200)]));
    assert_eq!(reply.len(), LEN);
    // Echo reverses the body: every byte, in place.
    let bad = reply.iter().zip(body.iter().rev()).position(|(x, y)| x != y);
    assert!(bad.is_none(), "the reply differs at byte {bad:?}");
    drop((body, reply));
    let (_, rx) = call(&a, &tb, 1, b"after", None);
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)).expect("the link is still up"), (0, b"retfa".to_vec()));
    b.rpc_serve(None);
}
