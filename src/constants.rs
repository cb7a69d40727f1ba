//! Tuning constants, each with the reason for its value. Anything a user
//! may want to change is in `config.rs` instead.

/// Largest control message a backend must carry. Control traffic is small
/// (publications, credits, announcements); bulk data never goes this way
/// except the chunked inline fallback, which splits to this size. 64 KiB
/// fits comfortably in a few pre-posted verbs receive buffers.
pub const MAX_MSG_BYTES: usize = 64 * 1024;

/// Bytes reserved at the start of each receive slot for the tensor header
/// (written by the sender in the same one-sided write as the payload).
/// A multiple of 64 so the payload that follows keeps TensorFlow's
/// 64-byte alignment (EIGEN_MAX_ALIGN_BYTES) when the slot is page-aligned.
pub const HEADER_BYTES: usize = 256;

/// Most dimensions a header can describe: (256 - 64 fixed bytes) / 8.
/// Tensors of higher rank take the inline path.
pub const MAX_DIMS: usize = 24;

/// Slots start on page boundaries: simplest way to guarantee alignment
/// and to let a future backend register or prefetch slot pages.
pub const SLOT_ALIGN: usize = 4096;

/// Entries in each shm doorbell ring (per sender → receiver connection).
/// Must exceed the largest number of writes a sender can have in flight to
/// one receiver (bounded by `max_outstanding_writes`, at most 4096).
pub const RING_ENTRIES: usize = 8192;

/// Inline (fallback) data is sent in chunks of at most this many payload
/// bytes, leaving room for the chunk's own framing within MAX_MSG_BYTES.
pub const INLINE_CHUNK_BYTES: usize = MAX_MSG_BYTES - 1024;

/// Steps remembered as finished, so late pushes for them are dropped
/// instead of waiting forever. TF keeps few steps in flight; 4096 covers
/// any realistic pipelining with margin at ~100 KB of memory.
pub const FINISHED_STEPS_REMEMBERED: usize = 4096;

/// Magic at the start of every slot header and handshake ("RDEV").
pub const MAGIC: u32 = 0x5244_4556;

/// Wire protocol version: both handshakes carry it; a mismatch is refused
/// with a clear error instead of misparsing.
pub const PROTOCOL_VERSION: u32 = 2;

/// Upper bound of the adaptive spin window of a progress thread. While
/// small writes keep arriving, the thread polls for twice the recent gap
/// between them (at least RDMA_DEVICE_SPIN_US) before it sleeps, since a
/// wake-up costs tens of microseconds here. When the gaps exceed this
/// bound (large writes), it sleeps at once: the wake-up is small next to
/// the gap, and polling would only burn a core the application may need.
/// An idle receiver stops polling within this bound of the last write.
pub const MAX_ADAPTIVE_SPIN_US: u64 = 200;

/// Most slots one edge may hold. An edge starts with RDMA_DEVICE_SLOTS_PER_EDGE
/// slots and grows by one whenever all are busy (arrived, or lent to an
/// application that keeps received tensors alive); past this bound the
/// sender takes the inline path instead of waiting for a credit that may
/// never come.
pub const MAX_SLOTS_PER_EDGE: usize = 64;
