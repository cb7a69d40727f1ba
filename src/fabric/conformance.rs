//! The conformance suite for backends, written once over the [`Fabric`]
//! trait. Every backend runs it unchanged: `tests/fabric_shm.rs` on shm,
//! `tests/fabric_verbs.rs` on verbs (inside the Soft-RoCE VM). Use
//! [`fabric_conformance_tests!`] to instantiate one `#[test]` per case.
//!
//! Cases panic with a message on failure (they are test code).

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};
use crate::fabric::{Arena, ConnId, Endpoint, Fabric, FabricEvents, Listener};

/// What a case needs: a backend and fresh listen addresses for it.
pub struct Harness {
    pub fabric: Arc<dyn Fabric>,
    /// A fresh "host:port" this backend can listen on and connect to.
    pub addr: Box<dyn Fn() -> String>,
}

const WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, PartialEq)]
pub enum Ev {
    Accept(ConnId, Vec<u8>),
    Imm(ConnId, u32, bool),
    Msg(ConnId, Vec<u8>),
    Disconnect(ConnId, String),
}

/// The listener `on_accept` sends on, and what it sends.
type AcceptSends = (std::sync::Weak<dyn Listener>, Vec<Vec<u8>>);

/// Records events; optionally checks at `on_write_imm` time that the
/// arena already holds the expected bytes (visibility before completion).
pub struct Recorder {
    evs: Mutex<Vec<Ev>>,
    cv: Condvar,
    refuse: bool,
    reply: Vec<u8>,
    arena: Option<Arc<Arena>>,
    expect: Mutex<Vec<(u32, usize, Vec<u8>)>>,
    /// Messages `on_accept` sends on the connection it accepts (as a node
    /// may, from any thread, once it knows the connection), and what each
    /// send returned.
    on_accept_send: Mutex<Option<AcceptSends>>,
    accept_sends: Mutex<Vec<Result<()>>>,
    /// The connection nonces seen: by `on_accept` (receiver) or
    /// `sign_hello` (sender), in order.
    nonces: Mutex<Vec<Vec<u8>>>,
}

impl Recorder {
    pub fn new(reply: &[u8], arena: Option<Arc<Arena>>) -> Arc<Recorder> {
        Arc::new(Recorder { evs: Mutex::new(Vec::new()), cv: Condvar::new(), refuse: false, reply: reply.to_vec(), arena, expect: Mutex::new(Vec::new()), on_accept_send: Mutex::new(None), accept_sends: Mutex::new(Vec::new()), nonces: Mutex::new(Vec::new()) })
    }

    pub fn refusing() -> Arc<Recorder> {
        Arc::new(Recorder { evs: Mutex::new(Vec::new()), cv: Condvar::new(), refuse: true, reply: vec![], arena: None, expect: Mutex::new(Vec::new()), on_accept_send: Mutex::new(None), accept_sends: Mutex::new(Vec::new()), nonces: Mutex::new(Vec::new()) })
    }

    /// When imm `imm` arrives, the arena must hold `bytes` at `off`.
    pub fn expect_at(&self, imm: u32, off: usize, bytes: Vec<u8>) {
        self.expect.lock().push((imm, off, bytes));
    }

    fn push(&self, e: Ev) {
        self.evs.lock().push(e);
        self.cv.notify_all();
    }

    /// Wait until `pred` holds over the events, or panic after WAIT.
    pub fn wait_for(&self, what: &str, pred: impl Fn(&[Ev]) -> bool) -> Vec<Ev> {
        let deadline = Instant::now() + WAIT;
        let mut g = self.evs.lock();
        while !pred(&g) {
            if self.cv.wait_until(&mut g, deadline).timed_out() && !pred(&g) {
                panic!("timed out waiting for {what}; events: {:?}", summarize(&g));
            }
        }
        g.clone()
    }

    pub fn events(&self) -> Vec<Ev> {
        self.evs.lock().clone()
    }

    /// The connection nonces this recorder saw, in order.
    pub fn nonces(&self) -> Vec<Vec<u8>> {
        self.nonces.lock().clone()
    }
}

fn summarize(evs: &[Ev]) -> Vec<String> {
    evs.iter()
        .map(|e| match e {
            Ev::Msg(c, m) => format!("Msg({c}, {} bytes)", m.len()),
            other => format!("{other:?}"),
        })
        .collect()
}

impl FabricEvents for Recorder {
    fn sign_hello(&self, hello: &[u8], nonce: &[u8]) -> Vec<u8> {
        self.nonces.lock().push(nonce.to_vec());
        hello.to_vec()
    }
    fn on_accept(&self, conn: ConnId, hello: &[u8], nonce: &[u8]) -> Result<Vec<u8>> {
        self.nonces.lock().push(nonce.to_vec());
        if self.refuse {
            return Err(Error::InvalidArgument("refused by test".into()));
        }
        let send = self.on_accept_send.lock().clone();
        if let Some((l, msgs)) = send {
            let l = l.upgrade().expect("the listener is alive while it accepts");
            for m in msgs {
                let r = l.send_msg(conn, &m);
                self.accept_sends.lock().push(r);
            }
        }
        self.push(Ev::Accept(conn, hello.to_vec()));
        Ok(self.reply.clone())
    }

    fn on_write_imm(&self, conn: ConnId, imm: u32) {
        let mut ok = true;
        if let Some(a) = &self.arena {
            let exp = self.expect.lock().iter().find(|(i, _, _)| *i == imm).cloned();
            if let Some((_, off, bytes)) = exp {
                ok = a.copy_out(off, bytes.len()).map(|v| v == bytes).unwrap_or(false);
            }
        }
        self.push(Ev::Imm(conn, imm, ok));
    }

    fn on_message(&self, conn: ConnId, msg: &[u8]) {
        self.push(Ev::Msg(conn, msg.to_vec()));
    }

    fn on_disconnect(&self, conn: ConnId, why: Error) {
        self.push(Ev::Disconnect(conn, why.to_string()));
    }
}

/// A listening receiver and a connected sender.
pub struct Pair {
    pub arena: Arc<Arena>,
    pub rx_events: Arc<Recorder>,
    pub tx_events: Arc<Recorder>,
    pub listener: Arc<dyn Listener>,
    pub ep: Arc<dyn Endpoint>,
    /// The receiver's id for the connection.
    pub rx_conn: ConnId,
    /// The key `grant` gave for the whole arena.
    pub key: u32,
}

pub fn pair(h: &Harness, arena_len: usize) -> Pair {
    let arena = Arc::new(Arena::new("conformance", arena_len).expect("arena"));
    let rx_events = Recorder::new(b"reply-bytes", Some(arena.clone()));
    let tx_events = Recorder::new(b"", None);
    let addr = (h.addr)();
    let listener = h.fabric.listen(&addr, arena.clone(), rx_events.clone()).expect("listen");
    let ep = h.fabric.connect(&addr, b"hello-bytes", tx_events.clone(), WAIT, true).expect("connect");
    let evs = rx_events.wait_for("accept", |e| e.iter().any(|x| matches!(x, Ev::Accept(..))));
    let rx_conn = evs.iter().find_map(|x| if let Ev::Accept(c, _) = x { Some(*c) } else { None }).expect("accept");
    // These tests write anywhere in the arena: let this sender.
    let key = listener.grant(rx_conn, 0, arena.len() as u64).expect("grant").expect("the listener knows its connection");
    Pair { arena, rx_events, tx_events, listener, ep, rx_conn, key }
}

fn write_sync(ep: &dyn Endpoint, key: u32, off: u64, segs: Vec<Vec<u8>>, imm: u32) -> Result<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    let segs = segs.into_iter().map(|s| Box::new(s) as crate::fabric::Segment).collect();
    ep.write_imm(off, key, segs, imm, Box::new(move |r| tx.send(r).expect("channel")));
    rx.recv_timeout(WAIT).expect("write completion within the deadline")
}

fn pattern(seed: u32, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2654435761).wrapping_add(seed) as u8 ^ (i >> 8) as u8).collect()
}

/// Handshake payloads pass both ways untouched; the backend is viable.
pub fn handshake(h: &Harness) {
    h.fabric.is_viable().expect("viable");
    let p = pair(h, 1 << 20);
    assert_eq!(p.ep.peer_hello(), b"reply-bytes");
    assert_eq!(p.ep.remote_len(), p.arena.len() as u64);
    let evs = p.rx_events.events();
    assert!(evs.contains(&Ev::Accept(p.rx_conn, b"hello-bytes".to_vec())));
}

/// Each connection is opened by the receiver with a fresh nonce of
/// `NONCE_LEN` random bytes, which the sender sees before its hello goes
/// out (it signs its hello over it) and `on_accept` gets with the hello.
pub fn nonce_per_connection(h: &Harness) {
    let arena = Arc::new(Arena::new("conformance", 1 << 16).expect("arena"));
    let rx = Recorder::new(b"ok", None);
    let addr = (h.addr)();
    let _l = h.fabric.listen(&addr, arena, rx.clone()).expect("listen");
    let mut eps = Vec::new();
    let mut sent = Vec::new();
    for _ in 0..3 {
        let tx = Recorder::new(b"", None);
        eps.push(h.fabric.connect(&addr, b"h", tx.clone(), WAIT, true).expect("connect"));
        let n = tx.nonces();
        assert_eq!(n.len(), 1, "the sender signs its hello once, over the receiver's nonce");
        sent.push(n[0].clone());
    }
    let got = rx.nonces();
    assert_eq!(got, sent, "on_accept gets the nonce its connection's sender signed over");
    for (i, n) in got.iter().enumerate() {
        assert_eq!(n.len(), crate::fabric::NONCE_LEN);
        assert!(got[..i].iter().all(|m| m != n), "a nonce repeated across connections: {got:?}");
    }
}

/// A refusing receiver makes `connect` fail with a reason, not hang.
pub fn refused_connect(h: &Harness) {
    let arena = Arc::new(Arena::new("conformance", 1 << 16).expect("arena"));
    let addr = (h.addr)();
    let _l = h.fabric.listen(&addr, arena, Recorder::refusing()).expect("listen");
    let t0 = Instant::now();
    let r = h.fabric.connect(&addr, b"x", Recorder::new(b"", None), WAIT, true);
    assert!(t0.elapsed() < WAIT);
    // The receiver's reason reaches the sender with its kind: a refusal is
    // not "this peer does not run the transport" unless it says so (the
    // node routes a NotViable peer over gRPC for good).
    let e = r.map(|_| ()).expect_err("connect to a refusing receiver must fail");
    assert!(matches!(e, Error::InvalidArgument(_)) && e.message().contains("refused by test"), "{e}");
}

/// Writes of many sizes and offsets land bit-exact, and every byte is
/// visible when the receiver sees the immediate.
pub fn writes_land_before_completion(h: &Harness) {
    let p = pair(h, 16 << 20);
    let cases: &[(u64, usize)] = &[(0, 1), (4096, 4096), (8192 + 3, 1000), (1 << 20, 1 << 20), (8 << 20, 4 << 20)];
    for (i, &(off, len)) in cases.iter().enumerate() {
        let data = pattern(i as u32, len);
        p.rx_events.expect_at(100 + i as u32, off as usize, data.clone());
        write_sync(&*p.ep, p.key, off, vec![data], 100 + i as u32).expect("write");
    }
    let evs = p.rx_events.wait_for("all immediates", |e| e.iter().filter(|x| matches!(x, Ev::Imm(..))).count() == cases.len());
    for e in evs {
        if let Ev::Imm(c, imm, ok) = e {
            assert_eq!(c, p.rx_conn);
            assert!(ok, "bytes of write {imm} were not visible when its immediate arrived");
        }
    }
}

/// Several segments are written back to back.
pub fn gather_segments(h: &Harness) {
    let p = pair(h, 1 << 20);
    let (a, b, c) = (pattern(1, 256), pattern(2, 70_000), pattern(3, 5));
    let mut all = a.clone();
    all.extend_from_slice(&b);
    all.extend_from_slice(&c);
    p.rx_events.expect_at(7, 4096, all.clone());
    write_sync(&*p.ep, p.key, 4096, vec![a, b, c], 7).expect("write");
    p.rx_events.wait_for("imm 7", |e| e.iter().any(|x| matches!(x, Ev::Imm(_, 7, true))));
    assert_eq!(p.arena.copy_out(4096, all.len()).unwrap(), all);
}

/// Immediates of one connection arrive in the order written.
pub fn immediates_in_order(h: &Harness) {
    let p = pair(h, 1 << 20);
    let n = 2000u32;
    for i in 0..n {
        write_sync(&*p.ep, p.key, (i as u64 % 64) * 64, vec![vec![i as u8; 64]], i).expect("write");
    }
    let evs = p.rx_events.wait_for("all immediates", |e| e.iter().filter(|x| matches!(x, Ev::Imm(..))).count() == n as usize);
    let imms: Vec<u32> = evs.iter().filter_map(|x| if let Ev::Imm(_, i, _) = x { Some(*i) } else { None }).collect();
    assert_eq!(imms, (0..n).collect::<Vec<_>>());
}

/// Writes outside the peer's arena fail through `done`; nothing lands.
pub fn out_of_range_write_fails(h: &Harness) {
    let p = pair(h, 1 << 20);
    let len = p.ep.remote_len();
    assert!(write_sync(&*p.ep, p.key, len - 10, vec![vec![0; 100]], 1).is_err());
    assert!(write_sync(&*p.ep, p.key, u64::MAX - 5, vec![vec![0; 100]], 2).is_err());
    std::thread::sleep(Duration::from_millis(100));
    assert!(!p.rx_events.events().iter().any(|x| matches!(x, Ev::Imm(..))));
}

/// Control messages flow both ways, in order, up to the size limit.
pub fn messages_both_ways(h: &Harness) {
    let p = pair(h, 1 << 20);
    let max = crate::constants::MAX_MSG_BYTES;
    let msgs: Vec<Vec<u8>> = vec![b"one".to_vec(), pattern(4, 1000), pattern(5, max)];
    for m in &msgs {
        p.ep.send_msg(m).expect("sender → receiver");
        p.listener.send_msg(p.rx_conn, m).expect("receiver → sender");
    }
    let got = p.rx_events.wait_for("3 messages", |e| e.iter().filter(|x| matches!(x, Ev::Msg(..))).count() == 3);
    let got: Vec<Vec<u8>> = got.into_iter().filter_map(|x| if let Ev::Msg(_, m) = x { Some(m) } else { None }).collect();
    assert_eq!(got, msgs);
    let back = p.tx_events.wait_for("3 messages", |e| e.iter().filter(|x| matches!(x, Ev::Msg(..))).count() == 3);
    let back: Vec<Vec<u8>> = back.into_iter().filter_map(|x| if let Ev::Msg(_, m) = x { Some(m) } else { None }).collect();
    assert_eq!(back, msgs);
    assert!(p.ep.send_msg(&vec![0; max + 4096]).is_err(), "oversized message must be rejected");
}

/// A receiver may send on a connection as soon as it accepted it (a node
/// does, from any thread: a keepalive probe, a Publish), before the
/// backend's reply to the hello went out: those messages are neither
/// refused nor sent ahead of the reply; they reach the sender after it, in
/// order.
pub fn messages_from_accept(h: &Harness) {
    let arena = Arc::new(Arena::new("conformance", 1 << 16).expect("arena"));
    let rx = Recorder::new(b"reply-bytes", None);
    let addr = (h.addr)();
    let listener = h.fabric.listen(&addr, arena, rx.clone()).expect("listen");
    let early: Vec<Vec<u8>> = vec![b"early-1".to_vec(), pattern(9, 3000)];
    *rx.on_accept_send.lock() = Some((Arc::downgrade(&listener), early.clone()));
    let tx = Recorder::new(b"", None);
    let ep = h.fabric.connect(&addr, b"hello-bytes", tx.clone(), WAIT, true).expect("connect");
    assert_eq!(ep.peer_hello(), b"reply-bytes");
    let sends = std::mem::take(&mut *rx.accept_sends.lock());
    assert_eq!(sends.len(), early.len());
    for r in sends {
        r.expect("a send from on_accept");
    }
    let got = tx.wait_for("the messages sent from on_accept", |e| e.iter().filter(|x| matches!(x, Ev::Msg(..))).count() == early.len());
    let got: Vec<Vec<u8>> = got.into_iter().filter_map(|x| if let Ev::Msg(_, m) = x { Some(m) } else { None }).collect();
    assert_eq!(got, early);
    // And the connection works on as usual.
    ep.send_msg(b"after").expect("sender → receiver");
    rx.wait_for("a message after the handshake", |e| e.iter().any(|x| matches!(x, Ev::Msg(_, m) if m == b"after")));
}

/// Closing either side reaches the other as a disconnect, promptly, and
/// later operations fail instead of hanging.
pub fn disconnects(h: &Harness) {
    let p = pair(h, 1 << 20);
    p.ep.close();
    p.rx_events.wait_for("receiver sees disconnect", |e| e.iter().any(|x| matches!(x, Ev::Disconnect(c, _) if *c == p.rx_conn)));
    p.tx_events.wait_for("sender sees disconnect", |e| e.iter().any(|x| matches!(x, Ev::Disconnect(..))));
    assert!(write_sync(&*p.ep, p.key, 0, vec![vec![1; 8]], 1).is_err());
    assert!(p.ep.send_msg(b"x").is_err());

    let q = pair(h, 1 << 20);
    q.listener.close_conn(q.rx_conn);
    q.tx_events.wait_for("sender sees disconnect", |e| e.iter().any(|x| matches!(x, Ev::Disconnect(..))));
    assert!(q.listener.send_msg(q.rx_conn, b"x").is_err() || {
        // The receiver may still be tearing down; it must settle quickly.
        q.rx_events.wait_for("receiver disconnect", |e| e.iter().any(|x| matches!(x, Ev::Disconnect(..))));
        true
    });
    // Disconnect is the last event of a connection.
    let evs = q.rx_events.events();
    let last = evs.iter().rposition(|x| matches!(x, Ev::Disconnect(..)));
    if let Some(i) = last {
        assert!(evs[i + 1..].iter().all(|x| !matches!(x, Ev::Imm(c, ..) | Ev::Msg(c, _) if *c == q.rx_conn)));
    }
}

/// Two senders write into one receiver concurrently.
pub fn two_senders(h: &Harness) {
    let p = pair(h, 4 << 20);
    let addr = p.listener.local_addr();
    let ev2 = Recorder::new(b"", None);
    let ep2 = h.fabric.connect(&addr, b"second", ev2, WAIT, true).expect("second connect");
    let conn2 = second_conn(&p);
    // Each sender its own range (granting one revokes the other's there).
    let k1 = p.listener.grant(p.rx_conn, 0, 1 << 20).expect("grant").expect("first");
    let k2 = p.listener.grant(conn2, 1 << 20, 1 << 20).expect("grant").expect("second");
    let a = std::thread::scope(|s| {
        let t1 = s.spawn(|| (0..200u32).try_for_each(|i| write_sync(&*p.ep, k1, 0, vec![pattern(i, 4096)], i)));
        let t2 = s.spawn(|| (0..200u32).try_for_each(|i| write_sync(&*ep2, k2, 1 << 20, vec![pattern(i, 4096)], 1000 + i)));
        (t1.join().expect("t1"), t2.join().expect("t2"))
    });
    a.0.expect("sender 1");
    a.1.expect("sender 2");
    let evs = p.rx_events.wait_for("400 immediates", |e| e.iter().filter(|x| matches!(x, Ev::Imm(..))).count() == 400);
    let conns: std::collections::HashSet<ConnId> = evs.iter().filter_map(|x| if let Ev::Imm(c, ..) = x { Some(*c) } else { None }).collect();
    assert_eq!(conns.len(), 2, "immediates must carry the connection they came from");
}

/// The receiver's id of the second connection accepted by `p`'s listener.
fn second_conn(p: &Pair) -> ConnId {
    let evs = p.rx_events.wait_for("second accept", |e| e.iter().filter(|x| matches!(x, Ev::Accept(..))).count() == 2);
    evs.iter().filter_map(|x| if let Ev::Accept(c, _) = x { Some(*c) } else { None }).find(|c| *c != p.rx_conn).expect("second accept")
}

/// A range granted to one sender and then to another: what the first
/// writes there afterwards, with the key it had, never shows where the
/// receiver reads (verbs: the write fails with a remote access error and
/// the first sender's connection breaks; shm: it lands in the first
/// sender's own window, which no longer shows there), while the second
/// sender's bytes land and stay intact. The first keeps its other range.
pub fn regrant_isolates(h: &Harness) {
    let p = pair(h, 1 << 20);
    let addr = p.listener.local_addr();
    let ep2 = h.fabric.connect(&addr, b"second", Recorder::new(b"", None), WAIT, true).expect("second connect");
    let conn2 = second_conn(&p);
    const R: u64 = 64 << 10;
    let a_own = p.listener.grant(p.rx_conn, 0, R).expect("grant").expect("first");
    let a_old = p.listener.grant(p.rx_conn, R, R).expect("grant").expect("first");
    write_sync(&*p.ep, a_own, 0, vec![pattern(1, 4096)], 1).expect("A writes its own range");
    write_sync(&*p.ep, a_old, R, vec![pattern(2, 4096)], 2).expect("A writes its second range");
    // The second range goes to B.
    let b_key = p.listener.grant(conn2, R, R).expect("grant").expect("second");
    let b_bytes = pattern(3, 8192);
    write_sync(&*ep2, b_key, R, vec![b_bytes.clone()], 3).expect("B writes its range");
    p.rx_events.wait_for("imm 3", |e| e.iter().any(|x| matches!(x, Ev::Imm(_, 3, _))));
    // A tries B's range with its old key: whatever the outcome, B's bytes stay.
    let r = write_sync(&*p.ep, a_old, R, vec![vec![0xee; 8192]], 4);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(p.arena.copy_out(R as usize, 8192).unwrap(), b_bytes, "A's write with a revoked key reached B's range ({r:?})");
    // B still writes its range.
    let b2 = pattern(5, 4096);
    write_sync(&*ep2, b_key, R + 4096, vec![b2.clone()], 5).expect("B writes again");
    assert_eq!(p.arena.copy_out((R + 4096) as usize, 4096).unwrap(), b2);
}

/// Instantiate the suite: `fabric_conformance_tests!(|| Harness { .. });`
#[macro_export]
macro_rules! fabric_conformance_tests {
    ($make:expr) => {
        #[test] fn handshake() { $crate::fabric::conformance::handshake(&($make)()) }
        #[test] fn refused_connect() { $crate::fabric::conformance::refused_connect(&($make)()) }
        #[test] fn nonce_per_connection() { $crate::fabric::conformance::nonce_per_connection(&($make)()) }
        #[test] fn writes_land_before_completion() { $crate::fabric::conformance::writes_land_before_completion(&($make)()) }
        #[test] fn gather_segments() { $crate::fabric::conformance::gather_segments(&($make)()) }
        #[test] fn immediates_in_order() { $crate::fabric::conformance::immediates_in_order(&($make)()) }
        #[test] fn out_of_range_write_fails() { $crate::fabric::conformance::out_of_range_write_fails(&($make)()) }
        #[test] fn messages_both_ways() { $crate::fabric::conformance::messages_both_ways(&($make)()) }
        #[test] fn messages_from_accept() { $crate::fabric::conformance::messages_from_accept(&($make)()) }
        #[test] fn disconnects() { $crate::fabric::conformance::disconnects(&($make)()) }
        #[test] fn two_senders() { $crate::fabric::conformance::two_senders(&($make)()) }
        #[test] fn regrant_isolates() { $crate::fabric::conformance::regrant_isolates(&($make)()) }
    };
}
