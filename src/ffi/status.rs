//! `rdev_status` and the one mapping from `Error` to it.

use std::ffi::CStr;

use crate::error::Error;

/// Result of every C ABI call. Values are stable and never renumbered.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum rdev_status {
    RDEV_OK = 0,
    RDEV_INVALID_ARGUMENT = 1,
    RDEV_NOT_VIABLE = 2,
    RDEV_PEER_LOST = 3,
    RDEV_ABORTED = 4,
    RDEV_PROTOCOL = 5,
    RDEV_RESOURCE_EXHAUSTED = 6,
    RDEV_IO = 7,
    RDEV_CONFIG = 8,
    RDEV_TIMEOUT = 9,
    RDEV_INTERNAL = 10,
    RDEV_PANIC = 11,
    /// A tensor would go over stock gRPC while RDMA_DEVICE_STRICT is set:
    /// fail, do not fall back (the strict form of RDEV_NOT_VIABLE).
    RDEV_STRICT = 12,
}

pub fn from_error(e: &Error) -> rdev_status {
    match e {
        Error::InvalidArgument(_) => rdev_status::RDEV_INVALID_ARGUMENT,
        Error::NotViable(_) => rdev_status::RDEV_NOT_VIABLE,
        Error::PeerLost(_) => rdev_status::RDEV_PEER_LOST,
        Error::Aborted(_) | Error::PeerFailed(..) => rdev_status::RDEV_ABORTED,
        Error::Protocol(_) => rdev_status::RDEV_PROTOCOL,
        Error::ResourceExhausted(_) => rdev_status::RDEV_RESOURCE_EXHAUSTED,
        Error::Io(_) => rdev_status::RDEV_IO,
        Error::Config(_) => rdev_status::RDEV_CONFIG,
        Error::Timeout(_) => rdev_status::RDEV_TIMEOUT,
        Error::Strict(_) => rdev_status::RDEV_STRICT,
        Error::Internal(_) => rdev_status::RDEV_INTERNAL,
    }
}

pub fn name(s: rdev_status) -> &'static CStr {
    match s {
        rdev_status::RDEV_OK => c"RDEV_OK",
        rdev_status::RDEV_INVALID_ARGUMENT => c"RDEV_INVALID_ARGUMENT",
        rdev_status::RDEV_NOT_VIABLE => c"RDEV_NOT_VIABLE",
        rdev_status::RDEV_PEER_LOST => c"RDEV_PEER_LOST",
        rdev_status::RDEV_ABORTED => c"RDEV_ABORTED",
        rdev_status::RDEV_PROTOCOL => c"RDEV_PROTOCOL",
        rdev_status::RDEV_RESOURCE_EXHAUSTED => c"RDEV_RESOURCE_EXHAUSTED",
        rdev_status::RDEV_IO => c"RDEV_IO",
        rdev_status::RDEV_CONFIG => c"RDEV_CONFIG",
        rdev_status::RDEV_TIMEOUT => c"RDEV_TIMEOUT",
        rdev_status::RDEV_INTERNAL => c"RDEV_INTERNAL",
        rdev_status::RDEV_PANIC => c"RDEV_PANIC",
        rdev_status::RDEV_STRICT => c"RDEV_STRICT",
    }
}
