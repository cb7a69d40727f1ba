//! The deregistration thread (`rdev-verbs-dereg`): a memory region dropped
//! on a backend's event thread (the progress thread: a write's last
//! reference to an uncached or evicted registration, a connection's
//! buffers at teardown, a chunk of a closed listener's arena) is
//! deregistered here, because `ibv_dereg_mr` unpins every page of the
//! region and can take long for a large one. One thread for the process
//! (a [`ProcessPool`], crate::pool), fed by an unbounded queue (handing
//! over never blocks); the regions stay pinned, and so valid, until then,
//! and no work request uses them any more.

use crate::fabric::verbs::mr::Mr;
use crate::pool::ProcessPool;

static DEREG: ProcessPool = ProcessPool::new("rdev-verbs-dereg", 1);

/// Deregister `mr` on the deregistration thread (here, on the caller's
/// thread, if it cannot start).
pub(crate) fn later(mr: Mr) {
    DEREG.schedule(move || mr.release_here());
}
