//! What comes back on a connection: completions of its work requests,
//! incoming control messages (the handshake's included) and teardown.
//! Under the connection's lock, as posting is (`post`); callbacks are
//! returned as [`Action`]s, never run here.

use rdma_sys::*;

use super::{post, wr, Action, Conn, Finished, Inner, Op, Phase, Role, FLAG_MORE, HDR, HELLO_OK_KEYS, MSG_HELLO, MSG_HELLO_ERR, MSG_HELLO_OK, MSG_USER};
use crate::error::{Error, Result};
use crate::fabric::decode_refusal;
use crate::fabric::verbs::wr::{WrKind, NO_CHUNK};

impl Conn {
    /// Handle one completion of this connection's QP. For a receive,
    /// `recv` is the shared receive buffer's bytes (the caller reposts the
    /// buffer after this returns).
    pub fn complete(&self, wc: &ibv_wc, recv: Option<&[u8]>) -> Vec<Action> {
        let mut acts = Vec::new();
        let mut inner = self.inner.lock();
        if inner.phase == Phase::Dead {
            return acts;
        }
        let Some((kind, gen, idx)) = wr::decode(wc.wr_id) else {
            log::warn!("verbs: conn {}: completion with unknown wr_id {:#x}", self.id, wc.wr_id);
            return acts;
        };
        let ok = wc.status == ibv_wc_status::IBV_WC_SUCCESS;
        let err = || {
            // SAFETY: returns a static string for any status.
            let s = unsafe { std::ffi::CStr::from_ptr(ibv_wc_status_str(wc.status)) };
            Error::PeerLost(format!(
                "RDMA {kind:?} on connection {} failed: {} (status {}, vendor error {:#x})",
                self.id,
                s.to_string_lossy(),
                wc.status,
                wc.vendor_err
            ))
        };
        if kind != WrKind::Recv {
            // Only signalled WRs complete (on success); each retires the
            // unsignalled ones posted before it.
            let n = inner.retire.pop_front().unwrap_or(1);
            inner.sq_free = (inner.sq_free + n).min(self.sizing.sq_depth);
        }
        let _ = idx;
        match kind {
            WrKind::Recv => {
                if ok {
                    if let Err(e) = self.on_recv(&mut inner, wc, recv.unwrap_or_default(), &mut acts) {
                        acts.push(Action::Kill(e));
                    }
                }
            }
            WrKind::Send if gen == self.tag => {
                if idx != post::NO_BUF {
                    inner.free_send.push(idx);
                }
            }
            WrKind::Piece if gen == self.tag => {
                if idx == NO_CHUNK {
                } else if idx & post::SMALL != 0 {
                    inner.free_small.push(idx & !post::SMALL);
                } else {
                    inner.free_chunks.push(idx);
                }
            }
            WrKind::Bind if gen == self.tag => {
                if let Some(mw) = inner.binds.remove(&idx) {
                    mw.bind_done(ok);
                }
            }
            WrKind::WriteLast => {
                if let Some(op) = take_op(&mut inner, idx, gen) {
                    let res = if ok { Ok(()) } else { Err(err()) };
                    match op {
                        Op::Write(w) => {
                            if w.last_chunk != NO_CHUNK {
                                inner.free_chunks.push(w.last_chunk);
                            }
                            if w.last_small != NO_CHUNK {
                                inner.free_small.push(w.last_small);
                            }
                            acts.push(Action::WriteDone(Finished { regs: w.regs, op: w.op, res }));
                        }
                    }
                }
            }
            _ => log::debug!("verbs: conn {}: stale completion {kind:?} gen {gen}", self.id),
        }
        if !ok {
            acts.push(Action::Kill(err()));
            return acts;
        }
        acts.extend(self.pump(&mut inner));
        acts
    }

    fn on_recv(&self, inner: &mut Inner, wc: &ibv_wc, buf: &[u8], acts: &mut Vec<Action>) -> Result<()> {
        if wc.opcode == ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM {
            // SAFETY: for RECV_RDMA_WITH_IMM the union holds imm_data.
            let imm = u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data });
            if inner.phase == Phase::Ready {
                acts.push(Action::Imm(imm));
            }
            return Ok(());
        }
        let len = wc.byte_len as usize;
        if len < HDR || len > buf.len() {
            return Err(Error::Protocol(format!("control fragment of {len} bytes")));
        }
        let frag = &buf[..len];
        let (kind, more) = (frag[0], frag[1] & FLAG_MORE != 0);
        let n = u32::from_le_bytes([frag[4], frag[5], frag[6], frag[7]]) as usize;
        if HDR + n != len {
            return Err(Error::Protocol("control fragment length mismatch".into()));
        }
        inner.reasm.extend_from_slice(&frag[HDR..]);
        if inner.reasm.len() > crate::fabric::verbs::max_msg_bytes() + HDR {
            return Err(Error::Protocol("control message larger than the maximum".into()));
        }
        if more {
            return Ok(());
        }
        let msg = std::mem::take(&mut inner.reasm);
        match (kind, self.role, inner.phase) {
            (MSG_USER, _, Phase::Ready) => acts.push(Action::Message(msg)),
            (MSG_HELLO, Role::Passive, Phase::Handshake) => {
                // One hello per connection: a second would be accepted
                // again (the node would register the link twice and hear
                // of its end twice).
                if std::mem::replace(&mut inner.hello_taken, true) {
                    return Err(Error::Protocol("a second hello on one connection".into()));
                }
                acts.push(Action::Accept(msg))
            }
            (MSG_HELLO_OK, Role::Active, Phase::Handshake) => {
                let (Some(addr), Some(rkey)) = (
                    msg.get(..8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes),
                    msg.get(8..HELLO_OK_KEYS).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes),
                ) else {
                    return Err(Error::Protocol(format!("hello answer of {} bytes is too short for the arena's keys", msg.len())));
                };
                let Some(remote) = inner.remote.as_mut() else {
                    return Err(Error::Protocol("hello answer before the connection was established".into()));
                };
                remote.arena_addr = addr;
                remote.arena_rkey = rkey;
                inner.peer_hello = msg[HELLO_OK_KEYS..].to_vec();
                inner.phase = Phase::Ready;
                inner.result = Some(Ok(()));
                self.cv.notify_all();
            }
            (MSG_HELLO_ERR, Role::Active, Phase::Handshake) => {
                let e = decode_refusal(&msg);
                inner.result = Some(Err(e.clone()));
                self.cv.notify_all();
                acts.push(Action::Kill(e));
            }
            (k, r, p) => {
                return Err(Error::Protocol(format!("unexpected control message {k} for {r:?} side in {p:?}")));
            }
        }
        Ok(())
    }

    /// Tear down: destroy QP and id, fail everything pending. Returns the
    /// callbacks owed (done(Err) for each op, then on_disconnect).
    pub fn kill(&self, why: &Error) -> Vec<Action> {
        let mut inner = self.inner.lock();
        if inner.phase == Phase::Dead {
            return Vec::new();
        }
        inner.phase = Phase::Dead;
        // Windows first: a bound window holds its QP and region (see `mw`).
        for mw in std::mem::take(&mut inner.mws) {
            mw.kill();
        }
        inner.binds.clear();
        if let Some(cm) = inner.cm.take() {
            cm.disconnect();
            // Destroys the QP: the NIC no longer touches any buffer below.
            drop(cm);
        }
        inner.qp = std::ptr::null_mut();
        inner.slab = None;
        inner.arena = None;
        if let (Some(dev), Some(cq)) = (inner.dev.take(), inner.send_cq.take()) {
            dev.release_send_cq(&cq, inner.cqe_reserved);
        }
        inner.queue.clear();
        let mut acts = Vec::new();
        for s in inner.ops.iter_mut() {
            match s.op.take() {
                Some(Op::Write(w)) => {
                    acts.push(Action::WriteDone(Finished { regs: w.regs, op: w.op, res: Err(why.clone()) }));
                }
                None => {}
            }
        }
        if inner.result.is_none() {
            inner.result = Some(Err(why.clone()));
        }
        self.cv.notify_all();
        if std::mem::take(&mut inner.owes_disconnect) {
            acts.push(Action::Disconnect(why.clone()));
        }
        acts
    }
}

fn take_op(inner: &mut Inner, idx: u32, gen: u32) -> Option<Op> {
    let s = inner.ops.get_mut(idx as usize)?;
    if s.gen != gen {
        return None;
    }
    let op = s.op.take()?;
    inner.free_ops.push(idx);
    Some(op)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::encode_refusal;

    /// Review finding: a sender's second hello, while the connection was
    /// still in the handshake, was accepted again (the node registered the
    /// link twice and heard of its end twice). One hello is taken; a
    /// second is a protocol error that closes the connection.
    #[test]
    fn a_second_hello_on_one_connection_is_a_protocol_error() {
        let ev = crate::fabric::conformance::Recorder::new(b"", None);
        let sizing = super::super::Sizing { slot: 4096, n_recv: 1, n_send: 1, n_small: 0, chunk: 4096, n_chunks: 0, sq_depth: 1, register_threshold: 1 << 20 };
        let c = Conn::new(1, Role::Passive, ev, 0, sizing);
        let mut inner = c.inner.lock();
        inner.phase = Phase::Handshake;
        let mut frag = vec![MSG_HELLO, 0, 0, 0];
        frag.extend_from_slice(&5u32.to_le_bytes());
        frag.extend_from_slice(b"hello");
        // SAFETY: ibv_wc is plain old data.
        let mut wc: ibv_wc = unsafe { std::mem::zeroed() };
        wc.opcode = ibv_wc_opcode::IBV_WC_RECV;
        wc.byte_len = frag.len() as u32;
        let mut acts = Vec::new();
        c.on_recv(&mut inner, &wc, &frag, &mut acts).unwrap();
        assert!(matches!(acts[..], [Action::Accept(_)]), "the first hello is taken");
        let r = c.on_recv(&mut inner, &wc, &frag, &mut acts);
        assert!(matches!(r, Err(Error::Protocol(_))), "a second hello was taken: {} actions", acts.len());
    }

    #[test]
    fn refusal_keeps_kind_and_message() {
        for e in [Error::InvalidArgument("a".into()), Error::NotViable("b".into()), Error::Aborted("c".into())] {
            assert_eq!(decode_refusal(&encode_refusal(&e)), e);
        }
        assert!(matches!(decode_refusal(&[]), Error::Protocol(_)));
    }
}
