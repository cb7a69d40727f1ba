//! The protocol in isolation: a sender and a receiver state machine wired
//! through a simulated fabric whose control messages and write
//! completions interleave in random orders (as shm's socket and doorbell
//! ring do). Every tensor must arrive intact; nothing may stall.
//!
//! Streamed tensors (through stream slots or messages, limits, ending
//! early, forged chunks) are tested in `streams`.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use super::*;
use crate::constants::HEADER_BYTES;


mod streams;

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
