//! `RDMA_DEVICE_MODE=rpc` only: the sender's bounce buffers. Before a write,
//! the tensor is copied into one of a few reused buffers (the registered
//! staging memory of an RPC-over-RDMA transport), and the write is made
//! from there; when the write completes the buffer goes back to the pool.
//!
//! The receiver's copy-out (`Inner::copy_out`) runs where the receive
//! completes (a progress thread, or the TensorFlow thread whose Recv found
//! the tensor already there).
//!
//! The sender's copy runs on whichever thread executes the write action (a TensorFlow thread
//! calling Send, or a progress thread answering a request); the pool's lock
//! is held only to take or return a buffer, never while copying.

use std::sync::Arc;

use parking_lot::Mutex;

use super::Inner;
use crate::error::{Error, Result};
use crate::rendezvous::{Data, Payload, Received};

/// Buffers kept for reuse; more are allocated while writes are in flight
/// and dropped when they come back to a full pool.
const POOLED: usize = 8;

#[derive(Default)]
pub(super) struct BouncePool {
    free: Mutex<Vec<Vec<u8>>>,
}

/// A copy of a tensor in a bounce buffer; returns the buffer when dropped.
pub(super) struct Bounce {
    buf: Vec<u8>,
    pool: Arc<BouncePool>,
}

impl Payload for Bounce {
    fn bytes(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        let mut free = self.pool.free.lock();
        if free.len() < POOLED {
            free.push(std::mem::take(&mut self.buf));
        }
    }
}

impl BouncePool {
    /// Copy `src` into a pooled buffer (the smallest that holds it, else a
    /// new one).
    pub(super) fn copy(self: &Arc<Self>, src: &[u8]) -> Result<Bounce> {
        let reused = {
            let mut free = self.free.lock();
            let best = free
                .iter()
                .enumerate()
                .filter(|(_, b)| b.capacity() >= src.len())
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i);
            best.map(|i| free.swap_remove(i))
        };
        let mut buf = reused.unwrap_or_default();
        buf.clear();
        buf.try_reserve_exact(src.len())
            .map_err(|_| Error::Internal(format!("no memory for a bounce buffer of {} bytes", src.len())))?;
        buf.extend_from_slice(src);
        Ok(Bounce { buf, pool: self.clone() })
    }
}

impl Inner {
    /// rpc mode: copy a tensor out of its slot into a fresh buffer and give
    /// the slot back at once (no zero-copy receive). Without memory for the
    /// copy, the tensor stays in its slot.
    pub(super) fn copy_out(&self, r: Received) -> Received {
        let Data::Slot { link, slot, gen, offset, len } = r.data else { return r };
        let src = (offset as usize).checked_add(len as usize).filter(|e| *e <= self.arena.len());
        let mut buf = Vec::new();
        if src.is_none() || buf.try_reserve_exact(len as usize).is_err() {
            return r;
        }
        // SAFETY: the range lies inside the arena (checked above), and the
        // slot is ours (its token is with us) until we release it below.
        let bytes = unsafe { std::slice::from_raw_parts(self.arena.as_ptr().wrapping_add(offset as usize) as *const u8, len as usize) };
        buf.extend_from_slice(bytes);
        let acts = self.locked(|rv| rv.release(link, slot, gen));
        self.exec(acts);
        Received { meta: r.meta, data: Data::Owned(buf) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_and_reuses_buffers() {
        let pool = Arc::new(BouncePool::default());
        let a = pool.copy(&[1, 2, 3]).unwrap();
        assert_eq!(a.bytes(), &[1, 2, 3]);
        let ptr = a.buf.as_ptr();
        drop(a);
        let b = pool.copy(&[9, 8]).unwrap();
        assert_eq!(b.bytes(), &[9, 8]);
        assert_eq!(b.buf.as_ptr(), ptr, "the returned buffer is reused");
    }
}
