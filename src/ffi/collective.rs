//! Counters the shim feeds for collectives (MultiWorkerMirroredStrategy's
//! all-reduce, broadcast, gather). The chunks themselves travel through
//! `rdev_send`/`rdev_recv` like any tensor; this only tells the counters
//! which of them were collective, so that `stats()` shows them apart from
//! send/recv.

use std::ffi::c_char;

use super::boundary;
use crate::error::Error;
use crate::stats::Stats;
use super::status::rdev_status;

/// What happened to one collective chunk. Values never change.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum rdev_collective_event {
    /// Received over this transport (`collective_tensors`/`_bytes`).
    RDEV_COLLECTIVE_RECEIVED = 0,
    /// Written to a peer over this transport (`collective_sent_*`).
    RDEV_COLLECTIVE_SENT = 1,
    /// Received over stock gRPC (`collective_fallback_*`, and
    /// `fallback_tensors` with `reason`).
    RDEV_COLLECTIVE_FALLBACK = 2,
}

/// Count one collective chunk of `bytes`; `event` is an
/// `rdev_collective_event` (anything else: RDEV_INVALID_ARGUMENT);
/// `reason`: why it fell back, for RDEV_COLLECTIVE_FALLBACK (may be empty
/// otherwise).
#[no_mangle]
pub unsafe extern "C" fn rdev_record_collective(
    event: u32,
    bytes: u64,
    reason: *const c_char,
    reason_len: usize,
) -> rdev_status {
    boundary(|| {
        let r = text!(reason, reason_len, "reason");
        // A u32, not the enum: C may pass any value, and an out-of-range
        // Rust enum is undefined behaviour.
        use rdev_collective_event::*;
        let (received, over) = match event {
            e if e == RDEV_COLLECTIVE_RECEIVED as u32 => (true, true),
            e if e == RDEV_COLLECTIVE_SENT as u32 => (false, true),
            e if e == RDEV_COLLECTIVE_FALLBACK as u32 => (true, false),
            e => return Err(Error::InvalidArgument(format!("unknown collective event {e}"))),
        };
        Stats::global().record_collective(received, over, bytes, r);
        Ok(())
    })
}
