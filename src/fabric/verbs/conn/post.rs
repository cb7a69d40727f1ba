//! Posting: turning queued work (message fragments, write pieces, reads)
//! into work requests while send-queue slots, send buffers and staging
//! chunks last. Always under the connection's lock, so posts keep call order.

use rdma_sys::*;

use super::{Action, Conn, Inner, Op, Work, FLAG_MORE, HDR};
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
        acts
    }

    /// Post fragments of one message from `sent`; `Some(sent)` if it stalled.
    fn post_msg(&self, inner: &mut Inner, kind: u8, data: &[u8], mut sent: usize, mut started: bool) -> Result<Option<usize>> {
        let room = self.sizing.slot - HDR;
        while !started || sent < data.len() {
            if inner.sq_free == 0 || inner.free_send.is_empty() {
                return Ok(Some(sent));
            }
            let Some(buf) = inner.free_send.pop() else { return Ok(Some(sent)) };
            let n = room.min(data.len() - sent);
            let more = sent + n < data.len();
            let slab = inner.slab.as_ref().ok_or_else(|| Error::Internal("no buffers".into()))?;
            let p = slab.send_buf(buf);
            let mut hdr = [0u8; HDR];
            hdr[0] = kind;
            hdr[1] = if more { FLAG_MORE } else { 0 };
            hdr[4..8].copy_from_slice(&(n as u32).to_le_bytes());
            // SAFETY: buffer `buf` is ours (popped from the free list) and
            // holds slot >= HDR + n bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(hdr.as_ptr(), p, HDR);
                std::ptr::copy_nonoverlapping(data.as_ptr().add(sent), p.add(HDR), n);
            }
            let sge = ibv_sge { addr: p as u64, length: (HDR + n) as u32, lkey: slab.mr.lkey };
            let id = wr::encode(WrKind::Send, self.tag, buf);
            post_send(inner, id, ibv_wr_opcode::IBV_WR_SEND, Some(sge), None, 0)?;
            sent += n;
            started = true;
        }
        Ok(None)
    }

    /// Post what fits of op `slot`; `true` once it is fully posted.
    fn post_op(&self, inner: &mut Inner, slot: u32) -> Result<bool> {
        let gen = inner.ops[slot as usize].gen;
        let chunk_size = self.sizing.chunk;
        let tag = self.tag;
        loop {
            if inner.sq_free == 0 {
                return Ok(false);
            }
            let rkey = inner.remote.map(|r| r.arena_rkey).unwrap_or(0);
            let rbase = inner.remote.map(|r| r.arena_addr).unwrap_or(0);
            let staging_chunk = match &inner.ops[slot as usize].op {
                Some(Op::Write(w)) if !w.register && w.left > 0 => match inner.free_chunks.pop() {
                    Some(c) => Some(c),
                    None => return Ok(false),
                },
                _ => None,
            };
            let slab_lkey = inner.slab.as_ref().map(|s| s.mr.lkey).unwrap_or(0);
            let chunk_ptr = staging_chunk.and_then(|c| inner.slab.as_ref().map(|s| s.chunk_buf(c)));
            let Some(op) = inner.ops[slot as usize].op.as_mut() else { return Ok(true) };
            let (wr_id, opcode, sge, remote, imm, last) = match op {
                Op::Write(w) => {
                    // Skip empty segments so the cursor points at real bytes.
                    while w.seg < w.segs.len() && w.seg_off >= (*w.segs[w.seg]).as_ref().len() {
                        w.seg += 1;
                        w.seg_off = 0;
                    }
                    let piece;
                    let sge;
                    if w.left == 0 {
                        piece = 0;
                        sge = None;
                    } else if let (Some(c), Some(p)) = (staging_chunk, chunk_ptr) {
                        piece = w.left.min(chunk_size);
                        let mut copied = 0;
                        while copied < piece {
                            let b = (*w.segs[w.seg]).as_ref();
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
                    } else {
                        let b = (*w.segs[w.seg]).as_ref();
                        let mr = w.mrs[w.seg].as_ref().ok_or_else(|| Error::Internal("segment not registered".into()))?;
                        piece = (b.len() - w.seg_off).min(crate::fabric::verbs::MAX_WR_BYTES);
                        // SAFETY: offset inside the registered segment.
                        let addr = unsafe { b.as_ptr().add(w.seg_off) } as u64;
                        sge = Some(ibv_sge { addr, length: piece as u32, lkey: mr.lkey });
                        w.seg_off += piece;
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
            post_send(inner, wr_id, opcode, sge, Some((remote, rkey)), imm)?;
            if last {
                return Ok(true);
            }
        }
    }
}

pub(super) fn post_recv(inner: &mut Inner, tag: u32, idx: u32) -> Result<()> {
    let slab = inner.slab.as_ref().ok_or_else(|| Error::Internal("no buffers".into()))?;
    let mut sge = ibv_sge { addr: slab.recv_buf(idx) as u64, length: slab.slot as u32, lkey: slab.mr.lkey };
    let mut wr = ibv_recv_wr { wr_id: wr::encode(WrKind::Recv, tag, idx), next: std::ptr::null_mut(), sg_list: &mut sge, num_sge: 1 };
    let mut bad = std::ptr::null_mut();
    // SAFETY: the QP is alive (owned by inner.cm, we hold the lock); wr and
    // sge live across the call; the buffer is registered and ours.
    let rc = unsafe { ibv_post_recv(inner.qp, &mut wr, &mut bad) };
    if rc != 0 {
        return Err(Error::Io(format!("ibv_post_recv: {}", std::io::Error::from_raw_os_error(rc))));
    }
    Ok(())
}

pub(super) fn post_send(inner: &mut Inner, wr_id: u64, opcode: ibv_wr_opcode::Type, sge: Option<ibv_sge>, rdma: Option<(u64, u32)>, imm: u32) -> Result<()> {
    if inner.qp.is_null() {
        return Err(Error::PeerLost("queue pair is gone".into()));
    }
    let mut sge = sge;
    // SAFETY: ibv_send_wr is POD; zero is a valid empty request.
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.opcode = opcode;
    wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
    if let Some(s) = sge.as_mut() {
        wr.sg_list = s;
        wr.num_sge = 1;
    }
    if let Some((addr, rkey)) = rdma {
        wr.wr.rdma = rdma_t { remote_addr: addr, rkey };
    }
    wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
    let mut bad = std::ptr::null_mut();
    // SAFETY: the QP is alive (we hold the owner's lock); wr/sge live across
    // the call; the memory is registered and stays alive until completion.
    let rc = unsafe { ibv_post_send(inner.qp, &mut wr, &mut bad) };
    if rc != 0 {
        return Err(Error::Io(format!("ibv_post_send: {}", std::io::Error::from_raw_os_error(rc))));
    }
    inner.sq_free -= 1;
    Ok(())
}
