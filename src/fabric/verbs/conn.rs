//! One RC connection (either side): its QP, registered buffers, the ops in
//! flight, and the FIFO of work waiting for send-queue slots or buffers.
//!
//! Everything mutable sits behind one lock and every post happens under
//! it, so work reaches the QP in call order (RC then keeps that order on the
//! wire: a write's final WRITE_WITH_IMM lands after its pieces, a message
//! sent after a write arrives after it). Callbacks never run under the lock:
//! methods return [`Action`]s that the caller runs after unlocking.
//!
//! Send-side strategy for arbitrary (unregistered) source memory, per write:
//! - staging (default below [`super::VerbsOptions::register_threshold`]):
//!   copy into one of this connection's registered chunks, one WRITE per
//!   chunk; chunks recycle on completion, so a write of any size pipelines
//!   through a bounded amount of pinned memory. Writes that fit the QP's
//!   inline size go inline. The copies are made by the thread that posts
//!   the write, or, when a completion on the progress thread frees the
//!   chunk a queued write waits for, by `rdev-verbs-copy` (the progress
//!   thread and the node's protocol lock never copy a tensor).
//! - zero-copy (at or above the threshold): each large segment's
//!   registration comes from the device's registration cache
//!   (`mr::cache`: reused while the application keeps the pages mapped,
//!   registered on a miss); small segments (the 256-byte slot header) are
//!   copied into one of the connection's small registered buffers; header
//!   and payload then go as ONE WRITE_WITH_IMM with several scatter/gather
//!   entries (more work requests only past `MAX_WR_BYTES`). When RLIMIT_MEMLOCK
//!   or a failed registration leaves a segment without a region, the
//!   whole write goes through staging instead (logged, counted).

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};
use rdma_sys::*;

use super::cm::{AcceptData, CmId};
use super::device::Cq;
use super::hca::Device;
use super::mr::arena::ArenaReg;
use super::mr::cache::Reg;
use super::mr::Slab;
use super::mw::Mw;
use super::wr::{self, NO_CHUNK};

mod events;
mod post;
pub(crate) use crate::fabric::{decode_refusal, encode_refusal};
use crate::error::{Error, Result};
use crate::fabric::{ConnId, FabricEvents, WriteOp as FabricWrite};

/// Control-message fragment header: kind, flags, 2 spare, payload length.
const HDR: usize = 8;
const FLAG_MORE: u8 = 1;

/// Kinds of control messages (the first byte of each fragment).
pub(crate) const MSG_HELLO: u8 = 1;
pub(crate) const MSG_HELLO_OK: u8 = 2;
pub(crate) const MSG_HELLO_ERR: u8 = 3;
/// A `MSG_HELLO_OK` starts with the arena's address (8 bytes) and rkey (4).
const HELLO_OK_KEYS: usize = 12;
pub(crate) const MSG_USER: u8 = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Active,
    Passive,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// rdma_cm is resolving / connecting.
    Connecting,
    /// Connected; the sender's hello is due (passive) or its reply (active).
    Handshake,
    Ready,
    Dead,
}

/// Work a connection's owner must do after releasing the lock.
pub(crate) enum Action {
    WriteDone(Finished),
    Imm(u32),
    Message(Vec<u8>),
    /// The sender's hello arrived: call `on_accept`.
    Accept(Vec<u8>),
    Disconnect(Error),
    /// Tear the connection down (on the progress thread).
    Kill(Error),
    /// A staged write waits for its copy into a staging chunk, which an
    /// event thread must not make: run [`Conn::pump_copying`] on
    /// `rdev-verbs-copy`.
    Copy,
}

/// The registration of each segment of a zero-copy write (`None`: copied
/// into a small buffer, or empty).
type Regs = smallvec::SmallVec<[Option<Arc<Reg>>; 4]>;

/// A write that completed (or failed): its registrations, its memory and
/// its callback, released in that order by [`Finished::run`], never under
/// the connection's lock. A registration whose last reference goes on the
/// progress thread is deregistered on `rdev-verbs-dereg` (`Mr`'s drop).
pub(crate) struct Finished {
    regs: Regs,
    op: Box<dyn FabricWrite>,
    res: Result<()>,
}

impl Finished {
    fn failed(op: Box<dyn FabricWrite>, why: Error) -> Finished {
        Finished { regs: Regs::new(), op, res: Err(why) }
    }

    pub(crate) fn run(self) {
        let Finished { regs, op, res } = self;
        drop(regs);
        op.complete(res);
    }
}

/// Segments of at most this many bytes are copied into a small buffer in
/// a zero-copy write instead of registered (the slot header).
pub(crate) const SMALL_COPY: usize = 4096;

struct WriteOp {
    // Field order = drop order: registrations before the memory they pin.
    regs: Regs,
    /// The source segments and the completion.
    op: Box<dyn FabricWrite>,
    imm: u32,
    /// The rkey of the range written (the slot's key from the receiver).
    rkey: u32,
    remote_off: u64,
    left: usize,
    seg: usize,
    seg_off: usize,
    /// Zero-copy (`regs`), else staged.
    register: bool,
    last_chunk: u32,
    /// The small buffer the final work request used (or `NO_CHUNK`).
    last_small: u32,
}

enum Op {
    Write(WriteOp),
}

struct OpSlot {
    gen: u32,
    op: Option<Op>,
}

enum Work {
    Msg { kind: u8, data: Vec<u8>, sent: usize, started: bool },
    Op(u32),
    /// Bind a memory window (receiver side; see `mw`).
    Bind(Arc<Mw>),
}

/// Sizes a connection is built with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizing {
    pub slot: usize,
    /// The device's shared receive depth (told to the peer, informational).
    pub n_recv: u32,
    pub n_send: u32,
    /// Small buffers for the copied segments of zero-copy writes.
    pub n_small: u32,
    pub chunk: usize,
    pub n_chunks: u32,
    pub sq_depth: u32,
    pub register_threshold: usize,
}

pub(crate) struct Inner {
    pub phase: Phase,
    pub cm: Option<CmId>,
    pub dev: Option<Arc<Device>>,
    pub slab: Option<Slab>,
    /// Receiver: the arena's registration on this connection's device.
    pub arena: Option<Arc<ArenaReg>>,
    pub remote: Option<AcceptData>,
    pub peer_hello: Vec<u8>,
    /// Passive side: the nonce this connection was accepted with (goes to
    /// `on_accept` with the sender's hello).
    pub nonce: [u8; crate::fabric::NONCE_LEN],
    /// Passive side: the sender's hello arrived (only one is taken).
    pub hello_taken: bool,
    /// Active side: the hello to send once established.
    pub hello: Vec<u8>,
    /// Active side: how `connect` ends.
    pub result: Option<Result<()>>,
    /// `on_disconnect` is owed (passive: accepted; active: handed out).
    pub owes_disconnect: bool,
    pub cqe_reserved: u32,
    /// The send CQ this connection's reservation is on.
    pub send_cq: Option<Arc<Cq>>,
    pub qpn: u32,
    qp: *mut ibv_qp,
    free_send: Vec<u32>,
    free_small: Vec<u32>,
    free_chunks: Vec<u32>,
    sq_free: u32,
    /// Inline bytes the QP accepts (0: none).
    max_inline: u32,
    /// Scatter/gather entries per send work request.
    max_sge: u32,
    /// Unsignalled send WRs posted since the last signalled one.
    unsignalled: u32,
    /// For each signalled send WR in flight, in posting order: how many
    /// send-queue slots its completion retires (itself and the unsignalled
    /// WRs posted before it: a send queue completes in order).
    retire: VecDeque<u32>,
    ops: Vec<OpSlot>,
    free_ops: Vec<u32>,
    queue: VecDeque<Work>,
    /// Passive side: control messages the node sent after it accepted the
    /// sender's hello and before the reply was queued (`accept_ok`); they
    /// follow the reply. (The node knows the link from `on_accept` on, and
    /// any thread may send on it: a keepalive probe, a Publish.)
    held: Vec<Vec<u8>>,
    reasm: Vec<u8>,
    /// Receiver side: the memory windows bound (or to be bound) to this
    /// QP, deallocated before it is destroyed (see `mw`).
    mws: Vec<Arc<Mw>>,
    /// Binds posted and not completed, by their number in the `wr_id`.
    binds: std::collections::HashMap<u32, Arc<Mw>>,
    next_bind: u32,
    /// A staged write's copy is due and this thread may not make it.
    copy_wanted: bool,
    /// A `pump_copying` job is queued for this connection.
    copy_queued: bool,
    /// Pumping on behalf of the copy thread: copies are made here.
    copying: bool,
}

// SAFETY: the raw QP pointer is only used under the connection's lock while
// the CmId that owns it is alive.
unsafe impl Send for Inner {}

pub(crate) struct Conn {
    pub id: ConnId,
    pub role: Role,
    /// 24-bit tag of this connection in its buffers' `wr_id`s.
    pub tag: u32,
    pub events: Arc<dyn FabricEvents>,
    /// Token of the listener that accepted us (passive side).
    pub listener: u64,
    pub sizing: Sizing,
    pub inner: Mutex<Inner>,
    pub cv: Condvar,
}

impl Conn {
    pub fn new(id: ConnId, role: Role, events: Arc<dyn FabricEvents>, listener: u64, sizing: Sizing) -> Conn {
        Conn {
            id,
            role,
            tag: wr::gen24(id),
            events,
            listener,
            sizing,
            inner: Mutex::new(Inner {
                phase: Phase::Connecting,
                cm: None,
                dev: None,
                slab: None,
                arena: None,
                remote: None,
                peer_hello: Vec::new(),
                nonce: [0; crate::fabric::NONCE_LEN],
                hello_taken: false,
                hello: Vec::new(),
                result: None,
                owes_disconnect: false,
                cqe_reserved: 0,
                send_cq: None,
                qpn: 0,
                qp: std::ptr::null_mut(),
                free_send: Vec::new(),
                free_small: Vec::new(),
                free_chunks: Vec::new(),
                sq_free: 0,
                max_inline: 0,
                max_sge: 1,
                unsignalled: 0,
                retire: VecDeque::new(),
                ops: Vec::new(),
                free_ops: Vec::new(),
                queue: VecDeque::new(),
                held: Vec::new(),
                reasm: Vec::new(),
                mws: Vec::new(),
                binds: std::collections::HashMap::new(),
                next_bind: 0,
                copy_wanted: false,
                copy_queued: false,
                copying: false,
            }),
            cv: Condvar::new(),
        }
    }

    /// This connection's registered buffers (registers: not on the
    /// progress thread).
    pub fn new_slab(&self, dev: &Device) -> Result<Slab> {
        let s = self.sizing;
        Slab::new(&dev.pd, s.slot, 0, s.n_send + s.n_small, s.chunk, s.n_chunks)
    }

    /// Give the connection its device, buffers (from [`Conn::new_slab`])
    /// and QP (on `cm`; receives come from the device's shared receive
    /// queue). Before rdma_connect / rdma_accept. On error the id stays in
    /// `inner` for [`Conn::kill`].
    pub fn setup(&self, inner: &mut Inner, cm: CmId, dev: Arc<Device>, slab: Slab) -> Result<()> {
        let s = self.sizing;
        inner.cm = Some(cm);
        let cqe = s.sq_depth;
        let send_cq = dev.reserve_send_cq(cqe)?;
        inner.cqe_reserved = cqe;
        inner.send_cq = Some(send_cq.clone());
        inner.dev = Some(dev.clone());
        let sges = super::WRITE_SGES.min(dev.ctx.info.max_sge.max(1) as u32);
        let cap = ibv_qp_cap {
            max_send_wr: s.sq_depth,
            max_recv_wr: 0,
            max_send_sge: sges,
            max_recv_sge: 1,
            max_inline_data: super::INLINE_BYTES,
        };
        let cm = inner.cm.as_mut().ok_or_else(|| Error::Internal("no id".into()))?;
        let got = cm.create_qp(&dev.pd, &send_cq, &dev.recv_cq, &dev.srq, cap)?;
        inner.qp = cm.qp();
        // SAFETY: the QP was just created and is owned by cm.
        inner.qpn = unsafe { (*inner.qp).qp_num };
        // Inline fragments are built on the stack: cap what we use.
        inner.max_inline = got.max_inline_data.min(post::INLINE_MAX as u32);
        inner.max_sge = got.max_send_sge.clamp(1, super::WRITE_SGES);
        inner.free_send = (0..s.n_send).rev().collect();
        inner.free_small = (s.n_send..s.n_send + s.n_small).rev().collect();
        inner.free_chunks = (0..s.n_chunks).rev().collect();
        inner.sq_free = s.sq_depth;
        inner.unsignalled = 0;
        inner.retire.clear();
        inner.slab = Some(slab);
        Ok(())
    }

    /// Receiver: `on_accept` said yes. Ready and the reply queued in one
    /// critical section, so no message sent by another thread as soon as
    /// `on_accept` returned can overtake the reply.
    pub fn accept_ok(&self, reply: Vec<u8>) -> Result<Vec<Action>> {
        let mut inner = self.inner.lock();
        if inner.phase != Phase::Handshake {
            return Err(Error::PeerLost(format!("connection {} closed during the handshake", self.id)));
        }
        // With windows the regions' keys grant nothing: 0 is sent.
        let keys = inner.arena.as_ref().map(|a| (a.base, a.whole().and_then(|e| e.mr().map(|m| m.rkey)).unwrap_or(0)));
        let Some((addr, rkey)) = keys else {
            return Err(Error::Internal(format!("connection {}: no arena registration to offer", self.id)));
        };
        inner.phase = Phase::Ready;
        inner.owes_disconnect = true;
        // The arena's address and key first, then the node's reply.
        let mut data = Vec::with_capacity(HELLO_OK_KEYS + reply.len());
        data.extend_from_slice(&addr.to_le_bytes());
        data.extend_from_slice(&rkey.to_le_bytes());
        data.extend_from_slice(&reply);
        inner.queue.push_back(Work::Msg { kind: MSG_HELLO_OK, data, sent: 0, started: false });
        for data in std::mem::take(&mut inner.held) {
            inner.queue.push_back(Work::Msg { kind: MSG_USER, data, sent: 0, started: false });
        }
        Ok(self.pump(&mut inner))
    }

    /// Work queued (or held) that waits for send slots or the peer.
    pub fn backlog(&self) -> usize {
        let inner = self.inner.lock();
        inner.queue.len() + inner.held.len()
    }

    /// Queue a control message (fragmented to buffer size) and post what fits.
    pub fn send_msg(&self, kind: u8, data: Vec<u8>) -> Result<Vec<Action>> {
        let mut inner = self.inner.lock();
        let ok = match kind {
            MSG_USER => inner.phase == Phase::Ready,
            _ => matches!(inner.phase, Phase::Handshake | Phase::Ready),
        };
        // Accepted by the node, the reply not queued yet: held until it is.
        let hold = kind == MSG_USER && self.role == Role::Passive && inner.phase == Phase::Handshake;
        if !ok && !hold {
            return Err(Error::PeerLost(format!("connection {} is closed", self.id)));
        }
        if inner.queue.len() + inner.held.len() >= super::MAX_QUEUED_WORK {
            return Err(Error::ResourceExhausted(format!(
                "connection {}: {} control messages and writes already wait for the peer",
                self.id,
                inner.queue.len()
            )));
        }
        if hold {
            inner.held.push(data);
            return Ok(Vec::new());
        }
        inner.queue.push_back(Work::Msg { kind, data, sent: 0, started: false });
        Ok(self.pump(&mut inner))
    }

    /// Receiver: bind `mw` on this QP, ordered before any message queued
    /// after this call (the Publish naming its range; see `mw`).
    pub fn bind(&self, mw: Arc<Mw>) -> Result<Vec<Action>> {
        let mut inner = self.inner.lock();
        if !matches!(inner.phase, Phase::Handshake | Phase::Ready) {
            return Err(Error::PeerLost(format!("connection {} is closed", self.id)));
        }
        // Windows of ranges granted again since are dead: forget them.
        inner.mws.retain(|m| !m.is_dead());
        inner.mws.push(mw.clone());
        inner.queue.push_back(Work::Bind(mw));
        Ok(self.pump(&mut inner))
    }

    /// Post what waits, if the connection is alive: after an arena extent
    /// some queued bind waited for was registered (see `mr::arena`).
    pub fn pump_now(&self) -> Vec<Action> {
        let mut inner = self.inner.lock();
        if !matches!(inner.phase, Phase::Handshake | Phase::Ready) {
            return Vec::new();
        }
        self.pump(&mut inner)
    }

    /// Post what waits, copying staged writes into their chunks here (the
    /// job an [`Action::Copy`] asks for; never on an event thread).
    pub fn pump_copying(&self) -> Vec<Action> {
        let mut inner = self.inner.lock();
        inner.copy_queued = false;
        if !matches!(inner.phase, Phase::Handshake | Phase::Ready) {
            return Vec::new();
        }
        inner.copying = true;
        let acts = self.pump(&mut inner);
        inner.copying = false;
        acts
    }

    /// Start a write (see [`crate::fabric::Endpoint::write`]).
    pub fn write(&self, remote_off: u64, rkey: u32, imm: u32, done: Box<dyn FabricWrite>) -> Vec<Action> {
        let closed = || Error::PeerLost(format!("connection {} is closed", self.id));
        let total = done.segments().iter().try_fold(0usize, |t, s| t.checked_add(s.len()));
        let Some(total) = total else {
            return vec![Action::WriteDone(Finished::failed(done, Error::InvalidArgument("write size overflows".into())))];
        };
        let (dev, arena_len) = {
            let inner = self.inner.lock();
            if inner.phase != Phase::Ready {
                drop(inner);
                return vec![Action::WriteDone(Finished::failed(done, closed()))];
            }
            (inner.dev.clone(), inner.remote.map(|r| r.arena_len).unwrap_or(0))
        };
        if remote_off.checked_add(total as u64).map_or(true, |end| end > arena_len) {
            return vec![Action::WriteDone(Finished::failed(done, Error::InvalidArgument(format!(
                "write of {total} bytes at {remote_off} is outside the peer's arena of {arena_len} bytes"
            ))))];
        }
        let mut register = total > 0 && (total >= self.sizing.register_threshold || self.sizing.n_chunks == 0);
        let mut regs = Regs::new();
        if register {
            // Outside the lock: a cache miss registers, which can take a
            // while and must not stall this connection's completions.
            let Some(dev) = dev else {
                return vec![Action::WriteDone(Finished::failed(done, Error::Internal("no device".into())))];
            };
            let mut miss = None;
            for b in done.segments() {
                if b.is_empty() || (b.len() <= SMALL_COPY.min(self.sizing.slot) && self.sizing.n_small > 0) {
                    regs.push(None);
                    continue;
                }
                match dev.regs.get(b.as_ptr(), b.len()) {
                    Ok(r) => regs.push(Some(r)),
                    Err(m) => {
                        miss = Some(m);
                        break;
                    }
                }
            }
            if let Some(m) = miss {
                regs.clear();
                if self.sizing.n_chunks == 0 {
                    return vec![Action::WriteDone(Finished::failed(done, Error::ResourceExhausted(m.to_string())))];
                }
                // Out of pinnable memory (memlock) or registration
                // resources: copy through the staging chunks instead.
                register = false;
                let st = crate::stats::Stats::global();
                let n = st.c.verbs_staged_fallbacks.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                if n.is_power_of_two() {
                    log::warn!("verbs: conn {}: a {total}-byte write goes through the staging buffers: {m} ({n} such writes so far)", self.id);
                }
            }
        }
        let mut inner = self.inner.lock();
        if inner.phase != Phase::Ready {
            drop(inner);
            drop(regs);
            return vec![Action::WriteDone(Finished::failed(done, closed()))];
        }
        let op = Op::Write(WriteOp {
            regs,
            op: done,
            imm,
            rkey,
            remote_off,
            left: total,
            seg: 0,
            seg_off: 0,
            register,
            last_chunk: NO_CHUNK,
            last_small: NO_CHUNK,
        });
        let slot = alloc_op(&mut inner, op);
        inner.queue.push_back(Work::Op(slot));
        self.pump(&mut inner)
    }

}

fn alloc_op(inner: &mut Inner, op: Op) -> u32 {
    if let Some(i) = inner.free_ops.pop() {
        let s = &mut inner.ops[i as usize];
        s.gen = wr::gen24(u64::from(s.gen) + 1);
        s.op = Some(op);
        i
    } else {
        inner.ops.push(OpSlot { gen: 1, op: Some(op) });
        (inner.ops.len() - 1) as u32
    }
}
