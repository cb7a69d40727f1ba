//! `RDMA_DEVICE_MODE=rpc`: a receive requests its tensor and the sender
//! writes only requested tensors. A sender and a receiver state machine
//! wired by hand (messages and writes delivered in order).

use std::sync::{Arc, Mutex};

use super::*;
use crate::constants::HEADER_BYTES;

const LINK: LinkId = 7;

struct Mem(Arc<Mutex<Vec<u8>>>);
impl SlotMemory for Mem {
    fn header(&self, offset: u64) -> [u8; HEADER_BYTES] {
        let m = self.0.lock().unwrap();
        m[offset as usize..offset as usize + HEADER_BYTES].try_into().unwrap()
    }
}

type Got = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

struct Pair {
    tx: Rendezvous,
    rx: Rendezvous,
    mem: Arc<Mutex<Vec<u8>>>,
    got: Got,
    writes: Vec<u64>,
}

fn params(rpc: bool, inc: u64) -> Params {
    Params { slots_per_edge: 2, max_outstanding_writes: 8, incarnation: inc, rpc }
}

impl Pair {
    fn new(tx_rpc: bool, rx_rpc: bool) -> Pair {
        let mut tx = Rendezvous::new(params(tx_rpc, 1), 0);
        let mut rx = Rendezvous::new(params(rx_rpc, 2), 1 << 20);
        tx.add_tx_link(LINK, "rx");
        rx.add_rx_link(LINK, "tx", 1);
        assert!(rx.on_message(LINK, &Msg::Ready.encode()).is_empty());
        Pair { tx, rx, mem: Arc::new(Mutex::new(vec![0; 1 << 20])), got: Got::default(), writes: Vec::new() }
    }

    /// Carry out actions of either side until both are quiet. Returns the
    /// reasons of any link the sender closed.
    fn run(&mut self, to_tx: impl IntoIterator<Item = Action>, to_rx: impl IntoIterator<Item = Action>) -> Vec<String> {
        let (mut to_tx, mut to_rx): (Vec<Action>, Vec<Action>) = (to_tx.into_iter().collect(), to_rx.into_iter().collect());
        let mut closed = Vec::new();
        while !to_tx.is_empty() || !to_rx.is_empty() {
            for a in std::mem::take(&mut to_rx) {
                match a {
                    Action::Send { msg, .. } => to_tx.extend(self.tx.on_message(LINK, &msg.encode())),
                    Action::Deliver { done, result } => done.complete(result),
                    Action::Release { link, slot, gen } => to_rx.extend(self.rx.release(link, slot, gen)),
                    other => panic!("unexpected receiver action {other:?}"),
                }
            }
            for a in std::mem::take(&mut to_tx) {
                match a {
                    Action::Send { msg, .. } => to_rx.extend(self.rx.on_message(LINK, &msg.encode())),
                    Action::Write { offset, header, payload, imm, done, .. } => {
                        let header = header.encode();
                        let step = SlotHeader::decode(&header).map(|h| h.step).unwrap_or(0);
                        self.writes.push(step);
                        {
                            let mut m = self.mem.lock().unwrap();
                            let o = offset as usize;
                            m[o..o + header.len()].copy_from_slice(&header);
                            let b = payload.bytes();
                            m[o + header.len()..o + header.len() + b.len()].copy_from_slice(b);
                        }
                        done.complete(Ok(()));
                        to_tx.extend(self.tx.write_done(LINK));
                        to_rx.extend(self.rx.on_write_imm(LINK, imm, &Mem(self.mem.clone())));
                    }
                    Action::SendDone { done, result } => done.complete(result),
                    Action::Close { why, .. } => closed.push(why.to_string()),
                    other => panic!("unexpected sender action {other:?}"),
                }
            }
        }
        closed
    }

    fn send(&mut self, step: u64, bytes: Vec<u8>) -> Actions {
        let meta = TensorMeta { dtype: 1, flags: 0, dims: vec![bytes.len() as i64 / 4].into() };
        self.tx.send(LINK, "edge", step, meta, Box::new(bytes), Box::new(|r: Result<()>| r.expect("send completes")))
    }

    fn recv(&mut self, step: u64) -> Actions {
        let got = self.got.clone();
        let mem = self.mem.clone();
        self.rx.recv("tx", "edge", step, Box::new(move |r: Result<Received>| {
            let r = r.expect("receive completes");
            let bytes = match r.data {
                Data::Slot { offset, len, .. } => mem.lock().unwrap()[offset as usize..(offset + len) as usize].to_vec(),
                Data::Owned(v) => v,
            };
            got.lock().unwrap().push((step, bytes));
        }))
    }
}

fn payload(step: u64) -> Vec<u8> {
    (0..4096u64).map(|i| (i * 31 + step) as u8).collect()
}

#[test]
fn a_send_waits_for_its_request() {
    let mut p = Pair::new(true, true);
    let acts = p.send(1, payload(1));
    assert!(acts.is_empty(), "nothing goes out before the receiver asks: {acts:?}");
    assert!(p.run(vec![], vec![]).is_empty());
    assert!(p.writes.is_empty());
    let acts = p.recv(1);
    assert!(matches!(&acts[..], [Action::Send { msg: Msg::Request { step: 1, .. }, .. }]), "{acts:?}");
    assert!(p.run(vec![], acts).is_empty());
    assert_eq!(*p.got.lock().unwrap(), vec![(1, payload(1))]);
    assert_eq!(p.writes, vec![1]);
    assert_eq!((p.rx.tally.requests_sent, p.tx.tally.requests_served), (1, 1));
}

#[test]
fn a_request_before_the_send_and_out_of_order_steps() {
    let mut p = Pair::new(true, true);
    // Step 3 is requested before anything is sent.
    let acts = p.recv(3);
    assert!(p.run(vec![], acts).is_empty());
    // Sends of steps 2 then 3: only 3 was requested, so only 3 is written.
    let mut acts = p.send(2, payload(2));
    acts.extend(p.send(3, payload(3)));
    assert!(p.run(acts, vec![]).is_empty());
    assert_eq!(p.writes, vec![3]);
    let acts = p.recv(2);
    assert!(p.run(vec![], acts).is_empty());
    assert_eq!(p.writes, vec![3, 2]);
    let got = p.got.lock().unwrap().clone();
    assert_eq!(got, vec![(3, payload(3)), (2, payload(2))]);
    assert_eq!((p.rx.tally.requests_sent, p.tx.tally.requests_served), (2, 2));
}

#[test]
fn requests_wait_until_the_sender_says_ready() {
    let mut rx = Rendezvous::new(params(true, 2), 1 << 20);
    let acts = rx.recv("tx", "edge", 5, Box::new(|_| {}));
    assert!(acts.is_empty(), "no link from the sender yet: {acts:?}");
    // Accepted but not yet up (the accept reply may not have gone out).
    rx.add_rx_link(LINK, "tx", 1);
    let acts = rx.recv("tx", "edge", 6, Box::new(|_| {}));
    assert!(acts.is_empty(), "{acts:?}");
    let acts = rx.on_message(LINK, &Msg::Ready.encode());
    let steps: Vec<u64> = acts.iter().filter_map(|a| match a {
        Action::Send { link: LINK, msg: Msg::Request { step, .. } } => Some(*step),
        _ => None,
    }).collect();
    assert_eq!(steps, vec![5, 6], "{acts:?}");
    // An aborted step's unsent requests are dropped.
    let mut rx = Rendezvous::new(params(true, 2), 1 << 20);
    let _ = rx.recv("tx", "edge", 7, Box::new(|_| {}));
    let _ = rx.abort_step(7, Error::Aborted("test".into()), false);
    rx.add_rx_link(LINK, "tx", 1);
    assert!(rx.on_message(LINK, &Msg::Ready.encode()).is_empty());
}

#[test]
fn an_aborted_step_forgets_its_request() {
    let mut p = Pair::new(true, true);
    let acts = p.recv(4);
    let _ = p.run(vec![], acts);
    let _ = p.tx.abort_step(4, Error::Aborted("test".into()), false);
    // A late send of the aborted step fails; nothing is written.
    let meta = TensorMeta { dtype: 1, flags: 0, dims: vec![1].into() };
    let failed = Arc::new(Mutex::new(false));
    let f = failed.clone();
    let acts = p.tx.send(LINK, "edge", 4, meta, Box::new(vec![0u8; 4]), Box::new(move |r: Result<()>| *f.lock().unwrap() = r.is_err()));
    let _ = p.run(acts, vec![]);
    assert!(*failed.lock().unwrap());
    assert!(p.writes.is_empty());
}

#[test]
fn a_push_sender_rejects_requests_with_the_reason() {
    let mut p = Pair::new(false, true);
    let acts = p.recv(1);
    let closed = p.run(vec![], acts);
    assert_eq!(closed.len(), 1, "{closed:?}");
    assert!(closed[0].contains("RDMA_DEVICE_MODE"), "{closed:?}");
}

#[test]
fn hostile_requests_are_bounded() {
    let mut tx = Rendezvous::new(params(true, 1), 0);
    tx.add_tx_link(LINK, "rx");
    let mut closed = false;
    for step in 0..(rpc::MAX_REQUESTS_PER_EDGE as u64 + 1) {
        let acts = tx.on_message(LINK, &Msg::Request { key: "k".into(), step }.encode());
        if acts.iter().any(|a| matches!(a, Action::Close { .. })) {
            closed = true;
            break;
        }
    }
    assert!(closed, "unbounded outstanding requests");
}
