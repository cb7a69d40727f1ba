//! Receives a thread waits for, without a callback: `rdev_recv_waitable`
//! posts the receive and returns a handle; `rdev_wait` blocks the calling
//! thread, with a deadline, until the tensor (or the receive's error) is
//! in. For callers whose completions would otherwise cost a hop to another
//! thread: the Python endpoint API (a callback into Python needs the GIL
//! on the library's callback thread and then wakes the waiting thread).
//!
//! The outcome only wakes the waiter, so the transport's event thread that
//! finished the receive hands it over itself (`Complete::runs_anywhere`):
//! one thread wake-up from the arrival to the waiting thread, instead of
//! the event thread waking `rdev-callbacks` which wakes the caller.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::{boundary, rdev_buffer, rdev_context, status, BUFFERS};
use crate::completion::Complete;
use crate::error::Error;
use crate::node::{Lease, Poller};
use status::rdev_status;

/// A posted receive's outcome, once in.
#[derive(Default)]
struct Cell {
    /// `Some` from completion until a wait takes it; `taken` after that.
    outcome: Mutex<Slot>,
    ready: Condvar,
    /// Set once the outcome is in (read without the lock while polling).
    done: AtomicBool,
}

#[derive(Default)]
enum Slot {
    #[default]
    Pending,
    In(Result<Lease, Error>),
    Taken,
}

/// A posted receive (`rdev_recv_waitable`); free it with
/// `rdev_waiter_free`, whether or not its outcome was taken.
pub struct rdev_waiter {
    cell: Arc<Cell>,
    /// The waiting thread delivers the writes that land while it polls
    /// (see `node::poll`), before it parks.
    poller: Poller,
}

struct WaitDone(Arc<Cell>);

impl Complete<Result<Lease, Error>> for WaitDone {
    fn complete(self: Box<Self>, r: Result<Lease, Error>) {
        *self.0.outcome.lock() = Slot::In(r);
        self.0.done.store(true, Ordering::Release);
        self.0.ready.notify_all();
    }

    fn runs_anywhere(&self) -> bool {
        true
    }
}

/// Receive the tensor `(key, step_id)` from `peer`, as `rdev_recv` does,
/// but with no callback: `*out` is a handle to wait on with `rdev_wait`
/// and to free with `rdev_waiter_free`. Never blocks.
#[no_mangle]
pub unsafe extern "C" fn rdev_recv_waitable(
    ctx: *const rdev_context,
    peer: *const std::ffi::c_char,
    peer_len: usize,
    key: *const std::ffi::c_char,
    key_len: usize,
    step_id: u64,
    out: *mut *mut rdev_waiter,
) -> rdev_status {
    boundary(|| {
        let c = ctx!(ctx);
        let peer = text!(peer, peer_len, "peer");
        let key = text!(key, key_len, "key");
        let out = out!(out);
        let cell = Arc::new(Cell::default());
        c.node.recv(peer, key, step_id, Box::new(WaitDone(cell.clone())));
        // The handle is the caller's now.
        out.write(Box::into_raw(Box::new(rdev_waiter { cell, poller: c.node.poller() })));
        Ok(())
    })
}

/// Wait at most `timeout_ms` for the receive of `w`. RDEV_OK: `*out` is
/// the received buffer (the caller's; release it with
/// `rdev_buffer_release`). RDEV_TIMEOUT: not in yet; the receive stays
/// posted and `w` may be waited on again. Any other status: the receive's
/// error, with its message in `rdev_last_error`. An outcome is taken
/// once: a later wait on the same handle fails with RDEV_INVALID_ARGUMENT.
/// Blocks the calling thread only (never call it from a callback).
#[no_mangle]
pub unsafe extern "C" fn rdev_wait(w: *const rdev_waiter, timeout_ms: u64, out: *mut *mut rdev_buffer) -> rdev_status {
    boundary(|| {
        let w = handle!(w, "waiter");
        let out = out!(out);
        // Capped so the deadline's arithmetic cannot overflow.
        let limit = Duration::from_millis(timeout_ms.min(u64::MAX / 4));
        let start = Instant::now();
        let mut waited = false;
        if !w.cell.done.load(Ordering::Acquire) {
            // Poll first: a write landing meanwhile wakes no thread.
            waited = true;
            w.poller.spin_until(|| w.cell.done.load(Ordering::Acquire));
        }
        let mut slot = w.cell.outcome.lock();
        if matches!(*slot, Slot::Pending) {
            let left = limit.saturating_sub(start.elapsed());
            let _ = w.cell.ready.wait_while_for(&mut slot, |s| matches!(s, Slot::Pending), left);
        }
        if waited && !matches!(*slot, Slot::Pending) {
            w.poller.waited(start);
        }
        match std::mem::replace(&mut *slot, Slot::Taken) {
            Slot::Pending => {
                *slot = Slot::Pending;
                Err(Error::Timeout(format!("the receive is not in after {timeout_ms} ms")))
            }
            Slot::Taken => Err(Error::InvalidArgument("this receive's outcome was taken already".into())),
            Slot::In(Err(e)) => Err(e),
            Slot::In(Ok(mut lease)) => {
                // Released by an application thread (the endpoint API's):
                // it sends the credit itself.
                lease.credit_from_releasing_thread();
                // The buffer is the caller's now.
                out.write(Box::into_raw(BUFFERS.boxed(rdev_buffer { lease: Some(lease) })));
                Ok(())
            }
        }
    })
}

/// Free a handle from `rdev_recv_waitable`. A receive still pending goes
/// on; its tensor, when it comes, is released at once. NULL: nothing.
#[no_mangle]
pub unsafe extern "C" fn rdev_waiter_free(w: *mut rdev_waiter) {
    if !w.is_null() {
        // SAFETY: a handle from rdev_recv_waitable, freed once per contract.
        drop(unsafe { Box::from_raw(w) });
    }
}
