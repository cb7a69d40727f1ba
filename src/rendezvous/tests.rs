//! The protocol in isolation: a sender and a receiver state machine wired
//! through a simulated fabric whose control messages and write
//! completions interleave in random orders (as shm's socket and doorbell
//! ring do). Every tensor must arrive intact; nothing may stall.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use super::*;
use crate::constants::HEADER_BYTES;

const LINK: LinkId = 1;

struct Mem(Arc<Mutex<Vec<u8>>>);
impl SlotMemory for Mem {
    fn header(&self, offset: u64) -> [u8; HEADER_BYTES] {
        let m = self.0.lock().unwrap();
        m[offset as usize..offset as usize + HEADER_BYTES].try_into().unwrap()
    }
}

type Got = Arc<Mutex<Vec<(u64, Result<Received>)>>>;

struct Sim {
    tx: Rendezvous,
    rx: Rendezvous,
    mem: Arc<Mutex<Vec<u8>>>,
    to_rx: VecDeque<Msg>,
    to_tx: VecDeque<Msg>,
    imms: VecDeque<u32>,
    /// Chunk copies the receiver asked for, not yet done (run in any order).
    copies: VecDeque<Action>,
    /// Chunks written and not yet copied out, and the most seen at once.
    chunks_pending: usize,
    max_chunks_pending: usize,
    /// Messages of a stream sent and not yet acknowledged (most at once).
    msgs_pending: usize,
    max_msgs_pending: usize,
    /// Largest stream buffer the receiver may allocate.
    alloc_limit: u64,
    /// Chunk writes posted and held (not completed) by the test: (stream,
    /// the write's payload, still readable). None: writes complete at once.
    held: Option<Vec<(u32, Box<dyn Payload>)>>,
    rng: u64,
    got: Got,
    sent_ok: Arc<Mutex<u64>>,
}

impl Sim {
    fn new(arena: usize, slots: usize, seed: u64) -> Sim {
        let p = |inc| Params { slots_per_edge: slots, max_outstanding_writes: 4, incarnation: inc, rpc: false };
        let mut tx = Rendezvous::new(p(11), 0);
        let mut rx = Rendezvous::new(p(22), arena as u64);
        tx.add_tx_link(LINK, "rx");
        rx.add_rx_link(LINK, "tx", 11);
        Sim {
            tx,
            rx,
            mem: Arc::new(Mutex::new(vec![0; arena])),
            to_rx: VecDeque::new(),
            to_tx: VecDeque::new(),
            imms: VecDeque::new(),
            copies: VecDeque::new(),
            chunks_pending: 0,
            max_chunks_pending: 0,
            msgs_pending: 0,
            max_msgs_pending: 0,
            alloc_limit: 1 << 30,
            held: None,
            rng: seed | 1,
            got: Arc::new(Mutex::new(Vec::new())),
            sent_ok: Arc::new(Mutex::new(0)),
        }
    }

    fn rand(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    fn run_tx(&mut self, acts: Actions) {
        for a in acts {
            match a {
                Action::Write { offset, header, payload, imm, done, .. } => {
                    let header = header.encode();
                    let mut m = self.mem.lock().unwrap();
                    let o = offset as usize;
                    m[o..o + header.len()].copy_from_slice(&header);
                    let b = payload.bytes();
                    m[o + header.len()..o + header.len() + b.len()].copy_from_slice(b);
                    drop(m);
                    self.imms.push_back(imm);
                    done.complete(Ok(()));
                    let more = self.tx.write_done(LINK);
                    self.run_tx(more);
                }
                Action::WriteChunk { stream, offset, header, payload, imm, .. } => {
                    let header = header.encode();
                    let mut m = self.mem.lock().unwrap();
                    let o = offset as usize;
                    m[o..o + header.len()].copy_from_slice(&header);
                    let b = payload.bytes();
                    m[o + header.len()..o + header.len() + b.len()].copy_from_slice(b);
                    drop(m);
                    if let Some(held) = &mut self.held {
                        held.push((stream, payload));
                        continue;
                    }
                    self.imms.push_back(imm);
                    self.chunks_pending += 1;
                    self.max_chunks_pending = self.max_chunks_pending.max(self.chunks_pending);
                    let more = self.tx.chunk_written(LINK, stream, Ok(()));
                    self.run_tx(more);
                }
                Action::SendChunk { stream, offset, payload, .. } => {
                    self.msgs_pending += 1;
                    self.max_msgs_pending = self.max_msgs_pending.max(self.msgs_pending);
                    self.to_rx.push_back(Msg::StreamData { stream, offset, bytes: payload.bytes().to_vec() });
                    drop(payload);
                    let more = self.tx.chunk_sent(LINK, stream);
                    self.run_tx(more);
                }
                Action::Send { msg, .. } => self.to_rx.push_back(msg),
                Action::SendDone { done, result } => done.complete(result),
                Action::Close { why, .. } => panic!("sender closed the link: {why}"),
                other => panic!("unexpected sender action {other:?}"),
            }
        }
    }

    fn run_rx(&mut self, acts: Actions) {
        for a in acts {
            match a {
                Action::Send { msg, .. } => self.to_tx.push_back(msg),
                Action::Deliver { done, result } => done.complete(result),
                Action::Release { link, slot, gen } => {
                    let more = self.rx.release(link, slot, gen);
                    self.run_rx(more);
                }
                Action::StreamAlloc { link, stream, total } => {
                    let buf = (total <= self.alloc_limit).then(|| vec![0u8; total as usize]);
                    let more = self.rx.stream_alloc_done(link, stream, buf);
                    self.run_rx(more);
                }
                c @ Action::CopyChunk { .. } => self.copies.push_back(c),
                Action::Close { why, .. } => panic!("receiver closed the link: {why}"),
                other => panic!("unexpected receiver action {other:?}"),
            }
        }
    }

    /// Run one pending chunk copy (the oldest).
    fn settle_one_copy(&mut self) {
        let Some(Action::CopyChunk { link, stream, src, len, dst, at }) = self.copies.pop_front() else { return };
        let (slot, res) = match src {
            ChunkSrc::Slot { slot, gen, offset } => {
                self.chunks_pending -= 1;
                let m = self.mem.lock().unwrap();
                (Some((slot, gen)), dst.write_at(at, &m[offset as usize..(offset + len) as usize]))
            }
            ChunkSrc::Bytes(b) => {
                self.msgs_pending -= 1;
                (None, dst.write_at(at, &b))
            }
        };
        drop(dst);
        let acts = self.rx.chunk_copied(link, stream, slot, len, res);
        self.run_rx(acts);
    }

    /// Deliver pending events in a random interleaving until quiet.
    fn settle(&mut self) {
        for _ in 0..1_000_000 {
            let choices = [!self.to_rx.is_empty(), !self.to_tx.is_empty(), !self.imms.is_empty(), !self.copies.is_empty()];
            if !choices.iter().any(|c| *c) {
                return;
            }
            let pick = loop {
                let i = (self.rand() % 4) as usize;
                if choices[i] {
                    break i;
                }
            };
            match pick {
                0 => {
                    let m = self.to_rx.pop_front().unwrap();
                    let acts = self.rx.on_message(LINK, &m.encode());
                    self.run_rx(acts);
                }
                1 => {
                    let m = self.to_tx.pop_front().unwrap();
                    let acts = self.tx.on_message(LINK, &m.encode());
                    self.run_tx(acts);
                }
                2 => {
                    let imm = self.imms.pop_front().unwrap();
                    let mem = Mem(self.mem.clone());
                    let acts = self.rx.on_write_imm(LINK, imm, &mem);
                    self.run_rx(acts);
                }
                _ => {
                    // Copies finish in any order.
                    let i = (self.rand() % self.copies.len() as u64) as usize;
                    let Some(Action::CopyChunk { link, stream, src, len, dst, at }) = self.copies.remove(i) else { unreachable!() };
                    let (slot, res) = match src {
                        ChunkSrc::Slot { slot, gen, offset } => {
                            self.chunks_pending -= 1;
                            let m = self.mem.lock().unwrap();
                            (Some((slot, gen)), dst.write_at(at, &m[offset as usize..(offset + len) as usize]))
                        }
                        ChunkSrc::Bytes(b) => {
                            self.msgs_pending -= 1;
                            (None, dst.write_at(at, &b))
                        }
                    };
                    drop(dst);
                    let acts = self.rx.chunk_copied(link, stream, slot, len, res);
                    self.run_rx(acts);
                }
            }
        }
        panic!("no quiescence");
    }

    fn send(&mut self, key: &str, step: u64, data: Vec<u8>) {
        let ok = self.sent_ok.clone();
        let meta = TensorMeta { dtype: 1, flags: 0, dims: vec![data.len() as i64].into() };
        let acts = self.tx.send(LINK, key, step, meta, Box::new(data), Box::new(move |r: Result<()>| {
            r.expect("send ok");
            *ok.lock().unwrap() += 1;
        }));
        self.run_tx(acts);
    }

    fn recv(&mut self, key: &str, step: u64) {
        let got = self.got.clone();
        let acts = self.rx.recv("tx", key, step, Box::new(move |r| got.lock().unwrap().push((step, r))));
        self.run_rx(acts);
    }

    fn bytes(&self, r: &Received) -> Vec<u8> {
        match &r.data {
            Data::Slot { offset, len, .. } => self.mem.lock().unwrap()[*offset as usize..(*offset + *len) as usize].to_vec(),
            Data::Owned(v) => v.clone(),
        }
    }

    fn release(&mut self, r: &Received) {
        if let Data::Slot { link, slot, gen, .. } = r.data {
            let acts = self.rx.release(link, slot, gen);
            self.run_rx(acts);
        }
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (seed as usize * 131 + i * 7) as u8).collect()
}

#[test]
fn first_use_places_then_pushes() {
    let mut s = Sim::new(1 << 20, 2, 1);
    s.recv("k", 1);
    s.send("k", 1, pattern(1, 1000));
    s.settle();
    let got = std::mem::take(&mut *s.got.lock().unwrap());
    let r = got[0].1.as_ref().unwrap();
    assert_eq!(s.bytes(r), pattern(1, 1000));
    assert!(matches!(r.data, Data::Slot { .. }));
    assert_eq!(s.tx.tally.tensors_pushed, 1);
    assert_eq!(s.rx.tally.edges_traced, 1);
}

#[test]
fn random_interleavings_deliver_everything_intact() {
    for seed in 1..=40u64 {
        let mut s = Sim::new(4 << 20, 1 + (seed % 3) as usize, seed);
        let edges = ["a", "b", "c"];
        let mut expect = Vec::new();
        let mut held: Vec<Received> = Vec::new();
        for step in 1..=60u64 {
            for (ei, e) in edges.iter().enumerate() {
                let r = s.rand();
                // Sizes grow, shrink and sometimes exceed the arena share.
                let len = match r % 7 {
                    0 => 0,
                    1 => (r >> 8) as usize % 300_000,
                    _ => (r >> 8) as usize % 5000,
                };
                let data = pattern(step * 10 + ei as u64, len);
                if r % 2 == 0 {
                    s.recv(e, step);
                    s.send(e, step, data.clone());
                } else {
                    s.send(e, step, data.clone());
                    s.recv(e, step);
                }
                expect.push((e.to_string(), step, data));
            }
            s.settle();
            // Take what arrived; keep a few lent for a while.
            let got: Vec<_> = std::mem::take(&mut *s.got.lock().unwrap());
            for (_, r) in got {
                held.push(r.expect("recv ok"));
            }
            while held.len() > (s.rand() % 4) as usize {
                let r = held.remove(0);
                let b = s.bytes(&r);
                let i = expect.iter().position(|(_, _, d)| *d == b).expect("delivered bytes match a sent tensor");
                expect.remove(i);
                s.release(&r);
            }
            s.settle();
        }
        for r in std::mem::take(&mut held) {
            let b = s.bytes(&r);
            let i = expect.iter().position(|(_, _, d)| *d == b).expect("match");
            expect.remove(i);
            s.release(&r);
        }
        s.settle();
        assert!(expect.is_empty(), "seed {seed}: {} tensors never arrived", expect.len());
        assert_eq!(*s.sent_ok.lock().unwrap(), 180, "seed {seed}");
        assert_eq!(s.rx.tally.rejected_writes, 0, "seed {seed}");
    }
}

#[test]
fn aborted_step_fails_waiters_and_drops_late_pushes() {
    let mut s = Sim::new(1 << 20, 2, 3);
    s.recv("k", 5);
    let acts = s.rx.abort_step(5, Error::Aborted("cancelled".into()), false);
    s.run_rx(acts);
    assert!(matches!(s.got.lock().unwrap()[0].1, Err(Error::Aborted(_))));
    s.send("k", 5, vec![1, 2, 3]);
    s.settle();
    assert_eq!(s.rx.tally.dropped_late, 1);
    // The dropped push's slot went back: the edge keeps working.
    s.recv("k", 6);
    s.send("k", 6, vec![4, 5]);
    s.settle();
    let got = s.got.lock().unwrap();
    assert_eq!(s.bytes(got[1].1.as_ref().unwrap()), vec![4, 5]);
}

/// One cancelled receive fails alone: the step's other receives still get
/// their tensors, the cancelled one's tensor is released when it lands
/// (its slot serves the edge again), and a new receive of the key waits.
#[test]
fn a_cancelled_receive_fails_alone_and_the_step_goes_on() {
    let mut s = Sim::new(1 << 20, 2, 4);
    s.recv("a", 7);
    s.recv("b", 7);
    let acts = s.rx.cancel_recv("a", 7, Error::Aborted("cancelled".into()));
    s.run_rx(acts);
    {
        let got = s.got.lock().unwrap();
        assert_eq!(got.len(), 1);
        assert!(matches!(&got[0].1, Err(Error::Aborted(m)) if m == "cancelled"));
    }
    assert_eq!(s.rx.tally.receives_cancelled, 1);
    // Cancelling again, or a receive never made, does nothing.
    assert!(s.rx.cancel_recv("a", 7, Error::Aborted("again".into())).is_empty());
    assert!(s.rx.cancel_recv("nobody", 7, Error::Aborted("x".into())).is_empty());
    assert!(s.rx.describe().contains("table (a, 7): receive cancelled"), "{}", s.rx.describe());
    // Both tensors come: b is delivered, a is released (nobody wants it).
    s.send("a", 7, vec![1, 2, 3]);
    s.send("b", 7, vec![4, 5]);
    s.settle();
    {
        let got = s.got.lock().unwrap();
        assert_eq!(got.len(), 2, "only b's receive completes");
        assert_eq!(s.bytes(got[1].1.as_ref().unwrap()), vec![4, 5]);
    }
    assert_eq!(s.rx.tally.dropped_late, 1);
    assert!(!s.rx.describe().contains("table (a, 7)"), "{}", s.rx.describe());
    // a's edge keeps working in the next steps.
    for step in 8..11 {
        s.recv("a", step);
        s.send("a", step, vec![step as u8]);
        s.settle();
        let r = s.got.lock().unwrap().pop().unwrap();
        assert_eq!(r.0, step);
        let r = r.1.unwrap();
        assert_eq!(s.bytes(&r), vec![step as u8]);
        s.release(&r);
    }
    assert_eq!(s.rx.tally.receives_cancelled, 1);
}

#[test]
fn stale_generation_fails_the_link() {
    let mut s = Sim::new(1 << 20, 1, 4);
    s.send("k", 1, vec![9; 100]);
    s.settle();
    // Forge a header from an earlier life of the sender into the slot the
    // receiver published for the next step.
    let (slot, off, gen) = {
        s.recv("k", 1);
        let got = std::mem::take(&mut *s.got.lock().unwrap());
        let r = got.into_iter().next().unwrap().1.unwrap();
        let Data::Slot { slot, offset, gen, .. } = r.data else { panic!() };
        s.release(&Received { meta: r.meta.clone(), data: r.data.clone() });
        s.settle();
        (slot, offset - HEADER_BYTES as u64, gen)
    };
    let h = SlotHeader { edge_id: 1, slot, gen, incarnation: 999, step: 2, len: 1, meta: TensorMeta::default(), chunk: None };
    s.mem.lock().unwrap()[off as usize..off as usize + HEADER_BYTES].copy_from_slice(&h.encode());
    let acts = s.rx.on_write_imm(LINK, slot, &Mem(s.mem.clone()));
    assert!(
        matches!(&acts[..], [Action::Close { why: Error::Protocol(m), .. }] if m.contains("stale write")),
        "a stale write fails the link: {acts:?}"
    );
    assert_eq!(s.rx.tally.rejected_writes, 1);
}

#[test]
fn propagated_abort_fails_the_peers_waiters() {
    let mut s = Sim::new(1 << 20, 2, 5);
    // The receiver waits on step 7; the sender aborts step 7.
    s.recv("k", 7);
    let acts = s.tx.abort_step(7, Error::Aborted("worker failed".into()), true);
    s.run_tx(acts);
    s.settle();
    let got = s.got.lock().unwrap();
    match &got[0].1 {
        Err(Error::Aborted(m)) => assert!(m.contains("worker failed") && m.contains("step 7"), "{m}"),
        other => panic!("expected an abort, got {other:?}"),
    }
    drop(got);
    // A receive posted later for the same step fails at once.
    s.recv("other", 7);
    assert!(matches!(s.got.lock().unwrap()[1].1, Err(Error::Aborted(_))));
    // Other steps are unaffected.
    s.recv("k", 8);
    s.send("k", 8, vec![1]);
    s.settle();
    assert!(s.got.lock().unwrap()[2].1.is_ok());
}

#[test]
fn aborts_are_counted_once_per_step_and_never_for_a_local_end() {
    let mut s = Sim::new(1 << 20, 2, 5);
    s.recv("k", 7);
    // The step fails here twice (TF's abort, then a failed receive's):
    // the peers hear of it twice, it is one propagated abort.
    let acts = s.tx.abort_step(7, Error::Aborted("worker failed".into()), true);
    s.run_tx(acts);
    let acts = s.tx.abort_step(7, Error::Aborted("worker failed again".into()), true);
    s.run_tx(acts);
    s.settle();
    assert_eq!((s.tx.tally.aborts_propagated, s.rx.tally.aborts_received), (1, 1));
    // A local end (TF's cleanup, a cancelled receive's) tells nobody.
    let acts = s.tx.abort_step(8, Error::Aborted("Cleanup 8".into()), false);
    s.run_tx(acts);
    let acts = s.rx.abort_step(8, Error::Aborted("Cleanup 8".into()), false);
    s.run_rx(acts);
    s.settle();
    assert_eq!((s.tx.tally.aborts_propagated, s.rx.tally.aborts_received), (1, 1));
    assert_eq!((s.rx.tally.aborts_propagated, s.tx.tally.aborts_received), (0, 0));
    // Another failed step is another abort.
    let acts = s.tx.abort_step(9, Error::Aborted("worker failed".into()), true);
    s.run_tx(acts);
    s.settle();
    assert_eq!((s.tx.tally.aborts_propagated, s.rx.tally.aborts_received), (2, 2));
}

/// Found by the `rx` fuzz target: an Announce whose `need` is near
/// `u64::MAX` overflowed the slot size arithmetic (a panic in debug builds,
/// a wrapped tiny slot in release). It must take the chunked path instead,
/// with nothing placed.
#[test]
fn announce_of_absurd_size_is_refused_not_wrapped() {
    let p = Params { slots_per_edge: 2, max_outstanding_writes: 4, incarnation: 22, rpc: false };
    let arena = 1u64 << 20;
    let mut rx = Rendezvous::new(p, arena);
    rx.add_rx_link(LINK, "tx", 11);
    let sizes = [u64::MAX, u64::MAX - 1, u64::MAX - 255, u64::MAX - 256, u64::MAX - 4096, u64::MAX - 4097, arena, arena - HEADER_BYTES as u64 + 1];
    for (i, need) in sizes.into_iter().enumerate() {
        let key = format!("edge{i}");
        let m = Msg::Announce { key: key.clone(), step: 1, need, returned: vec![] };
        let acts = rx.on_message(LINK, &m.encode());
        assert!(
            matches!(acts.as_slice(), [Action::Send { msg: Msg::NoSpace { key: k, need: n }, .. }] if *k == key && *n == need),
            "need {need}: {acts:?}"
        );
        assert_eq!(rx.arena_in_use(), 0, "need {need} placed something");
    }
    // The largest size that fits is placed.
    let fits = arena - HEADER_BYTES as u64;
    let acts = rx.on_message(LINK, &Msg::Announce { key: "fits".into(), step: 1, need: fits, returned: vec![] }.encode());
    let Some(Action::Send { msg: Msg::Publish { slots, .. }, .. }) = acts.first() else { panic!("{acts:?}") };
    assert_eq!(slots.len(), 1);
    assert_eq!(rx.arena_in_use(), arena);
}

/// A stream's claimed total is the peer's to choose: the state machine
/// never allocates it (the node does, fallibly, on `StreamAlloc`), and a
/// total past the limit is refused with a reason, the link kept.
#[test]
fn stream_total_claimed_by_the_peer_is_not_reserved_up_front() {
    let p = Params { slots_per_edge: 2, max_outstanding_writes: 4, incarnation: 22, rpc: false };
    let mut rx = Rendezvous::new(p, 1 << 20);
    rx.add_rx_link(LINK, "tx", 11);
    let meta = TensorMeta { dtype: 1, flags: 0, dims: vec![].into() };
    let m = Msg::StreamBegin { stream: 1, key: "big".into(), step: 1, meta: meta.clone(), total: crate::constants::MAX_STREAM_TOTAL };
    let acts = rx.on_message(LINK, &m.encode());
    assert!(matches!(acts.as_slice(), [Action::StreamAlloc { stream: 1, total, .. }] if *total == crate::constants::MAX_STREAM_TOTAL), "{acts:?}");
    for (i, total) in [crate::constants::MAX_STREAM_TOTAL + 1, u64::MAX].into_iter().enumerate() {
        let m = Msg::StreamBegin { stream: 2 + i as u32, key: format!("big{i}"), step: 1, meta: meta.clone(), total };
        let acts = rx.on_message(LINK, &m.encode());
        assert!(matches!(acts.as_slice(), [Action::Send { msg: Msg::StreamReady { outcome: wire::STREAM_REFUSED, .. }, .. }]), "{acts:?}");
    }
    // The refused receive fails when it is made.
    let got = Arc::new(Mutex::new(None));
    let g = got.clone();
    let acts = rx.recv("tx", "big0", 1, Box::new(move |r| *g.lock().unwrap() = Some(r)));
    for a in acts {
        if let Action::Deliver { done, result } = a {
            done.complete(result);
        }
    }
    assert!(matches!(got.lock().unwrap().take(), Some(Err(Error::ResourceExhausted(_)))));
    assert_eq!(rx.arena_in_use(), 0);
}

/// Issue 18, N4: the stream limit holds for the node, not per link: a
/// second peer cannot open another limit's worth while the first's
/// streams are open.
#[test]
fn the_stream_limit_counts_every_peer() {
    let p = Params { slots_per_edge: 2, max_outstanding_writes: 4, incarnation: 22, rpc: false };
    let mut rx = Rendezvous::new(p, 1 << 20);
    rx.add_rx_link(LINK, "tx", 11);
    rx.add_rx_link(LINK + 1, "tx2", 12);
    let meta = TensorMeta { dtype: 1, flags: 0, dims: vec![].into() };
    let half = crate::constants::MAX_STREAM_TOTAL / 2;
    let m = Msg::StreamBegin { stream: 1, key: "a".into(), step: 1, meta: meta.clone(), total: half + 1 };
    let acts = rx.on_message(LINK, &m.encode());
    assert!(matches!(acts.as_slice(), [Action::StreamAlloc { .. }]), "{acts:?}");
    let m = Msg::StreamBegin { stream: 1, key: "b".into(), step: 1, meta: meta.clone(), total: half };
    let acts = rx.on_message(LINK + 1, &m.encode());
    assert!(
        matches!(acts.as_slice(), [Action::Send { msg: Msg::StreamReady { outcome: wire::STREAM_REFUSED, .. }, .. }]),
        "another peer's stream went past the node's limit: {acts:?}"
    );
}

/// Issue 18, N4: refused streams for receives never made are remembered
/// (the receive must fail when it comes), but a peer cannot grow that
/// without bound: past `MAX_FAILED_AHEAD_PER_LINK` its link is closed
/// (the node's cap: `caps_tests.rs`).
#[test]
fn refused_streams_waiting_for_receives_are_capped() {
    let p = Params { slots_per_edge: 2, max_outstanding_writes: 4, incarnation: 22, rpc: false };
    let mut rx = Rendezvous::new(p, 1 << 20);
    rx.add_rx_link(LINK, "tx", 11);
    let meta = TensorMeta { dtype: 1, flags: 0, dims: vec![].into() };
    let cap = crate::constants::MAX_FAILED_AHEAD_PER_LINK;
    for i in 0..=cap {
        let total = crate::constants::MAX_STREAM_TOTAL + 1;
        let m = Msg::StreamBegin { stream: 1 + i as u32, key: format!("k{i}"), step: 1_000_000 + i as u64, meta: meta.clone(), total };
        let acts = rx.on_message(LINK, &m.encode());
        let closed = acts.iter().any(|a| matches!(a, Action::Close { .. }));
        assert_eq!(closed, i == cap, "refusal {i}: {acts:?}");
    }
}

/// Sends `data` and records the send's result (which may be an error).
fn send_any(s: &mut Sim, key: &str, step: u64, meta: TensorMeta, data: Vec<u8>) -> Arc<Mutex<Option<Result<()>>>> {
    let res = Arc::new(Mutex::new(None));
    let r2 = res.clone();
    let acts = s.tx.send(LINK, key, step, meta, Box::new(data), Box::new(move |r| *r2.lock().unwrap() = Some(r)));
    s.run_tx(acts);
    res
}

fn take_got(s: &Sim) -> Vec<(u64, Result<Received>)> {
    std::mem::take(&mut *s.got.lock().unwrap())
}

/// Tensors larger than the arena, exactly a chunk multiple, one byte more,
/// and several at once on different edges: every byte arrives, chunks
/// land and are copied in any order, and at most STREAM_SLOTS chunks are
/// ever in flight (the sender's working set is bounded).
#[test]
fn streams_through_slots_in_any_order() {
    use crate::constants::STREAM_SLOTS;
    let arena = 8u64 << 20;
    let chunk = stream_chunk_bytes(arena).unwrap();
    for seed in 1..=12u64 {
        let mut s = Sim::new(arena as usize, 2, seed);
        let sizes = [arena as usize + 12345, chunk as usize * 40, chunk as usize * 40 + 1, 3 * arena as usize];
        let mut sends = Vec::new();
        for (i, len) in sizes.iter().enumerate() {
            let key = format!("big{i}");
            if seed % 2 == 0 {
                s.recv(&key, 1);
            }
            let m = TensorMeta { dtype: 1, flags: 0, dims: vec![*len as i64].into() };
            sends.push(send_any(&mut s, &key, 1, m, pattern(seed + i as u64, *len)));
        }
        s.settle();
        if seed % 2 == 1 {
            for i in 0..sizes.len() {
                s.recv(&format!("big{i}"), 1);
            }
        }
        let got = take_got(&s);
        assert_eq!(got.len(), sizes.len(), "seed {seed}");
        for (_, r) in &got {
            let r = r.as_ref().expect("recv ok");
            let len = r.meta.dims[0] as usize;
            let i = sizes.iter().position(|l| *l == len).unwrap();
            assert!(s.bytes(r) == pattern(seed + i as u64, len), "seed {seed}: tensor {i} corrupted");
            assert!(matches!(r.data, Data::Owned(_)));
        }
        for r in &sends {
            assert!(matches!(*r.lock().unwrap(), Some(Ok(()))), "seed {seed}");
        }
        let want: u64 = sizes.iter().map(|l| (*l as u64).div_ceil(chunk)).sum();
        assert_eq!(s.tx.tally.stream_chunks, want, "seed {seed}");
        assert_eq!(s.tx.tally.inline_tensors, sizes.len() as u64);
        assert!(s.max_chunks_pending <= STREAM_SLOTS, "seed {seed}: {} chunks in flight", s.max_chunks_pending);
        assert!(s.max_chunks_pending >= 2, "seed {seed}: the pipeline never overlapped");
        // The stream slots stay placed for the link (at most 1/8 of the arena).
        assert!(s.rx.arena_in_use() <= arena / 8, "{}", s.rx.arena_in_use());
    }
}

/// With no room for stream slots, chunks go as messages, produced lazily:
/// at most STREAM_MSG_WINDOW unacknowledged.
#[test]
fn streams_through_messages_when_no_slot_fits() {
    let arena = 1u64 << 20; // too small for stream slots
    assert!(stream_chunk_bytes(arena).is_none());
    let mut s = Sim::new(arena as usize, 2, 7);
    let len = 3 << 20;
    s.recv("big", 1);
    let r = send_any(&mut s, "big", 1, TensorMeta { dtype: 1, flags: 0, dims: vec![len as i64].into() }, pattern(3, len));
    s.settle();
    let got = take_got(&s);
    assert!(s.bytes(got[0].1.as_ref().unwrap()) == pattern(3, len));
    assert!(matches!(*r.lock().unwrap(), Some(Ok(()))));
    assert_eq!(s.tx.tally.stream_messages, (len as u64).div_ceil(crate::constants::STREAM_MSG_BYTES as u64));
    assert!(s.max_msgs_pending <= crate::constants::STREAM_MSG_WINDOW as usize, "{}", s.max_msgs_pending);
}

/// Rank above what a header holds: streamed, shape intact; a dead tensor
/// of such rank (no bytes) too.
#[test]
fn high_rank_tensors_are_streamed_with_their_shape() {
    let mut s = Sim::new(8 << 20, 2, 9);
    let dims: Vec<i64> = vec![1; 30];
    s.recv("r", 1);
    send_any(&mut s, "r", 1, TensorMeta { dtype: 1, flags: 0, dims: dims.clone().into() }, vec![5; 4]);
    send_any(&mut s, "d", 1, TensorMeta { dtype: 1, flags: FLAG_DEAD, dims: dims.clone().into() }, vec![]);
    s.recv("d", 1);
    s.settle();
    let got = take_got(&s);
    assert_eq!(got.len(), 2);
    for (_, r) in got {
        let r = r.unwrap();
        assert_eq!(r.meta.dims.as_slice(), &dims[..]);
        assert_eq!(s.bytes(&r), if r.meta.flags == FLAG_DEAD { vec![] } else { vec![5; 4] });
    }
}

/// The receiver's step ends mid-stream: the buffer goes, the sender's send
/// fails, chunks still on their way are dropped and their slots credited,
/// and the link keeps streaming.
#[test]
fn step_end_mid_stream_discards_it_on_both_sides() {
    let arena = 8u64 << 20;
    let mut s = Sim::new(arena as usize, 2, 11);
    let len = 3 * arena as usize;
    let r = send_any(&mut s, "big", 4, TensorMeta { dtype: 1, flags: 0, dims: vec![len as i64].into() }, pattern(1, len));
    // Let a few chunks move, then end the step at the receiver.
    for _ in 0..40 {
        let choices = [!s.to_rx.is_empty(), !s.to_tx.is_empty(), !s.imms.is_empty(), !s.copies.is_empty()];
        if let Some(i) = choices.iter().position(|c| *c) {
            match i {
                0 => { let m = s.to_rx.pop_front().unwrap(); let a = s.rx.on_message(LINK, &m.encode()); s.run_rx(a); }
                1 => { let m = s.to_tx.pop_front().unwrap(); let a = s.tx.on_message(LINK, &m.encode()); s.run_tx(a); }
                2 => { let imm = s.imms.pop_front().unwrap(); let a = s.rx.on_write_imm(LINK, imm, &Mem(s.mem.clone())); s.run_rx(a); }
                _ => s.settle_one_copy(),
            }
        }
    }
    assert!(s.tx.tally.stream_chunks > 0);
    let acts = s.rx.step_done(4);
    s.run_rx(acts);
    s.settle();
    assert!(matches!(*r.lock().unwrap(), Some(Err(Error::Aborted(_)))), "{:?}", r.lock().unwrap());
    assert!(s.rx.describe().matches("stream").count() <= 1, "{}", s.rx.describe());
    // The link still streams.
    s.recv("big", 5);
    let r = send_any(&mut s, "big", 5, TensorMeta { dtype: 1, flags: 0, dims: vec![len as i64].into() }, pattern(2, len));
    s.settle();
    assert!(matches!(*r.lock().unwrap(), Some(Ok(()))));
    let got = take_got(&s);
    assert!(s.bytes(got.last().unwrap().1.as_ref().unwrap()) == pattern(2, len));
}

/// The receiver has no memory for the tensor: the send fails with a
/// reason, the receive too, and the link survives.
#[test]
fn stream_without_memory_fails_the_transfer_not_the_link() {
    let mut s = Sim::new(8 << 20, 2, 13);
    s.alloc_limit = 1 << 20;
    s.recv("big", 1);
    let r = send_any(&mut s, "big", 1, TensorMeta { dtype: 1, flags: 0, dims: vec![].into() }, vec![1; 9 << 20]);
    s.settle();
    assert!(matches!(&*r.lock().unwrap(), Some(Err(Error::ResourceExhausted(m))) if m.contains("no memory")), "{:?}", r.lock().unwrap());
    assert!(matches!(take_got(&s)[0].1, Err(Error::ResourceExhausted(_))));
    s.recv("small", 2);
    send_any(&mut s, "small", 2, TensorMeta::default(), vec![3; 10]);
    s.settle();
    assert!(take_got(&s)[0].1.is_ok());
}

/// Forged chunks close the link, whatever is wrong with them.
#[test]
fn forged_chunks_close_the_link() {
    use crate::rendezvous::wire::ChunkAt;
    let arena = 8u64 << 20;
    let chunk = stream_chunk_bytes(arena).unwrap();
    let len = arena as usize + 10;
    type Forge = fn(&mut SlotHeader, u64);
    let forgeries: [(&str, Forge); 6] = [
        ("misaligned", |h, _| h.chunk = Some(ChunkAt { stream: 1, offset: 7 })),
        ("past the end", |h, c| h.chunk = Some(ChunkAt { stream: 1, offset: (8 << 20) / c * c + c })),
        ("never begun", |h, _| h.chunk = Some(ChunkAt { stream: 9, offset: 0 })),
        ("short", |h, _| h.len = 5),
        ("other step", |h, _| h.step = 99),
        ("not a chunk", |h, _| h.chunk = None),
    ];
    for (what, forge) in forgeries {
        let mut s = Sim::new(arena as usize, 2, 17);
        send_any(&mut s, "big", 1, TensorMeta::default(), vec![1; len]);
        // Deliver messages only: the sender writes its chunks (imms queued).
        while !s.to_rx.is_empty() || !s.to_tx.is_empty() {
            if let Some(m) = s.to_rx.pop_front() { let a = s.rx.on_message(LINK, &m.encode()); s.run_rx(a); }
            if let Some(m) = s.to_tx.pop_front() { let a = s.tx.on_message(LINK, &m.encode()); s.run_tx(a); }
        }
        let imm = s.imms.pop_front().expect("a chunk was written");
        // Find the slot's header in memory and forge it.
        let off = (0..arena as usize / 4096).map(|p| p * 4096).find(|o| {
            SlotHeader::decode(&s.mem.lock().unwrap()[*o..*o + HEADER_BYTES]).is_ok_and(|h| h.slot == imm)
        }).unwrap();
        let mut h = SlotHeader::decode(&s.mem.lock().unwrap()[off..off + HEADER_BYTES]).unwrap();
        forge(&mut h, chunk);
        s.mem.lock().unwrap()[off..off + HEADER_BYTES].copy_from_slice(&h.encode());
        let acts = s.rx.on_write_imm(LINK, imm, &Mem(s.mem.clone()));
        assert!(matches!(&acts[..], [Action::Close { why: Error::Protocol(_), .. }]), "{what}: {acts:?}");
    }
    // A duplicate chunk: the same write twice.
    let mut s = Sim::new(arena as usize, 2, 19);
    send_any(&mut s, "big", 1, TensorMeta::default(), vec![1; len]);
    while !s.to_rx.is_empty() || !s.to_tx.is_empty() {
        if let Some(m) = s.to_rx.pop_front() { let a = s.rx.on_message(LINK, &m.encode()); s.run_rx(a); }
        if let Some(m) = s.to_tx.pop_front() { let a = s.tx.on_message(LINK, &m.encode()); s.run_tx(a); }
    }
    let imm = s.imms.pop_front().unwrap();
    let a = s.rx.on_write_imm(LINK, imm, &Mem(s.mem.clone()));
    s.run_rx(a);
    s.settle_one_copy();
    s.to_tx.clear(); // the credit is lost: the sender never rewrites it
    let acts = s.rx.on_write_imm(LINK, imm, &Mem(s.mem.clone()));
    // The slot is with the sender again, so the header decides: a chunk at
    // an offset already taken.
    assert!(matches!(&acts[..], [Action::Close { why: Error::Protocol(m), .. }] if m.contains("duplicate")), "{acts:?}");
    // A reused stream id.
    let m = Msg::StreamBegin { stream: 1, key: "again".into(), step: 1, meta: TensorMeta::default(), total: 5 };
    assert!(matches!(&s.rx.on_message(LINK, &m.encode())[..], [Action::Close { .. }]));
}

#[test]
fn links_with_work_waiting_on_their_peer_are_probed() {
    let p = Params { slots_per_edge: 2, max_outstanding_writes: 4, incarnation: 22, rpc: false };
    let mut r = Rendezvous::new(p, 1 << 20);
    r.add_tx_link(1, "p");
    r.add_rx_link(2, "p", 7);
    r.add_tx_link(3, "q");
    let (mut peers, mut l) = (Vec::new(), Vec::new());
    r.links_to_probe(&mut peers, &mut l);
    assert!(l.is_empty(), "idle links are not probed");
    // A receive waits for p: every link with p is probed, none with q.
    let acts = r.recv("p", "k", 1, Box::new(|_: Result<Received>| {}));
    assert!(acts.is_empty());
    r.links_to_probe(&mut peers, &mut l);
    l.sort();
    assert_eq!(l, vec![1, 2]);
    // A send to q waits for its placement: q's link is probed too.
    let meta = TensorMeta { dtype: 1, flags: 0, dims: vec![4].into() };
    let acts = r.send(3, "e", 1, meta, Box::new(vec![0u8; 4]), Box::new(|_: Result<()>| {}));
    assert!(acts.iter().any(|a| matches!(a, Action::Send { link: 3, msg: Msg::Announce { .. } })));
    r.links_to_probe(&mut peers, &mut l);
    l.sort();
    assert_eq!(l, vec![1, 2, 3]);
    // Once the step ends nothing waits any more.
    let _ = r.step_done(1);
    r.links_to_probe(&mut peers, &mut l);
    assert!(l.is_empty());
    // A probe is no event for the protocol.
    assert!(r.on_message(2, &Msg::Ping.encode()).is_empty());
}

/// A stream that ends early (the receiver discards it, the sender aborts
/// its step, the link is lost, a chunk write fails) completes its send
/// only when no chunk write reads the caller's tensor any more, and
/// exactly once (issue 18, N1: the tensor may be freed at `done`).
#[test]
fn a_failed_stream_completes_only_after_its_last_chunk_write() {
    let arena = 8u64 << 20;
    let chunk = stream_chunk_bytes(arena).unwrap() as usize;
    for how in 0..4 {
        let mut s = Sim::new(arena as usize, 2, 3 + how);
        s.held = Some(Vec::new());
        s.recv("big", 1);
        let len = 3 * arena as usize; // no slot holds it: streamed
        let res = send_any(&mut s, "big", 1, TensorMeta { dtype: 1, flags: 0, dims: vec![len as i64].into() }, pattern(1, len));
        s.settle();
        let held = s.held.take().unwrap();
        assert!(held.len() >= 2, "{how}: chunks in flight: {}", held.len());
        let acts = match how {
            0 => s.tx.on_message(LINK, &Msg::StreamCancel { stream: held[0].0 }.encode()),
            1 => s.tx.abort_step(1, Error::Aborted("test".into()), true),
            2 => s.tx.on_link_lost(LINK, Error::PeerLost("test".into())),
            _ => s.tx.chunk_written(LINK, held[0].0, Err(Error::PeerLost("write failed".into()))),
        };
        s.run_tx(acts.into_iter().filter(|a| !matches!(a, Action::Send { .. })).collect());
        // A chunk write failing is itself back.
        let back = if how == 3 { 1 } else { 0 };
        for (i, (stream, payload)) in held.iter().enumerate().skip(back) {
            assert!(res.lock().unwrap().is_none(), "{how}: done ran with {} chunk write(s) still reading the tensor", held.len() - i);
            assert_eq!(payload.bytes().len(), chunk, "{how}: the range is still readable");
            let acts = s.tx.chunk_written(LINK, *stream, if i % 2 == 0 { Ok(()) } else { Err(Error::PeerLost("late".into())) });
            s.run_tx(acts.into_iter().filter(|a| !matches!(a, Action::Send { .. })).collect());
        }
        assert!(matches!(*res.lock().unwrap(), Some(Err(_))), "{how}: done after the last chunk, with the error");
        assert!(s.tx.tx_ending.is_empty(), "{how}: the tombstone is gone");
    }
}

/// L1: the node goes while a failed stream's chunk writes still read the
/// caller's tensor (a tombstone). Its `done` must still run, exactly once,
/// with an error, and only when the last chunk lets go of the bytes
/// (before, the tombstone was dropped with the protocol state and `done`
/// never ran).
#[test]
fn a_tombstone_left_at_shutdown_completes_when_its_last_chunk_lets_go() {
    let arena = 8u64 << 20;
    let mut s = Sim::new(arena as usize, 2, 7);
    s.held = Some(Vec::new());
    s.recv("big", 1);
    let len = 3 * arena as usize;
    let res = send_any(&mut s, "big", 1, TensorMeta { dtype: 1, flags: 0, dims: vec![len as i64].into() }, pattern(1, len));
    s.settle();
    let held = s.held.take().unwrap();
    assert!(held.len() >= 2, "chunks in flight: {}", held.len());
    let acts = s.tx.on_link_lost(LINK, Error::PeerLost("test".into()));
    s.run_tx(acts.into_iter().filter(|a| !matches!(a, Action::Send { .. })).collect());
    assert!(!s.tx.tx_ending.is_empty(), "a tombstone waits for its chunks");
    drop(s); // the node goes
    for (i, (_, payload)) in held.into_iter().enumerate() {
        assert!(res.lock().unwrap().is_none(), "done ran with chunk {i} still reading the tensor");
        drop(payload);
    }
    assert!(matches!(*res.lock().unwrap(), Some(Err(_))), "the tombstone's done never ran: {:?}", res.lock().unwrap().as_ref().map(|r| r.is_ok()));
}
