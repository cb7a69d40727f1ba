//! One error enum for the whole crate. The C ABI maps it to `rdev_status`
//! in exactly one place (`ffi::status`).

use std::fmt;

/// Every failure the core can report. Variants carry a human message; the
/// kind decides the status code a caller (and TensorFlow) sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A caller passed something unusable (bad key, oversized dims, ...).
    InvalidArgument(String),
    /// The transport cannot serve here (no device, wrong host, ...).
    NotViable(String),
    /// The peer died or the connection broke.
    PeerLost(String),
    /// The step (or the whole context) was aborted by the caller.
    Aborted(String),
    /// A peer told us it aborted the step because it failed there, with
    /// this TensorFlow error code (never 0): what waited on that peer for
    /// the step fails with the cause's code, as a pull from it would have.
    /// Reported as `Aborted` at the C ABI, with the code beside it
    /// (`rdev_abort_cause`).
    PeerFailed(u32, String),
    /// The peer sent something malformed or out of protocol.
    Protocol(String),
    /// Out of arena, memlock, outstanding-write budget, ...
    ResourceExhausted(String),
    /// An OS call failed.
    Io(String),
    /// A bad `RDMA_DEVICE_*` value.
    Config(String),
    /// A bounded wait ran out.
    Timeout(String),
    /// A tensor would go over stock gRPC while RDMA_DEVICE_STRICT is set
    /// (the strict-mode form of `NotViable` for tensors: node/routes.rs).
    Strict(String),
    /// A bug: a broken internal invariant.
    Internal(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn message(&self) -> &str {
        match self {
            Error::InvalidArgument(m)
            | Error::NotViable(m)
            | Error::PeerLost(m)
            | Error::Aborted(m)
            | Error::PeerFailed(_, m)
            | Error::Protocol(m)
            | Error::ResourceExhausted(m)
            | Error::Io(m)
            | Error::Config(m)
            | Error::Timeout(m)
            | Error::Strict(m)
            | Error::Internal(m) => m,
        }
    }

    pub fn kind_name(&self) -> &'static str {
        match self {
            Error::InvalidArgument(_) => "invalid argument",
            Error::NotViable(_) => "transport not viable",
            Error::PeerLost(_) => "peer lost",
            Error::Aborted(_) => "aborted",
            Error::PeerFailed(..) => "failed at a peer",
            Error::Protocol(_) => "protocol error",
            Error::ResourceExhausted(_) => "resource exhausted",
            Error::Io(_) => "i/o error",
            Error::Config(_) => "configuration error",
            Error::Timeout(_) => "timeout",
            Error::Strict(_) => "refused in strict mode",
            Error::Internal(_) => "internal error",
        }
    }

    /// The same kind with extra context in front of the message.
    pub fn context(self, what: &str) -> Error {
        let wrap = |m: String| format!("{what}: {m}");
        match self {
            Error::InvalidArgument(m) => Error::InvalidArgument(wrap(m)),
            Error::NotViable(m) => Error::NotViable(wrap(m)),
            Error::PeerLost(m) => Error::PeerLost(wrap(m)),
            Error::Aborted(m) => Error::Aborted(wrap(m)),
            Error::PeerFailed(c, m) => Error::PeerFailed(c, wrap(m)),
            Error::Protocol(m) => Error::Protocol(wrap(m)),
            Error::ResourceExhausted(m) => Error::ResourceExhausted(wrap(m)),
            Error::Io(m) => Error::Io(wrap(m)),
            Error::Config(m) => Error::Config(wrap(m)),
            Error::Timeout(m) => Error::Timeout(wrap(m)),
            Error::Strict(m) => Error::Strict(wrap(m)),
            Error::Internal(m) => Error::Internal(wrap(m)),
        }
    }

    /// `errno` of the last failed libc call, as an `Io` error.
    pub fn last_os(what: &str) -> Error {
        Error::Io(format!("{what}: {}", std::io::Error::last_os_error()))
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind_name(), self.message())
    }
}

impl std::error::Error for Error {}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e.to_string())
    }
}

/// Run `f`, turning a panic into `Err(Error::Internal)` naming `what`.
/// Threads we own run their bodies (and every callback into upper layers)
/// through this, so a bug becomes a failed link, never a dead thread.
pub fn catch_panic<T>(what: &str, f: impl FnOnce() -> T) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".into());
        log::error!("panic in {what}: {msg}");
        Error::Internal(format!("panic in {what}: {msg}"))
    })
}
