//! Memory windows: what isolates verbs senders from each other.
//!
//! The arena is registered per device in chunk-aligned extents as slots
//! are placed (`mr::arena`). On a device with type-2 memory windows those
//! regions get `LOCAL_WRITE | MW_BIND` and **no remote access**: their
//! rkeys let no peer write anything. Each range granted to a sender
//! (`Listener::grant`) gets a fresh type-2 window bound over exactly that
//! range with `REMOTE_WRITE` only, by a `BIND_MW` work request posted on
//! the receiver's QP of that sender's connection. A type-2 window is bound
//! to one QP: only the peer of that QP can use its rkey (IBTA spec,
//! "Type 2 Memory Windows": the R_Key is validated against the QP it was
//! bound on), so a sender reaches only the ranges granted to it, whatever
//! rkeys it guesses.
//!
//! **Soft-RoCE (rxe) enforces less** (measured in the VM, Debian 6.1, and
//! still so in later rxe sources): its responder checks a window rkey's
//! QP, state and access, but checks the write's range against the
//! *region's* bounds, not the window's (`rxe_resp.c` `check_rkey`:
//! `mr_check_range(mw->mr, va + offset, resid)`). On rxe a sender can thus
//! write anywhere in the arena region with the key of a window bound to
//! its own QP; another sender's key, a revoked key and the region's own
//! key still fail. A NIC that follows the spec's window bounds isolates
//! fully. Closing that on rxe would take a region per granted range under
//! each window (one `ibv_reg_mr` per grant, which may run on the progress
//! thread, where registration is not allowed): not done.
//!
//! Addressing: windows are bound at the arena's virtual addresses (no
//! `ZERO_BASED`), so a sender writes at `arena_addr + offset` as before,
//! with the slot's key instead of the region's.
//!
//! Ordering, without waiting: the bind goes into the connection's ordered
//! work queue (`conn`), so it is posted before the Publish or Grow that
//! carries its rkey (the node sends that only after `grant` returned). A
//! bind whose arena extent is still being registered (a grant made on the
//! progress thread, see `mr::arena`) stays at the head of that queue, with
//! everything behind it, until the registration is done. A
//! send queue executes its work requests in order and a bind is a local
//! operation completed before the next request is processed (rxe:
//! `rxe_requester` runs `rxe_do_local_ops` when the bind reaches the head,
//! before it builds any packet of a later WQE), so by the time the sender
//! can know the key the window is valid. Nobody waits for the bind's
//! completion: `grant` runs under the node's protocol lock on any thread,
//! the progress thread included, and returns at once.
//!
//! Revocation: granting a range again (to anyone) first deallocates every
//! window over it (`ibv_dealloc_mw`, a synchronous verb: no new access
//! through its rkey once it returns; a write message whose first packet was
//! already accepted may finish, as rxe checks the rkey on a message's
//! first packet). A window whose bind was posted but has not completed is
//! deallocated when its completion comes instead (deallocating it earlier
//! would fail that bind and break an honest sender's QP); the protocol
//! never frees a range in that state (a range is freed only after its
//! sender saw the Publish, which follows the bind, or after its link died).
//! A window whose bind is still queued is never posted. A connection's
//! windows are deallocated before its QP is destroyed (rxe holds a
//! reference from a bound window to its QP and from windows to the region,
//! which cannot be deregistered while windows use it).
//!
//! Without type-2 windows (the device lacks `IBV_DEVICE_MEM_WINDOW_TYPE_2A/
//! 2B`, or `VerbsOptions::memory_windows` is off) the region keeps
//! `REMOTE_WRITE` and every grant answers its rkey: verbs senders share it
//! and are not isolated from each other (logged once per device, counted
//! in `verbs_shared_grants`).

use std::sync::Arc;

use parking_lot::Mutex;
use rdma_sys::*;

use super::device::Pd;
use super::mr::arena::Extent;
use crate::error::{Error, Result};

/// Where a window is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Allocated; its bind waits in the connection's queue.
    Queued,
    /// The bind is posted; its completion has not come.
    Posted,
    /// The bind completed: the window grants its range.
    Bound,
    /// Deallocated (or never to be posted): grants nothing.
    Dead,
}

struct Raw {
    mw: *mut ibv_mw,
    state: State,
    /// Revoked while `Posted`: deallocate at the bind's completion.
    revoke_at_completion: bool,
}

/// One type-2 memory window over one granted range.
pub(crate) struct Mw {
    raw: Mutex<Raw>,
    /// The rkey the bind gives it (what the sender writes with).
    pub rkey: u32,
    /// Bound over `addr..addr+len` of `ext`'s region (registered before
    /// the bind is posted: the connection's queue waits for it).
    pub addr: u64,
    pub len: u64,
    pub ext: Arc<Extent>,
    _pd: Arc<Pd>,
}

// SAFETY: the raw handle is used only under `raw`'s lock.
unsafe impl Send for Mw {}
// SAFETY: as above.
unsafe impl Sync for Mw {}

/// `ibv_inc_rkey`: a new key byte for each bind (C inline in verbs.h;
/// rdma-sys's version overflows on 0xffffffff in debug builds).
fn inc_rkey(rkey: u32) -> u32 {
    (rkey & !0xff) | (rkey.wrapping_add(1) & 0xff)
}

impl Mw {
    /// A fresh type-2 window for `addr..addr+len` of `ext` (not bound yet;
    /// the extent may still be registering).
    pub fn alloc(pd: &Arc<Pd>, ext: &Arc<Extent>, addr: u64, len: u64) -> Result<Arc<Mw>> {
        // SAFETY: pd is live; the provider fills errno on failure.
        let raw = unsafe { ibv_alloc_mw(pd.raw, ibv_mw_type::IBV_MW_TYPE_2) };
        let mw = match raw {
            Some(p) if !p.is_null() => p,
            _ => {
                let err = std::io::Error::last_os_error();
                return Err(Error::ResourceExhausted(format!(
                    "ibv_alloc_mw(type 2) on {}: {err} (device limit max_mw {})",
                    pd.ctx.info.name, pd.ctx.info.max_mw
                )));
            }
        };
        // SAFETY: mw was just returned and is valid.
        let rkey = inc_rkey(unsafe { (*mw).rkey });
        Ok(Arc::new(Mw {
            raw: Mutex::new(Raw { mw, state: State::Queued, revoke_at_completion: false }),
            rkey,
            addr,
            len,
            ext: ext.clone(),
            _pd: pd.clone(),
        }))
    }

    /// Fill `wr` with this window's bind and mark it posted; `false` (post
    /// nothing) if it was revoked while queued. Called under the
    /// connection's lock, right before `ibv_post_send`; `post` does that
    /// post (under this window's lock, so revocation waits for it).
    pub fn post_bind(&self, post: impl FnOnce(bind_mw_t) -> Result<()>) -> Result<bool> {
        let mut r = self.raw.lock();
        if r.state != State::Queued || r.mw.is_null() {
            return Ok(false);
        }
        let mr = self.ext.mr().ok_or_else(|| Error::Internal("window bind before its region is registered".into()))?;
        let bind = bind_mw_t {
            mw: r.mw,
            rkey: self.rkey,
            bind_info: ibv_mw_bind_info {
                mr: mr.raw(),
                addr: self.addr,
                length: self.len,
                mw_access_flags: ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
            },
        };
        post(bind)?;
        r.state = State::Posted;
        Ok(true)
    }

    /// The bind completed (`ok`) or failed.
    pub fn bind_done(&self, ok: bool) {
        let mut r = self.raw.lock();
        if r.state == State::Posted {
            r.state = if ok { State::Bound } else { State::Dead };
        }
        if r.revoke_at_completion || !ok {
            dealloc(&mut r);
        }
    }

    /// Take this window's access away now (or, while its bind is in
    /// flight, at its completion: see the module docs).
    pub fn revoke(&self) {
        let mut r = self.raw.lock();
        match r.state {
            State::Posted => r.revoke_at_completion = true,
            _ => dealloc(&mut r),
        }
    }

    /// Deallocate now, whatever the state (the QP is about to go).
    pub fn kill(&self) {
        dealloc(&mut self.raw.lock());
    }

    pub fn is_dead(&self) -> bool {
        self.raw.lock().state == State::Dead
    }
}

fn dealloc(r: &mut Raw) {
    r.state = State::Dead;
    if r.mw.is_null() {
        return;
    }
    // SAFETY: mw came from ibv_alloc_mw and is deallocated once (nulled).
    let rc = unsafe { ibv_dealloc_mw(r.mw) };
    if rc != 0 {
        log::warn!("verbs: ibv_dealloc_mw failed ({rc})");
    }
    r.mw = std::ptr::null_mut();
}

impl Drop for Mw {
    fn drop(&mut self) {
        dealloc(self.raw.get_mut());
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn inc_rkey_changes_only_the_key_byte() {
        assert_eq!(super::inc_rkey(0x1234_56ff), 0x1234_5600);
        assert_eq!(super::inc_rkey(0xffff_ffff), 0xffff_ff00);
        assert_eq!(super::inc_rkey(0x0000_0107), 0x0000_0108);
    }
}
