//! The verbs backend's worker threads, each one per process, FIFO, fed by
//! an unbounded queue (handing over never blocks), each job inside
//! `catch_unwind`: each a [`ProcessPool`] (crate::pool) of one thread.
//! They take work that the progress thread (which must never block) and
//! the node's protocol lock (held while granting) must not do themselves:
//! - `rdev-verbs-setup` ([`spawn`]): work that pins memory or may
//!   otherwise take long: a connection's bring-up on either side (opening
//!   the device, which registers its shared receive buffers; the
//!   connection's own buffers; without memory windows, the whole arena),
//!   registering a chunk of an arena on the first grant in it, and a
//!   sender's hello (`on_accept`, which may wait for its node to finish
//!   starting).
//! - `rdev-verbs-copy` ([`copy`]): staged writes' copies into a
//!   connection's staging chunks when a completion frees a chunk on the
//!   progress thread (see `conn::post`); apart from setup, so a copy never
//!   waits behind a registration.

use crate::pool::ProcessPool;

static SETUP: ProcessPool = ProcessPool::new("rdev-verbs-setup", 1);
static COPY: ProcessPool = ProcessPool::new("rdev-verbs-copy", 1);

/// Run `job` on the setup thread (here, logged, if it cannot start).
pub(crate) fn spawn(job: impl FnOnce() + Send + 'static) {
    SETUP.schedule(job);
}

/// Run `job` on the copy thread (here, logged, if it cannot start).
pub(crate) fn copy(job: impl FnOnce() + Send + 'static) {
    COPY.schedule(job);
}
