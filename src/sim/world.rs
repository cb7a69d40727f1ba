//! The world: two simulated tasks, the links between them, and the work,
//! callbacks and workload waiting to run; one event at a time, chosen by
//! the seed, with the invariants checked after each. The faults it
//! injects are in `faults`.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::callbacks::{Got, Pending, RecvCb, SendCb, SimPayload, Tracker};
use super::calls::{call_body, Echo, Out, SimWire};
use super::{flag, pattern, Counts, Violations, ARENA, NAMES};
use crate::constants::HEADER_BYTES;
use crate::error::Error;
use crate::fabric::ConnId;
use crate::node::rpc::Rpc;
use crate::rendezvous::{wire, Action, Actions, ChunkSrc, Data, Msg, Params, Payload, Received, Rendezvous, SlotMemory, TensorMeta};

mod faults;

/// Take the next message of a link's direction. Messages that different
/// threads sent at nearly the same time (within `RACE_EVENTS` events of
/// each other, from different events) may arrive in either order, as
/// when two threads write one socket; one thread's messages, and messages
/// sent further apart, keep their order.
const RACE_EVENTS: u64 = 6;

fn take_raced(q: &mut VecDeque<(u64, Vec<u8>)>, r: u64) -> Option<Vec<u8>> {
    let head = q.front()?.0;
    let mut candidates = 1;
    for (i, (e, _)) in q.iter().enumerate().skip(1) {
        // All before i come from other events, close in time.
        let ok = q.iter().take(i).all(|(p, _)| *p != *e && e.abs_diff(*p) <= RACE_EVENTS) && e.abs_diff(head) <= RACE_EVENTS;
        if !ok {
            break;
        }
        candidates = i + 1;
    }
    let pick = if candidates > 1 && r % 3 == 0 { 1 + (r / 3) as usize % (candidates - 1) } else { 0 };
    q.remove(pick).map(|(_, m)| m)
}

struct Mem<'a>(&'a [u8]);
impl SlotMemory for Mem<'_> {
    fn header(&self, offset: u64) -> [u8; HEADER_BYTES] {
        let mut h = [0u8; HEADER_BYTES];
        let o = offset as usize;
        if let Some(s) = self.0.get(o..o + HEADER_BYTES) {
            h.copy_from_slice(s);
        }
        h
    }
}

struct Node {
    rdv: Rendezvous,
    mem: Vec<u8>,
    incarnation: u64,
    rpc: Arc<Rpc>,
    wire: Arc<SimWire>,
    echo_pending: Pending,
    /// Received tensors lent to the user: (key, step, what arrived).
    held: Vec<(usize, String, u64, Received)>,
}

struct Link {
    /// Dialler (sends tensors) and acceptor.
    from: usize,
    to: usize,
    /// from → to, and to → from: each message with the event that sent it.
    fwd: VecDeque<(u64, Vec<u8>)>,
    back: VecDeque<(u64, Vec<u8>)>,
    imms: VecDeque<u32>,
}

enum Work {
    Write { node: usize, link: ConnId, offset: u64, header: Vec<u8>, payload: Box<dyn Payload>, imm: u32, done: Option<crate::rendezvous::SendDone>, stream: Option<u32> },
    Copy { node: usize, act: Action },
}

enum Op {
    Send { from: usize, key: String, step: u64, len: usize },
    Recv { at: usize, key: String, step: u64 },
    Call { len: usize },
}

pub(super) struct World {
    rng: u64,
    faults: bool,
    v: Violations,
    t: Arc<Tracker>,
    nodes: Vec<Node>,
    links: HashMap<ConnId, Link>,
    alive: Arc<Mutex<HashMap<ConnId, bool>>>,
    /// Current link from task i to task j (i dials).
    current: [[Option<ConnId>; 2]; 2],
    next_link: ConnId,
    work: Vec<Work>,
    /// Callbacks for `rdev-callbacks`, by task.
    later: VecDeque<(usize, Box<dyn FnOnce() + Send>)>,
    ops: VecDeque<Op>,
    got: Got,
    calls: Vec<u64>,
    pub(super) counts: Arc<Mutex<Counts>>,
    pub(super) events: u64,
    steps: u64,
    faults_left: u32,
}

impl World {
    pub(super) fn new(seed: u64, faults: bool, steps: u64, v: Violations) -> World {
        let alive = Arc::new(Mutex::new(HashMap::new()));
        let mut w = World {
            rng: seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
            faults,
            v,
            t: Arc::new(Tracker::default()),
            nodes: Vec::new(),
            links: HashMap::new(),
            alive,
            current: [[None; 2]; 2],
            next_link: 1,
            work: Vec::new(),
            later: VecDeque::new(),
            ops: VecDeque::new(),
            got: Arc::new(Mutex::new(Vec::new())),
            calls: Vec::new(),
            counts: Arc::new(Mutex::new(Counts::default())),
            events: 0,
            steps,
            faults_left: 4 + (steps as u32) * 2,
        };
        for n in 0..2 {
            let node = w.new_node(n, 100 + n as u64);
            w.nodes.push(node);
        }
        w.plan();
        w
    }

    fn rand(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    fn chance(&mut self, per_mille: u64) -> bool {
        self.rand() % 1000 < per_mille
    }

    fn new_node(&self, n: usize, incarnation: u64) -> Node {
        let params = Params { slots_per_edge: 2, max_outstanding_writes: 4, incarnation, rpc: false };
        let rpc = Arc::new(Rpc::default());
        let wire = Arc::new(SimWire { name: NAMES[n], dialled: Mutex::new(None), alive: self.alive.clone(), out: Mutex::new(Vec::new()) });
        let echo_pending = Arc::new(Mutex::new(Vec::new()));
        if n == 1 {
            rpc.serve(Some(Arc::new(Echo { v: self.v.clone(), pending: echo_pending.clone() })));
        }
        Node { rdv: Rendezvous::new(params, ARENA as u64), mem: vec![0; ARENA], incarnation, rpc, wire, echo_pending, held: Vec::new() }
    }

    /// The workload: per step, three tensors each way and a call.
    fn plan(&mut self) {
        for step in 1..=self.steps {
            let mut ops = Vec::new();
            for from in 0..2 {
                for e in 0..3 {
                    let r = self.rand();
                    let len = match r % 8 {
                        0 => 0,
                        1 => ARENA / 2 + (r >> 8) as usize % ARENA, // streamed
                        2 | 3 => (r >> 8) as usize % (200 << 10),
                        _ => (r >> 8) as usize % 4096,
                    };
                    let key = format!("edge{e}:{from}");
                    ops.push(Op::Send { from, key: key.clone(), step, len });
                    ops.push(Op::Recv { at: 1 - from, key, step });
                }
            }
            let len = (self.rand() % (3 * wire::CALL_PART_BYTES as u64)) as usize;
            ops.push(Op::Call { len });
            // Shuffle within the step: receives before or after sends.
            for i in (1..ops.len()).rev() {
                let j = (self.rand() % (i as u64 + 1)) as usize;
                ops.swap(i, j);
            }
            self.ops.extend(ops);
        }
    }

    /// The live link from `from` to `to`, connecting if there is none.
    fn link(&mut self, from: usize, to: usize) -> ConnId {
        if let Some(l) = self.current[from][to] {
            if self.alive.lock().get(&l).copied().unwrap_or(false) {
                return l;
            }
        }
        let id = self.next_link;
        self.next_link += 1;
        self.links.insert(id, Link { from, to, fwd: VecDeque::new(), back: VecDeque::new(), imms: VecDeque::new() });
        self.alive.lock().insert(id, true);
        self.current[from][to] = Some(id);
        self.nodes[from].rdv.add_tx_link(id, NAMES[to]);
        let inc = self.nodes[from].incarnation;
        self.nodes[to].rdv.add_rx_link(id, NAMES[from], inc);
        *self.nodes[from].wire.dialled.lock() = Some(id);
        id
    }

    pub(super) fn run(&mut self) {
        let mut idle = 0;
        while self.events < 200_000 {
            self.check();
            if !self.step_once() {
                idle += 1;
                if idle > 2 {
                    break;
                }
                // Nothing left to run: the user lets go of what it holds,
                // then the end (every task aborts what remains).
                if idle == 1 {
                    self.release_all();
                } else {
                    for n in 0..2 {
                        let acts = self.nodes[n].rdv.abort_all(Error::Aborted("the run ends".into()));
                        self.exec(n, acts);
                        self.nodes[n].rpc.fail_all(&*self.nodes[n].wire.clone());
                        self.drain_wire(n);
                        let expire = Instant::now() + Duration::from_secs(3600);
                        self.nodes[n].rpc.expire(&*self.nodes[n].wire.clone(), expire);
                        self.drain_wire(n);
                    }
                }
                continue;
            }
            idle = 0;
            self.events += 1;
        }
        self.check();
        for (i, n) in self.nodes.iter().enumerate() {
            if n.rdv.streams_receiving() > 0 {
                flag(&self.v, format!("task {i} still holds {} streams' buffers once everything ended", n.rdv.streams_receiving()));
            }
        }
        if self.events >= 200_000 {
            flag(&self.v, "no quiescence within 200000 events (a livelock)".into());
        }
        let wrong: Vec<String> = self.t.runs.lock().values().filter(|e| e.0 != e.3).map(|e| format!("callback {} ran {} times by the end (expected {})", e.2, e.0, e.3)).collect();
        for m in wrong {
            flag(&self.v, m);
        }
    }

    fn check(&mut self) {
        for (i, n) in self.nodes.iter().enumerate() {
            if n.rdv.arena_in_use() > ARENA as u64 {
                flag(&self.v, format!("task {i} holds {} bytes of a {ARENA}-byte arena", n.rdv.arena_in_use()));
            }
        }
        // Deliveries: check and hold.
        let got = std::mem::take(&mut *self.got.lock());
        for (node, key, step, r) in got {
            if r.is_err() {
                self.counts.lock().recv_failed += 1;
            }
            if let Ok(r) = r {
                self.counts.lock().delivered += 1;
                let from = 1 - node;
                let len = r.meta.dims.first().copied().unwrap_or(0).max(0) as usize;
                let want = pattern(from, &key, step, len);
                if self.bytes(node, &r) != want {
                    flag(&self.v, format!("task {node} received {key} step {step}: bytes differ from those sent"));
                }
                self.nodes[node].held.push((from, key, step, r));
            }
        }
    }

    fn bytes(&self, node: usize, r: &Received) -> Vec<u8> {
        match &r.data {
            Data::Slot { offset, len, .. } => self.nodes[node].mem.get(*offset as usize..(*offset + *len) as usize).map(|s| s.to_vec()).unwrap_or_default(),
            Data::Owned(v) => v.clone(),
        }
    }

    fn release_one(&mut self, node: usize, i: usize) {
        let (from, key, step, r) = self.nodes[node].held.remove(i);
        let len = r.meta.dims.first().copied().unwrap_or(0).max(0) as usize;
        if self.bytes(node, &r) != pattern(from, &key, step, len) {
            flag(&self.v, format!("task {node}: {key} step {step} changed while lent to the user"));
        }
        if let Data::Slot { link, slot, gen, .. } = r.data {
            let acts = self.nodes[node].rdv.release(link, slot, gen);
            self.exec(node, acts);
        }
    }

    fn release_all(&mut self) {
        for n in 0..2 {
            while !self.nodes[n].held.is_empty() {
                self.release_one(n, 0);
            }
        }
    }

    /// Run one enabled event, chosen by the seed; false when none is.
    fn step_once(&mut self) -> bool {
        // Enabled kinds.
        let mut kinds: Vec<u8> = Vec::with_capacity(8);
        if self.links.values().any(|l| !l.fwd.is_empty() || !l.back.is_empty()) {
            kinds.push(0);
        }
        if self.links.values().any(|l| !l.imms.is_empty()) {
            kinds.push(1);
        }
        if !self.work.is_empty() {
            kinds.push(2);
        }
        if !self.later.is_empty() {
            kinds.push(3);
        }
        if !self.ops.is_empty() {
            kinds.push(4);
        }
        if self.nodes.iter().any(|n| !n.held.is_empty() || !n.echo_pending.lock().is_empty()) {
            kinds.push(5);
        }
        if self.faults && self.faults_left > 0 && !self.ops.is_empty() {
            kinds.push(6);
        }
        if kinds.is_empty() {
            return false;
        }
        let k = kinds[(self.rand() % kinds.len() as u64) as usize];
        match k {
            0 => self.deliver_msg(),
            1 => self.deliver_imm(),
            2 => self.do_work(),
            3 => {
                if let Some((_, f)) = self.later.pop_front() {
                    f();
                    for n in 0..2 {
                        self.drain_wire(n);
                    }
                }
            }
            4 => self.next_op(),
            5 => self.user(),
            _ => self.fault(),
        }
        true
    }

    fn deliver_msg(&mut self) {
        let mut ids: Vec<ConnId> = self.links.iter().filter(|(_, l)| !l.fwd.is_empty() || !l.back.is_empty()).map(|(id, _)| *id).collect();
        ids.sort_unstable();
        let id = ids[(self.rand() % ids.len() as u64) as usize];
        let fwd_first = self.rand() % 2 == 0;
        let r = self.rand();
        let l = self.links.get_mut(&id).expect("listed");
        let (dst, q) = if (fwd_first && !l.fwd.is_empty()) || l.back.is_empty() { (l.to, &mut l.fwd) } else { (l.from, &mut l.back) };
        let Some(m) = take_raced(q, r) else { return };
        if std::env::var_os("RDEV_SIM_TRACE").is_some() {
            eprintln!("event {} link {id} to task {dst}: {:?}", self.events, Msg::decode(&m).map(|m| format!("{m:?}").chars().take(120).collect::<String>()));
        }
        if wire::is_call(&m) {
            let n = &self.nodes[dst];
            let (rpc, w) = (n.rpc.clone(), n.wire.clone());
            if let Err(e) = rpc.on_msg(&*w, id, &m) {
                self.protocol_close(dst, id, e);
            }
            self.drain_wire(dst);
        } else {
            let acts = self.nodes[dst].rdv.on_message(id, &m);
            self.exec(dst, acts);
        }
    }

    fn deliver_imm(&mut self) {
        let mut ids: Vec<ConnId> = self.links.iter().filter(|(_, l)| !l.imms.is_empty()).map(|(id, _)| *id).collect();
        ids.sort_unstable();
        let id = ids[(self.rand() % ids.len() as u64) as usize];
        let l = self.links.get_mut(&id).expect("listed");
        let dst = l.to;
        let Some(imm) = l.imms.pop_front() else { return };
        let n = &mut self.nodes[dst];
        let acts = n.rdv.on_write_imm(id, imm, &Mem(&n.mem));
        self.exec(dst, acts);
    }

    fn do_work(&mut self) {
        let i = (self.rand() % self.work.len() as u64) as usize;
        match self.work.swap_remove(i) {
            Work::Write { node, link, offset, header, payload, imm, done, stream } => {
                let alive = self.alive.lock().get(&link).copied().unwrap_or(false);
                let res = if alive {
                    let to = self.links[&link].to;
                    let b = payload.bytes();
                    let mem = &mut self.nodes[to].mem;
                    let o = offset as usize;
                    let p = o + header.len();
                    match p.checked_add(b.len()) {
                        Some(end) if end <= mem.len() => {
                            mem[o..p].copy_from_slice(&header);
                            mem[p..end].copy_from_slice(b);
                            if let Some(l) = self.links.get_mut(&link) {
                                l.imms.push_back(imm);
                            }
                            Ok(())
                        }
                        _ => {
                            flag(&self.v, format!("a write at {offset} of {} bytes outside the arena", b.len()));
                            Err(Error::Internal("outside".into()))
                        }
                    }
                } else {
                    Err(Error::PeerLost(format!("connection {link} is closed")))
                };
                drop(payload);
                let acts = match (stream, done) {
                    (Some(s), _) => self.nodes[node].rdv.chunk_written(link, s, res),
                    (None, Some(done)) => {
                        done.complete(res);
                        self.nodes[node].rdv.write_done(link)
                    }
                    (None, None) => Actions::new(),
                };
                self.exec(node, acts);
            }
            Work::Copy { node, act } => {
                let Action::CopyChunk { link, stream, src, len, dst, at } = act else { return };
                let (slot, res) = match src {
                    ChunkSrc::Slot { slot, gen, offset } => {
                        let m = &self.nodes[node].mem;
                        let r = match m.get(offset as usize..(offset + len) as usize) {
                            Some(s) => dst.write_at(at, s),
                            None => Err(Error::Internal("chunk outside the arena".into())),
                        };
                        (Some((slot, gen)), r)
                    }
                    ChunkSrc::Bytes(b) => (None, dst.write_at(at, &b)),
                };
                drop(dst);
                let acts = self.nodes[node].rdv.chunk_copied(link, stream, slot, len, res);
                self.exec(node, acts);
            }
        }
    }

    fn next_op(&mut self) {
        let Some(op) = self.ops.pop_front() else { return };
        match op {
            Op::Send { from, key, step, len } => {
                let to = 1 - from;
                let link = self.link(from, to);
                let freed = Arc::new(AtomicBool::new(false));
                let what = format!("task {from} send {key} step {step}");
                let id = self.t.register(from, what.clone());
                let payload = Box::new(SimPayload { data: pattern(from, &key, step, len), freed: freed.clone(), v: self.v.clone(), what });
                let done = Box::new(SendCb { id, t: self.t.clone(), freed, v: self.v.clone() });
                let meta = TensorMeta { dtype: 1, flags: 0, dims: vec![len as i64].into() };
                let acts = self.nodes[from].rdv.send(link, &key, step, meta, payload, done);
                self.exec(from, acts);
            }
            Op::Recv { at, key, step } => {
                let id = self.t.register(at, format!("task {at} recv {key} step {step}"));
                let cb = Box::new(RecvCb { id, t: self.t.clone(), v: self.v.clone(), got: self.got.clone(), node: at, key: key.clone(), step });
                let acts = self.nodes[at].rdv.recv(NAMES[1 - at], &key, step, cb);
                self.exec(at, acts);
            }
            Op::Call { len } => {
                self.link(0, 1);
                let id = self.t.register(0, format!("call of {len} bytes"));
                let (t, v) = (self.t.clone(), self.v.clone());
                let body = call_body(self.calls.len() as u64 + 1, len);
                let want: Vec<u8> = body.iter().rev().copied().collect();
                let (v2, t2, counts) = (v.clone(), t.clone(), self.counts.clone());
                let done: crate::node::rpc::CallDone = Box::new(move |code, reply| {
                    t2.ran(id, &v2);
                    if code == 0 {
                        counts.lock().calls_ok += 1;
                    } else {
                        counts.lock().calls_failed += 1;
                    }
                    if code == 0 && reply != want {
                        flag(&v2, "a call's reply is not its answer".into());
                    }
                });
                let (rpc, w) = (self.nodes[0].rpc.clone(), self.nodes[0].wire.clone());
                let timeout = self.chance(200).then_some(Duration::from_secs(1));
                match rpc.call(&*w, NAMES[1], 1, &body, timeout, self.chance(500), done) {
                    Ok(cid) => self.calls.push(cid),
                    // Not started: its done is dropped uncalled, the caller
                    // goes another way.
                    Err(_) => self.t.never(id),
                }
                self.drain_wire(0);
            }
        }
    }

    /// The user: releases a held tensor, or b's server answers a call.
    fn user(&mut self) {
        let n = (self.rand() % 2) as usize;
        if !self.nodes[n].held.is_empty() && self.rand() % 2 == 0 {
            let i = (self.rand() % self.nodes[n].held.len() as u64) as usize;
            self.release_one(n, i);
            return;
        }
        let pending = self.nodes[1].echo_pending.lock().pop();
        if let Some((handle, mut body)) = pending {
            body.reverse();
            let (rpc, w) = (self.nodes[1].rpc.clone(), self.nodes[1].wire.clone());
            rpc.reply(&*w, handle, 0, &body);
            self.drain_wire(1);
        }
    }


    fn drain_wire(&mut self, n: usize) {
        loop {
            let out = std::mem::take(&mut *self.nodes[n].wire.out.lock());
            if out.is_empty() {
                return;
            }
            for o in out {
                match o {
                    Out::Msg(l, m) => self.queue_msg(n, l, m),
                    Out::Later(f) => self.later.push_back((n, f)),
                    Out::Fail(l) => self.lose_link(l),
                }
            }
        }
    }

    fn queue_msg(&mut self, n: usize, l: ConnId, m: Vec<u8>) {
        if !self.alive.lock().get(&l).copied().unwrap_or(false) {
            return;
        }
        let e = self.events;
        if let Some(link) = self.links.get_mut(&l) {
            if link.from == n {
                link.fwd.push_back((e, m));
            } else {
                link.back.push_back((e, m));
            }
        }
    }

    fn exec(&mut self, n: usize, acts: Actions) {
        for a in acts {
            match a {
                Action::Write { link, offset, header, payload, imm, done, .. } => {
                    self.work.push(Work::Write { node: n, link, offset, header: header.encode().to_vec(), payload, imm, done: Some(done), stream: None })
                }
                Action::WriteChunk { link, stream, offset, header, payload, imm, .. } => {
                    self.work.push(Work::Write { node: n, link, offset, header: header.encode().to_vec(), payload, imm, done: None, stream: Some(stream) })
                }
                Action::SendChunk { link, stream, offset, payload } => {
                    let m = Msg::StreamData { stream, offset, bytes: payload.bytes().to_vec() };
                    drop(payload);
                    let acts = self.nodes[n].rdv.chunk_sent(link, stream);
                    self.exec(n, acts);
                    self.queue_msg(n, link, m.encode().to_vec());
                }
                Action::StreamAlloc { link, stream, total } => {
                    let acts = self.nodes[n].rdv.stream_alloc_done(link, stream, Some(vec![0u8; total as usize]));
                    self.exec(n, acts);
                }
                c @ Action::CopyChunk { .. } => self.work.push(Work::Copy { node: n, act: c }),
                Action::Send { link, msg } => self.queue_msg(n, link, msg.encode().to_vec()),
                Action::Close { link, why } => self.protocol_close(n, link, why),
                Action::SendDone { done, result } => done.complete(result),
                Action::Deliver { done, result } => done.complete(result),
                Action::Release { link, slot, gen } => {
                    let acts = self.nodes[n].rdv.release(link, slot, gen);
                    self.exec(n, acts);
                }
                Action::PlaceFor { .. } | Action::PlaceDone { .. } => {}
            }
        }
    }
}
