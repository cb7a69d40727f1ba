//! The two tasks of a run and the link between them: each task's
//! protocol state and arena (`Side`, standing in for the node), the
//! sender's endpoint (`Ep`, writes into the receiver's arena), the
//! messages and doorbells on their way (`Net`), and the event threads'
//! deliveries (`pump_*`, `quiesce`).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool as StdBool, Ordering as O};
use std::sync::{Arc, Weak};

use shuttle::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use shuttle::thread;

use super::super::super::engine;
use super::super::super::write::{TensorWrite, Then, WriteHost};
use super::super::{copy_slot_chunk, write_chunk_now, zeroed};
use super::{flag, Violations, KEY, LINK, STEP};
use crate::constants::HEADER_BYTES;
use crate::error::{Error, Result};
use crate::fabric::{ConnId, Endpoint, TransportKind, WriteOp};
use crate::pool;
use crate::rendezvous::{Action, Actions, ChunkSrc, Msg, Payload, RecvDone, Rendezvous, SendDone, SlotMemory, TensorMeta};
use crate::sync::Mutex;

/// The link between the two tasks, and what the run injects.
pub(super) struct Net {
    /// Control messages a → b and b → a, and a's doorbells to b (shm
    /// carries them apart from the messages: no order between the two).
    pub(super) ab: Mutex<VecDeque<Vec<u8>>>,
    pub(super) ba: Mutex<VecDeque<Vec<u8>>>,
    pub(super) bells: Mutex<VecDeque<u32>>,
    pub(super) lost: AtomicBool,
    /// Writes (of slots or chunks) handed to a job so far.
    pub(super) writes: AtomicUsize,
    /// Threads of the nodes' jobs (pools, rdev-callbacks), to join.
    pub(super) jobs: Mutex<Vec<thread::JoinHandle<()>>>,
    /// The next write is dropped unfinished by its backend (once).
    pub(super) drop_write: StdBool,
    /// The next chunk copy panics (once).
    pub(super) panic_copy: StdBool,
    /// The run injects a copy panic: the link it fails is closed on
    /// purpose.
    pub(super) copy_panics: bool,
    pub(super) v: Violations,
}

impl Net {
    /// The link is gone: nothing is queued or written after this.
    fn lose(&self) {
        let _ab = self.ab.lock();
        let _ba = self.ba.lock();
        let _bells = self.bells.lock();
        self.lost.store(true, Ordering::SeqCst);
    }

    fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }
}

/// One task, standing in for the node (`Inner`): its protocol state, its
/// arena, its end of the link.
pub(super) struct Side {
    name: &'static str,
    /// None once the node shut down (`Node` dropped).
    pub(super) rdv: Mutex<Option<Rendezvous>>,
    pub(super) arena: Mutex<Vec<u8>>,
    pub(super) net: Arc<Net>,
    /// The sender's endpoint (writes into the receiver's arena).
    pub(super) ep: Mutex<Option<Arc<Ep>>>,
    saw_loss: AtomicBool,
    me: Weak<Side>,
}

impl Side {
    pub(super) fn new(name: &'static str, rdv: Rendezvous, arena: usize, net: Arc<Net>) -> Arc<Side> {
        Arc::new_cyclic(|me| Side {
            name,
            rdv: Mutex::new(Some(rdv)),
            arena: Mutex::new(vec![0; arena]),
            net,
            ep: Mutex::new(None),
            saw_loss: AtomicBool::new(false),
            me: me.clone(),
        })
    }

    pub(super) fn is_down(&self) -> bool {
        self.rdv.lock().is_none()
    }

    /// `Inner::locked`: nothing once the node is gone.
    pub(super) fn locked(&self, f: impl FnOnce(&mut Rendezvous) -> Actions) -> Actions {
        let mut g = self.rdv.lock();
        g.as_mut().map(f).unwrap_or_default()
    }

    fn host(&self) -> Weak<dyn WriteHost> {
        self.me.clone()
    }

    fn endpoint(&self) -> Option<Arc<Ep>> {
        if self.net.is_lost() {
            return None;
        }
        self.ep.lock().clone()
    }

    fn outbox(&self) -> &Mutex<VecDeque<Vec<u8>>> {
        if self.name == "a" {
            &self.net.ab
        } else {
            &self.net.ba
        }
    }

    fn send_msg(&self, msg: &Msg) -> Result<()> {
        let mut q = self.outbox().lock();
        if self.net.is_lost() {
            return Err(Error::PeerLost(format!("connection {LINK} is closed")));
        }
        q.push_back(msg.encode().to_vec());
        Ok(())
    }

    /// A job for one of the node's threads (a pool, rdev-callbacks).
    fn spawn(&self, job: impl FnOnce() + Send + 'static) {
        let h = thread::spawn(job);
        self.net.jobs.lock().push(h);
    }

    /// `Inner::fail_link`: closed here, and what depended on it fails now;
    /// the peer learns it after what was sent before.
    pub(super) fn fail_link(&self, why: Error) {
        self.net.lose();
        self.link_lost(why);
    }

    /// The transport reports the link gone (once per side).
    fn on_loss(&self, why: Error) {
        if !self.saw_loss.swap(true, Ordering::SeqCst) {
            self.link_lost(why);
        }
    }

    /// No write can land any more (`Net::lose`), so the sender is gone too.
    fn link_lost(&self, why: Error) {
        let acts = self.locked(|r| {
            let acts = r.on_link_lost(LINK, why);
            r.sender_gone(LINK);
            acts
        });
        self.exec(acts);
    }

    /// What `Node`'s `Drop` does: fail everything, close the links, and
    /// the protocol state goes (with it, tombstones: `Rendezvous`'s Drop).
    pub(super) fn shut_down(&self) {
        let acts = self.locked(|r| r.abort_all(Error::Aborted("transport shut down".into())));
        self.exec(acts);
        self.fail_link(Error::Aborted("transport shut down".into()));
        let gone = self.rdv.lock().take();
        drop(gone);
    }

    pub(super) fn send(&self, meta: TensorMeta, payload: Box<dyn Payload>, done: SendDone) {
        let mut g = self.rdv.lock();
        match g.as_mut() {
            Some(r) => {
                let acts = r.send(LINK, KEY, STEP, meta, payload, done);
                drop(g);
                self.exec(acts);
            }
            // The node is gone: the shim fails the send.
            None => {
                drop(g);
                done.complete(Err(Error::Aborted("transport shut down".into())));
            }
        }
    }

    pub(super) fn recv(&self, done: RecvDone) {
        let mut g = self.rdv.lock();
        match g.as_mut() {
            Some(r) => {
                let acts = r.recv("a", KEY, STEP, done);
                drop(g);
                self.exec(acts);
            }
            None => {
                drop(g);
                done.complete(Err(Error::Aborted("transport shut down".into())));
            }
        }
    }

    /// `Inner::exec_as`, over the in-memory link: writes and chunk copies
    /// on job threads (as the engine and rdev-stream run them), buffer
    /// allocation on another (as rdev-callbacks runs it for an event
    /// thread), the rest here.
    pub(super) fn exec(&self, acts: Actions) {
        for a in acts {
            match a {
                Action::Write { link, offset, key, header, payload, imm, done, bytes } => {
                    let Some(ep) = self.endpoint() else {
                        payload.release();
                        done.complete(Err(Error::PeerLost(format!("connection {link} is closed"))));
                        let acts = self.locked(|r| r.write_done(link));
                        self.exec(acts);
                        continue;
                    };
                    let op = TensorWrite::new(header.encode(), payload, Then::Send(done), self.host(), link);
                    let step = header.step;
                    // At least WRITE_ENGINE_MIN: a job of the write engine.
                    self.spawn(move || engine::serve_one(engine::Job::new(ep, offset, key, imm, op, step, bytes)));
                    self.net.writes.fetch_add(1, Ordering::SeqCst);
                }
                Action::WriteChunk { link, stream, offset, key, header, payload, imm } => {
                    let Some(ep) = self.endpoint() else {
                        let acts = self.locked(|r| r.chunk_written(link, stream, Err(Error::PeerLost(format!("connection {link} is closed")))));
                        self.exec(acts);
                        continue;
                    };
                    let host = self.host();
                    self.spawn(move || pool::run_caught("rdev-stream", move || write_chunk_now(&*ep, host, link, stream, offset, key, header, payload, imm)));
                    self.net.writes.fetch_add(1, Ordering::SeqCst);
                }
                Action::SendChunk { link, stream, offset, payload } => {
                    let msg = Msg::StreamData { stream, offset, bytes: payload.bytes().to_vec() };
                    drop(payload);
                    let acts = self.locked(|r| r.chunk_sent(link, stream));
                    self.exec(acts);
                    if let Err(e) = self.send_msg(&msg) {
                        self.fail_link(e);
                    }
                }
                Action::StreamAlloc { link, stream, total } => {
                    let me = self.me.upgrade().expect("a side runs its own actions");
                    self.spawn(move || {
                        let buf = zeroed(total);
                        let acts = me.locked(|r| r.stream_alloc_done(link, stream, buf));
                        me.exec(acts);
                    });
                }
                Action::CopyChunk { link, stream, src, len, dst, at } => match src {
                    ChunkSrc::Bytes(b) => {
                        let res = dst.write_at(at, &b);
                        drop(dst);
                        let acts = self.locked(|r| r.chunk_copied(link, stream, None, len, res));
                        self.exec(acts);
                    }
                    ChunkSrc::Slot { slot, gen, offset } => {
                        let me = self.me.upgrade().expect("a side runs its own actions");
                        self.spawn(move || {
                            pool::run_caught(
                                "rdev-stream",
                                move || {
                                    let res = copy_slot_chunk(dst, |dst| {
                                        if me.net.panic_copy.swap(false, O::SeqCst) {
                                            // No hook: the run's output stays quiet.
                                            std::panic::resume_unwind(Box::new("the chunk copy panicked"));
                                        }
                                        let mem = me.arena.lock();
                                        match mem.get(offset as usize..(offset + len) as usize) {
                                            Some(s) => dst.write_at(at, s),
                                            None => Err(Error::Internal("chunk outside the arena".into())),
                                        }
                                    });
                                    let acts = me.locked(|r| r.chunk_copied(link, stream, Some((slot, gen)), len, res));
                                    me.exec(acts);
                                },
                            )
                        });
                    }
                },
                Action::Send { msg, .. } => {
                    if let Err(e) = self.send_msg(&msg) {
                        self.fail_link(e);
                    }
                }
                Action::Close { why, .. } => {
                    if !self.net.is_lost() && !self.net.copy_panics {
                        flag(&self.net.v, format!("{} closed a live link: {why}", self.name));
                    }
                    self.fail_link(why);
                }
                Action::SendDone { done, result } => done.complete(result),
                Action::Deliver { done, result } => done.complete(result),
                Action::Release { link, slot, gen } => {
                    let acts = self.locked(|r| r.release(link, slot, gen));
                    self.exec(acts);
                }
                Action::PlaceFor { .. } | Action::PlaceDone { .. } => flag(&self.net.v, "a placement in a run without any".into()),
            }
        }
    }
}

impl WriteHost for Side {
    fn send_written(&self, link: ConnId, done: SendDone, r: Result<()>) {
        done.complete(r);
        let acts = self.locked(|rdv| rdv.write_done(link));
        self.exec(acts);
    }

    fn chunk_written(&self, link: ConnId, stream: u32, r: Result<()>) {
        let acts = self.locked(|rdv| rdv.chunk_written(link, stream, r));
        self.exec(acts);
    }

    fn later(&self, job: Box<dyn FnOnce() + Send>) {
        // Only a write dropped while its thread unwinds comes here, which
        // these schedules do not make (see the module docs).
        job()
    }
}

/// The sender's endpoint: a write lands in the receiver's arena, then its
/// doorbell is queued; none lands once the link is lost.
pub(super) struct Ep {
    pub(super) to: Arc<Side>,
    pub(super) net: Arc<Net>,
}

impl Ep {
    fn land(&self, off: u64, imm: u32, op: &dyn WriteOp) -> Result<()> {
        let mut bells = self.net.bells.lock();
        if self.net.is_lost() {
            return Err(Error::PeerLost(format!("connection {LINK} is closed")));
        }
        {
            let mut mem = self.to.arena.lock();
            let mut at = off as usize;
            for s in op.segments() {
                let Some(dst) = mem.get_mut(at..at + s.len()) else {
                    return Err(Error::Internal(format!("a write at {off} outside the arena")));
                };
                dst.copy_from_slice(s);
                at += s.len();
            }
        }
        bells.push_back(imm);
        Ok(())
    }
}

impl Endpoint for Ep {
    fn id(&self) -> ConnId {
        LINK
    }
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }
    fn peer_hello(&self) -> &[u8] {
        &[]
    }
    fn remote_len(&self) -> u64 {
        self.to.arena.lock().len() as u64
    }
    fn write(&self, remote_off: u64, _key: u32, imm: u32, op: Box<dyn WriteOp>) {
        if self.net.drop_write.swap(false, O::SeqCst) {
            // A backend that loses the write (or the job holding it that
            // failed): dropped unfinished.
            drop(op);
            return;
        }
        let r = self.land(remote_off, imm, &*op);
        op.complete(r);
    }
    fn send_msg(&self, _msg: &[u8]) -> Result<()> {
        Err(Error::Internal("messages go through Side::send_msg".into()))
    }
    fn close(&self) {}
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

/// Deliver the next message a → b; the loss once none is left.
pub(super) fn pump_ab(a: &Side, b: &Side) -> bool {
    let lost = a.net.is_lost();
    let next = a.net.ab.lock().pop_front();
    match next {
        Some(m) => {
            let acts = b.locked(|r| r.on_message(LINK, &m));
            b.exec(acts);
            true
        }
        None => {
            if lost {
                b.on_loss(Error::PeerLost("connection lost".into()));
            }
            false
        }
    }
}

pub(super) fn pump_ba(a: &Side, b: &Side) -> bool {
    let lost = b.net.is_lost();
    let next = b.net.ba.lock().pop_front();
    match next {
        Some(m) => {
            let acts = a.locked(|r| r.on_message(LINK, &m));
            a.exec(acts);
            true
        }
        None => {
            if lost {
                a.on_loss(Error::PeerLost("connection lost".into()));
            }
            false
        }
    }
}

/// Ring the next doorbell at b (its write landed before it was queued).
pub(super) fn pump_bells(b: &Side) -> bool {
    let next = b.net.bells.lock().pop_front();
    let Some(imm) = next else { return false };
    let acts = {
        let mut g = b.rdv.lock();
        match g.as_mut() {
            Some(r) => {
                let mem = b.arena.lock();
                r.on_write_imm(LINK, imm, &Mem(&mem))
            }
            None => Actions::new(),
        }
    };
    b.exec(acts);
    true
}

/// Join every job and deliver everything until nothing moves.
pub(super) fn quiesce(a: &Side, b: &Side) {
    loop {
        let jobs: Vec<_> = std::mem::take(&mut *a.net.jobs.lock());
        let moved = [pump_ab(a, b), pump_ba(a, b), pump_bells(b)].contains(&true);
        if jobs.is_empty() && !moved {
            return;
        }
        for h in jobs {
            h.join().unwrap();
        }
    }
}
