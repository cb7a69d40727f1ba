//! A received tensor handed to the application: its bytes in place in the
//! arena (or in a buffer, for a streamed tensor); dropping it gives the slot
//! back to the sender.
//!
//! A lease in place holds an `Arc` of the arena, so the mapping outlives
//! the node: a tensor TensorFlow still holds after `rdev_context_free`
//! reads valid (if no longer refreshed) memory, never an unmapped page.

use std::sync::{Arc, Weak};

use super::exec::Io;
use super::Inner;
use crate::fabric::Arena;
use crate::rendezvous::{Data, TensorMeta};

/// A received tensor. Its bytes stay valid (and its slot stays with us)
/// until it is dropped; dropping it hands the slot back to the sender.
pub struct Lease {
    node: Weak<Inner>,
    /// Keeps the mapping `ptr` points into alive (in-place leases only).
    _arena: Option<Arc<Arena>>,
    meta: TensorMeta,
    data: Data,
    ptr: *const u8,
    len: usize,
    /// Where the slot's credit is sent from when the lease drops.
    credit: Io,
}

// SAFETY: `ptr` points into the arena (its mapping kept alive by `_arena`,
// its slot kept ours by the slot ownership protocol until release) or into
// `data`'s own Vec.
unsafe impl Send for Lease {}
// SAFETY: as above; the bytes are only read.
unsafe impl Sync for Lease {}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lease({:?}, {} bytes, in place: {})", self.meta, self.len, self.in_place())
    }
}

impl Lease {
    pub(super) fn new(node: Weak<Inner>, arena: Option<Arc<Arena>>, meta: TensorMeta, data: Data, ptr: *const u8, len: usize) -> Lease {
        Lease { node, _arena: arena, meta, data, ptr, len, credit: Io::Posted }
    }

    /// The thread that drops this lease may send the slot's credit itself
    /// (one non-blocking send on shm) instead of posting it to the
    /// transport's send thread: one thread wake-up fewer per tensor. For
    /// leases an application thread holds (the endpoint API's), never for
    /// TensorFlow's, whose threads do no I/O.
    pub fn credit_from_releasing_thread(&mut self) {
        self.credit = Io::Here;
    }

    pub fn meta(&self) -> &TensorMeta {
        &self.meta
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the bytes sit in the arena (zero-copy) rather than a buffer.
    pub fn in_place(&self) -> bool {
        matches!(self.data, Data::Slot { .. })
    }

    pub fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: ptr/len describe memory kept valid until this lease drops.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let (Data::Slot { link, slot, gen, len, .. }, Some(n)) = (&self.data, self.node.upgrade()) {
            let t = crate::trace::start();
            let acts = n.locked(|r| r.release(*link, *slot, *gen));
            // By default the credit is posted: no I/O on the releasing
            // (TensorFlow's) thread.
            n.exec_via(acts, self.credit);
            crate::trace::end("release", t, 0, *len, None);
        }
    }
}

