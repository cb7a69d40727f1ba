//! Posting: turning queued work (message fragments, write pieces, reads)
//! into work requests while send-queue slots, send buffers and staging
//! chunks last. Always under the connection's lock, so posts keep call order.
//!
//! Signalling: a WR is signalled when something must come back on its
//! completion (a send buffer, a staging chunk, a write's `done`), and
//! otherwise every [`SIGNAL_EVERY`]th; an unsignalled WR keeps its
//! send-queue slot until the next signalled completion retires it.
//! Fragments and writes that fit the QP's inline size are copied into the
//! WR itself (`IBV_SEND_INLINE`): no buffer, no DMA read, no completion.

use crate::fabric::verbs::SIGNAL_EVERY;

/// Largest inline payload we build (on the stack) per WR.
pub(crate) const INLINE_MAX: usize = 1024;
/// `index` of a [`WrKind::Send`] that used no send buffer (inline).
pub(crate) const NO_BUF: u32 = u32::MAX;
/// Marks a [`WrKind::Piece`]'s `index` as a small buffer, not a chunk.
pub(crate) const SMALL: u32 = 1 << 31;

use rdma_sys::*;

use super::{Action, Conn, Inner, Op, Work, FLAG_MORE, HDR};
use crate::fabric::verbs::mr::arena::Ready;
use crate::error::{Error, Result};
use crate::fabric::verbs::wr::{self, WrKind, NO_CHUNK};

impl Conn {
    /// Post queued work, in order, while slots and buffers last.
    pub(super) fn pump(&self, inner: &mut Inner) -> Vec<Action> {
        let mut acts = Vec::new();
        while let Some(front) = inner.queue.pop_front() {
            let r = match front {
                Work::Msg { kind, data, sent, started } => {
                    match self.post_msg(inner, kind, &data, sent, started) {
                        Ok(Some(sent)) => {
                            inner.queue.push_front(Work::Msg { kind, data, sent, started: true });
                            break;
                        }
                        Ok(None) => Ok(()),
                        Err(e) => Err(e),
                    }
                }
                // A window over an arena extent still registering waits
                // (and all behind it: its Publish); revoked ones are skipped.
                Work::Bind(mw) if mw.is_dead() => Ok(()),
                Work::Bind(mw) => match mw.ext.ready_or_wait(self.id) {
                    Ready::Yes if inner.sq_free > 0 => self.post_bind(inner, mw),
                    Ready::Yes | Ready::Wait => {
                        inner.queue.push_front(Work::Bind(mw));
                        break;
                    }
                    Ready::Failed(e) => Err(e.context("registering the receive arena for a granted slot")),
                },
                Work::Op(slot) => match self.post_op(inner, slot) {
                    Ok(true) => Ok(()),
                    Ok(false) => {
                        inner.queue.push_front(Work::Op(slot));
                        break;
                    }
                    Err(e) => Err(e),
                },
            };
            if let Err(e) = r {
                acts.push(Action::Kill(e.context("posting work request")));
                break;
            }
        }
        if std::mem::take(&mut inner.copy_wanted) && !inner.copy_queued {
            inner.copy_queued = true;
            acts.push(Action::Copy);
        }
        acts
    }

    /// Post fragments of one message from `sent`; `Some(sent)` if it stalled.
    fn post_msg(&self, inner: &mut Inner, kind: u8, data: &[u8], mut sent: usize, mut started: bool) -> Result<Option<usize>> {
        let room = self.sizing.slot - HDR;
        while !started || sent < data.len() {
            if inner.sq_free == 0 {
                return Ok(Some(sent));
            }
            let n = room.min(data.len() - sent);
            let more = sent + n < data.len();
            let mut hdr = [0u8; HDR];
            hdr[0] = kind;
            hdr[1] = if more { FLAG_MORE } else { 0 };
            hdr[4..8].copy_from_slice(&(n as u32).to_le_bytes());
            if HDR + n <= inner.max_inline as usize {
                // Inline: the bytes are copied into the WR at post time, so
                // a stack buffer will do and nothing comes back.
                let mut tmp = [0u8; INLINE_MAX];
                tmp[..HDR].copy_from_slice(&hdr);
                tmp[HDR..HDR + n].copy_from_slice(&data[sent..sent + n]);
                let mut sge = [ibv_sge { addr: tmp.as_ptr() as u64, length: (HDR + n) as u32, lkey: 0 }];
                let id = wr::encode(WrKind::Send, self.tag, NO_BUF);
                post_send(inner, id, ibv_wr_opcode::IBV_WR_SEND, &mut sge, None, 0, Flags { signal: false, inline: true })?;
            } else {
                let Some(buf) = inner.free_send.pop() else { return Ok(Some(sent)) };
                let slab = inner.slab.as_ref().ok_or_else(|| Error::Internal("no buffers".into()))?;
                let p = slab.send_buf(buf);
                // SAFETY: buffer `buf` is ours (popped from the free list) and
                // holds slot >= HDR + n bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(hdr.as_ptr(), p, HDR);
                    std::ptr::copy_nonoverlapping(data.as_ptr().add(sent), p.add(HDR), n);
                }
                let mut sge = [ibv_sge { addr: p as u64, length: (HDR + n) as u32, lkey: slab.mr.lkey }];
                let id = wr::encode(WrKind::Send, self.tag, buf);
                // Signalled: its completion gives the buffer back.
                post_send(inner, id, ibv_wr_opcode::IBV_WR_SEND, &mut sge, None, 0, Flags { signal: true, inline: false })?;
            }
            sent += n;
            started = true;
        }
        Ok(None)
    }

    /// Post a memory window's bind (a send-queue slot is free), signalled:
    /// its completion marks the window bound (see `mw`).
    fn post_bind(&self, inner: &mut Inner, mw: std::sync::Arc<crate::fabric::verbs::mw::Mw>) -> Result<()> {
        let n = inner.next_bind;
        let id = wr::encode(WrKind::Bind, self.tag, n);
        let posted = mw.post_bind(|bind| post_bind_wr(inner, id, bind))?;
        if posted {
            inner.next_bind = inner.next_bind.wrapping_add(1);
            inner.binds.insert(n, mw);
            crate::stats::Stats::add(&crate::stats::Stats::global().c.verbs_windows_bound, 1);
        }
        Ok(())
    }

    /// Post what fits of op `slot`; `true` once it is fully posted.
    fn post_op(&self, inner: &mut Inner, slot: u32) -> Result<bool> {
        if matches!(&inner.ops[slot as usize].op, Some(Op::Write(w)) if w.register) {
            return self.post_gather(inner, slot);
        }
        let gen = inner.ops[slot as usize].gen;
        let chunk_size = self.sizing.chunk;
        let tag = self.tag;
        loop {
            if inner.sq_free == 0 {
                return Ok(false);
            }
            let rkey = match &inner.ops[slot as usize].op {
                Some(Op::Write(w)) => w.rkey,
                None => 0,
            };
            let rbase = inner.remote.map(|r| r.arena_addr).unwrap_or(0);
            let max_inline = inner.max_inline as usize;
            // A small staged write (all that is left fits inline) goes
            // inline: no chunk, no copy into registered memory.
            let inline = matches!(&inner.ops[slot as usize].op, Some(Op::Write(w)) if !w.register && w.left > 0 && w.left <= max_inline);
            let staging_chunk = match &inner.ops[slot as usize].op {
                Some(Op::Write(w)) if !w.register && w.left > 0 && !inline => {
                    if inner.free_chunks.is_empty() {
                        return Ok(false);
                    }
                    if !inner.copying && !crate::fabric::may_block() {
                        // A chunk's copy (up to 256 KiB) is not for an
                        // event thread (a completion that freed a chunk)
                        // nor under the node's protocol lock: the copy
                        // thread pumps on (`Action::Copy`).
                        inner.copy_wanted = true;
                        return Ok(false);
                    }
                    inner.free_chunks.pop()
                }
                _ => None,
            };
            let slab_lkey = inner.slab.as_ref().map(|s| s.mr.lkey).unwrap_or(0);
            let chunk_ptr = staging_chunk.and_then(|c| inner.slab.as_ref().map(|s| s.chunk_buf(c)));
            let mut tmp = [0u8; INLINE_MAX];
            let Some(op) = inner.ops[slot as usize].op.as_mut() else { return Ok(true) };
            let (wr_id, opcode, sge, remote, imm, last) = match op {
                Op::Write(w) => {
                    let segs = w.op.segments();
                    // Skip empty segments so the cursor points at real bytes.
                    while w.seg < segs.len() && w.seg_off >= segs[w.seg].len() {
                        w.seg += 1;
                        w.seg_off = 0;
                    }
                    let piece;
                    let sge;
                    if w.left == 0 {
                        piece = 0;
                        sge = None;
                    } else if inline {
                        piece = w.left;
                        let mut copied = 0;
                        while copied < piece {
                            let b = segs[w.seg];
                            let n = (b.len() - w.seg_off).min(piece - copied);
                            tmp[copied..copied + n].copy_from_slice(&b[w.seg_off..w.seg_off + n]);
                            copied += n;
                            w.seg_off += n;
                            if w.seg_off == b.len() {
                                w.seg += 1;
                                w.seg_off = 0;
                            }
                        }
                        sge = Some(ibv_sge { addr: tmp.as_ptr() as u64, length: piece as u32, lkey: 0 });
                    } else {
                        let (Some(c), Some(p)) = (staging_chunk, chunk_ptr) else {
                            return Err(Error::Internal("staged write piece without a chunk".into()));
                        };
                        piece = w.left.min(chunk_size);
                        let mut copied = 0;
                        while copied < piece {
                            let b = segs[w.seg];
                            let n = (b.len() - w.seg_off).min(piece - copied);
                            // SAFETY: chunk c is ours (popped from the free
                            // list) and holds chunk_size >= piece bytes; the
                            // source range is inside the segment.
                            unsafe { std::ptr::copy_nonoverlapping(b.as_ptr().add(w.seg_off), p.add(copied), n) };
                            copied += n;
                            w.seg_off += n;
                            if w.seg_off == b.len() {
                                w.seg += 1;
                                w.seg_off = 0;
                            }
                        }
                        sge = Some(ibv_sge { addr: p as u64, length: piece as u32, lkey: slab_lkey });
                        let _ = c;
                    }
                    let remote = rbase + w.remote_off;
                    w.remote_off += piece as u64;
                    w.left -= piece;
                    let last = w.left == 0;
                    let chunk = staging_chunk.unwrap_or(NO_CHUNK);
                    if last {
                        w.last_chunk = chunk;
                        (wr::encode(WrKind::WriteLast, gen, slot), ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM, sge, remote, w.imm, true)
                    } else {
                        (wr::encode(WrKind::Piece, tag, chunk), ibv_wr_opcode::IBV_WR_RDMA_WRITE, sge, remote, 0, false)
                    }
                }
            };
            // The last WR's completion runs `done`; a piece's gives its
            // staging chunk back.
            let flags = Flags { signal: last || staging_chunk.is_some(), inline };
            let mut sges: smallvec::SmallVec<[ibv_sge; 1]> = sge.into_iter().collect();
            post_send(inner, wr_id, opcode, &mut sges, Some((remote, rkey)), imm, flags)?;
            if last {
                return Ok(true);
            }
        }
    }

    /// Post what fits of zero-copy write `slot`: each work request gathers
    /// up to `max_sge` pieces, registered segments in place and small ones
    /// copied into one small buffer (a slot header and its payload: one
    /// WRITE_WITH_IMM). `true` once it is fully posted.
    fn post_gather(&self, inner: &mut Inner, slot: u32) -> Result<bool> {
        let gen = inner.ops[slot as usize].gen;
        let rbase = inner.remote.map(|r| r.arena_addr).unwrap_or(0);
        let max_sge = (inner.max_sge as usize).clamp(1, crate::fabric::verbs::WRITE_SGES as usize);
        let small_size = self.sizing.slot;
        loop {
            if inner.sq_free == 0 {
                return Ok(false);
            }
            let Some(Op::Write(w)) = inner.ops[slot as usize].op.as_ref() else { return Ok(true) };
            // A small buffer if any copied segment is left (given back
            // below when this request takes none).
            let needs_small = {
                let segs = w.op.segments();
                (w.seg..segs.len()).any(|i| w.regs.get(i).is_some_and(|r| r.is_none()) && segs[i].len() > if i == w.seg { w.seg_off } else { 0 })
            };
            let small = if needs_small {
                match inner.free_small.pop() {
                    Some(b) => Some(b),
                    None => return Ok(false),
                }
            } else {
                None
            };
            let slab = inner.slab.as_ref().ok_or_else(|| Error::Internal("no buffers".into()))?;
            let (small_ptr, slab_lkey) = (small.map(|b| slab.send_buf(b)), slab.mr.lkey);
            let Some(Op::Write(w)) = inner.ops[slot as usize].op.as_mut() else { return Ok(true) };
            let mut sges: smallvec::SmallVec<[ibv_sge; 4]> = smallvec::SmallVec::new();
            let (mut bytes, mut used) = (0usize, 0usize);
            let segs = w.op.segments();
            while w.seg < segs.len() && sges.len() < max_sge && bytes < crate::fabric::verbs::MAX_WR_BYTES {
                let b = segs[w.seg];
                if w.seg_off >= b.len() {
                    w.seg += 1;
                    w.seg_off = 0;
                    continue;
                }
                match w.regs.get(w.seg).and_then(|r| r.as_ref()) {
                    Some(r) => {
                        let take = (b.len() - w.seg_off).min(crate::fabric::verbs::MAX_WR_BYTES - bytes);
                        // SAFETY: an offset inside the segment, which `r`'s
                        // region covers.
                        let addr = unsafe { b.as_ptr().add(w.seg_off) } as u64;
                        sges.push(ibv_sge { addr, length: take as u32, lkey: r.mr.lkey });
                        w.seg_off += take;
                        bytes += take;
                    }
                    None => {
                        let n = b.len() - w.seg_off;
                        let Some(p) = small_ptr else { return Err(Error::Internal("copied segment without a small buffer".into())) };
                        if used + n > small_size {
                            break;
                        }
                        // SAFETY: the small buffer is ours (popped from the
                        // free list) and holds `small_size` >= used + n bytes.
                        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr().add(w.seg_off), p.add(used), n) };
                        sges.push(ibv_sge { addr: p as u64 + used as u64, length: n as u32, lkey: slab_lkey });
                        w.seg_off += n;
                        used += n;
                        bytes += n;
                    }
                }
            }
            drop(segs);
            let small = match small {
                Some(b) if used == 0 => {
                    inner.free_small.push(b);
                    None
                }
                s => s,
            };
            let Some(Op::Write(w)) = inner.ops[slot as usize].op.as_mut() else { return Ok(true) };
            let remote = rbase + w.remote_off;
            w.remote_off += bytes as u64;
            w.left -= bytes;
            let (rkey, imm, last) = (w.rkey, w.imm, w.left == 0);
            let small_idx = small.unwrap_or(NO_CHUNK);
            let (wr_id, opcode) = if last {
                w.last_small = small_idx;
                (wr::encode(WrKind::WriteLast, gen, slot), ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM)
            } else {
                let idx = small.map(|b| b | SMALL).unwrap_or(NO_CHUNK);
                (wr::encode(WrKind::Piece, self.tag, idx), ibv_wr_opcode::IBV_WR_RDMA_WRITE)
            };
            // The last request's completion runs `done`; a piece's gives
            // its small buffer back; other pieces need no completion.
            let flags = Flags { signal: last || small.is_some(), inline: false };
            post_send(inner, wr_id, opcode, &mut sges, Some((remote, rkey)), if last { imm } else { 0 }, flags)?;
            if last {
                return Ok(true);
            }
        }
    }
}

/// How to post one send WR.
#[derive(Clone, Copy)]
pub(super) struct Flags {
    /// Must complete (something comes back); otherwise it is signalled
    /// only as every [`SIGNAL_EVERY`]th.
    pub signal: bool,
    /// Copy the data into the WR (the source may be reused at once).
    pub inline: bool,
}

pub(super) fn post_send(inner: &mut Inner, wr_id: u64, opcode: ibv_wr_opcode::Type, sges: &mut [ibv_sge], rdma: Option<(u64, u32)>, imm: u32, flags: Flags) -> Result<()> {
    if inner.qp.is_null() {
        return Err(Error::PeerLost("queue pair is gone".into()));
    }
    // SAFETY: ibv_send_wr is POD; zero is a valid empty request.
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.opcode = opcode;
    let signal = flags.signal || inner.unsignalled + 1 >= SIGNAL_EVERY;
    if signal {
        wr.send_flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
    }
    if flags.inline {
        wr.send_flags |= ibv_send_flags::IBV_SEND_INLINE.0;
    }
    if !sges.is_empty() {
        wr.sg_list = sges.as_mut_ptr();
        wr.num_sge = sges.len() as i32;
    }
    if let Some((addr, rkey)) = rdma {
        wr.wr.rdma = rdma_t { remote_addr: addr, rkey };
    }
    wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
    let mut bad = std::ptr::null_mut();
    // SAFETY: the QP is alive (we hold the owner's lock); wr/sge live across
    // the call; the memory is registered and stays alive until completion
    // (inline data is copied during the call).
    let rc = unsafe { ibv_post_send(inner.qp, &mut wr, &mut bad) };
    if rc != 0 {
        return Err(Error::Io(format!("ibv_post_send: {}", std::io::Error::from_raw_os_error(rc))));
    }
    inner.sq_free -= 1;
    if signal {
        inner.retire.push_back(inner.unsignalled + 1);
        inner.unsignalled = 0;
    } else {
        inner.unsignalled += 1;
    }
    Ok(())
}

/// Post one signalled `IBV_WR_BIND_MW` (type-2 window bind; see `mw`).
fn post_bind_wr(inner: &mut Inner, wr_id: u64, bind: bind_mw_t) -> Result<()> {
    if inner.qp.is_null() {
        return Err(Error::PeerLost("queue pair is gone".into()));
    }
    // SAFETY: ibv_send_wr is POD; zero is a valid empty request.
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.opcode = ibv_wr_opcode::IBV_WR_BIND_MW;
    wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
    wr.bind_mw_tso_union.bind_mw = bind;
    let mut bad = std::ptr::null_mut();
    // SAFETY: the QP is alive (we hold the owner's lock); the window and
    // the region are alive (the caller holds the window, which holds the
    // region) and are deallocated only after this QP's binds completed or
    // before the QP is destroyed.
    let rc = unsafe { ibv_post_send(inner.qp, &mut wr, &mut bad) };
    if rc != 0 {
        return Err(Error::Io(format!("ibv_post_send(BIND_MW): {}", std::io::Error::from_raw_os_error(rc))));
    }
    inner.sq_free -= 1;
    inner.retire.push_back(inner.unsignalled + 1);
    inner.unsignalled = 0;
    Ok(())
}
