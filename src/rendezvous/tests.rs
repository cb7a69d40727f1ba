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
    fn header(&self, offset: u64) -> Vec<u8> {
        let m = self.0.lock().unwrap();
        m[offset as usize..offset as usize + HEADER_BYTES].to_vec()
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

    fn run_tx(&mut self, acts: Vec<Action>) {
        for a in acts {
            match a {
                Action::Write { offset, header, payload, imm, done, .. } => {
                    let mut m = self.mem.lock().unwrap();
                    let o = offset as usize;
                    m[o..o + header.len()].copy_from_slice(&header);
                    let b = payload.bytes();
                    m[o + header.len()..o + header.len() + b.len()].copy_from_slice(b);
                    drop(m);
                    self.imms.push_back(imm);
                    done(Ok(()));
                    let more = self.tx.write_done(LINK);
                    self.run_tx(more);
                }
                Action::Inline { key, step, meta, payload, done, .. } => {
                    for m in inline_messages(&key, step, &meta, payload.bytes()) {
                        self.to_rx.push_back(m);
                    }
                    done(Ok(()));
                }
                Action::Send { msg, .. } => self.to_rx.push_back(msg),
                Action::SendDone { done, result } => done(result),
                Action::Close { why, .. } => panic!("sender closed the link: {why}"),
                other => panic!("unexpected sender action {other:?}"),
            }
        }
    }

    fn run_rx(&mut self, acts: Vec<Action>) {
        for a in acts {
            match a {
                Action::Send { msg, .. } => self.to_tx.push_back(msg),
                Action::Deliver { done, result } => done(result),
                Action::Release { link, slot, gen } => {
                    let more = self.rx.release(link, slot, gen);
                    self.run_rx(more);
                }
                Action::Close { why, .. } => panic!("receiver closed the link: {why}"),
                other => panic!("unexpected receiver action {other:?}"),
            }
        }
    }

    /// Deliver pending events in a random interleaving until quiet.
    fn settle(&mut self) {
        for _ in 0..1_000_000 {
            let choices = [!self.to_rx.is_empty(), !self.to_tx.is_empty(), !self.imms.is_empty()];
            if !choices.iter().any(|c| *c) {
                return;
            }
            let pick = loop {
                let i = (self.rand() % 3) as usize;
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
                _ => {
                    let imm = self.imms.pop_front().unwrap();
                    let mem = Mem(self.mem.clone());
                    let acts = self.rx.on_write_imm(LINK, imm, &mem);
                    self.run_rx(acts);
                }
            }
        }
        panic!("no quiescence");
    }

    fn send(&mut self, key: &str, step: u64, data: Vec<u8>) {
        let ok = self.sent_ok.clone();
        let meta = TensorMeta { dtype: 1, flags: 0, dims: vec![data.len() as i64] };
        let acts = self.tx.send(LINK, key, step, meta, Box::new(data), Box::new(move |r| {
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
    let h = SlotHeader { edge_id: 1, slot, gen, incarnation: 999, step: 2, len: 1, meta: TensorMeta::default() };
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

/// An inline tensor's claimed total is the peer's to choose (up to the
/// inline cap): the receiver must not reserve it up front, where a claim it
/// cannot back aborts the process. Memory follows the bytes that arrive.
#[test]
fn inline_total_claimed_by_the_peer_is_not_reserved_up_front() {
    let p = Params { slots_per_edge: 2, max_outstanding_writes: 4, incarnation: 22, rpc: false };
    let mut rx = Rendezvous::new(p, 1 << 20);
    rx.add_rx_link(LINK, "tx", 11);
    let meta = TensorMeta { dtype: 1, flags: 0, dims: vec![] };
    for (i, total) in [(1u64 << 36) - 1, 1 << 36, (1 << 35) + 7].into_iter().enumerate() {
        let m = Msg::Inline { key: format!("big{i}"), step: 1, meta: meta.clone(), total, offset: 0, bytes: vec![7; 1000] };
        let acts = rx.on_message(LINK, &m.encode());
        assert!(acts.is_empty(), "total {total}: {acts:?}");
        let m = Msg::Inline { key: format!("big{i}"), step: 1, meta: meta.clone(), total, offset: 1000, bytes: vec![8; 1000] };
        assert!(rx.on_message(LINK, &m.encode()).is_empty());
    }
}
