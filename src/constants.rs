//! Tuning constants, each with the reason for its value. Anything a user
//! may want to change is in `config.rs` instead.

/// Largest control message a backend must carry. Control traffic is small
/// (publications, credits, announcements); bulk data never goes this way
/// except the last-resort message stream (`STREAM_MSG_BYTES`). 64 KiB fits
/// comfortably in a few pre-posted verbs receive buffers.
pub const MAX_MSG_BYTES: usize = 64 * 1024;

/// Bytes reserved at the start of each receive slot for the tensor header
/// (written by the sender in the same one-sided write as the payload).
/// A multiple of 64 so the payload that follows keeps TensorFlow's
/// 64-byte alignment (EIGEN_MAX_ALIGN_BYTES) when the slot is page-aligned.
pub const HEADER_BYTES: usize = 256;

/// Most dimensions a header can describe: (256 - 64 fixed bytes) / 8.
/// Tensors of higher rank take the streamed path (their shape travels in
/// `Msg::StreamBegin`, which has no such limit).
pub const MAX_DIMS: usize = 24;

/// Slots start on page boundaries: simplest way to guarantee alignment
/// and to let a future backend register or prefetch slot pages.
pub const SLOT_ALIGN: usize = 4096;

/// Entries in each shm doorbell ring (per sender → receiver connection).
/// Must exceed the largest number of writes a sender can have in flight to
/// one receiver (bounded by `max_outstanding_writes`, at most 4096).
pub const RING_ENTRIES: usize = 8192;

/// Streamed tensors (bigger than a slot the receiver can place, rank >
/// MAX_DIMS, or an edge that cannot grow) are cut into chunks of at most
/// this many bytes, each one one-sided write into one of a few per-link
/// "stream slots" of this capacity (see `rendezvous::stream`). 16 MiB: a
/// write that size takes ~2-4 ms on shm and ~1.3 ms at 100 Gb/s, so the
/// per-chunk round trip (write, immediate, copy-out, credit: tens of µs) is
/// a few percent; far below verbs' MAX_WR_BYTES (1 GiB), so a chunk is one
/// work request; and a link's working set (STREAM_SLOTS chunks) stays small.
pub const STREAM_CHUNK_BYTES: u64 = 16 << 20;

/// Stream slots placed per link (on its first streamed tensor, kept for the
/// link's life). Two would keep one slot filling while the other drains;
/// four keep the sender writing while the receiver copies out and while
/// credits are in flight, at a working set of 4 chunks per link.
pub const STREAM_SLOTS: usize = 4;

/// A link's stream slots take at most 1/STREAM_ARENA_FRACTION of the arena
/// (so with the 1 GiB default they are the full 16 MiB; a 64 MiB arena gets
/// 2 MiB chunks). Several sender links may stream at once; what remains
/// serves ordinary edges.
pub const STREAM_ARENA_FRACTION: u64 = 8;

/// Smallest useful stream slot: below this (a tiny or full arena) the
/// stream goes through control messages instead.
pub const STREAM_MIN_CHUNK: u64 = 64 << 10;

/// Last resort, when not even stream slots can be placed: the stream's
/// chunks travel as `Msg::StreamData` of at most this many bytes, leaving
/// room for the message's own framing within MAX_MSG_BYTES.
pub const STREAM_MSG_BYTES: usize = MAX_MSG_BYTES - 1024;

/// Such messages a sender keeps unacknowledged per stream (the receiver acks
/// each once copied): 1 MiB in flight, a bounded working set and far below
/// the verbs backend's queue limit (MAX_QUEUED_WORK).
pub const STREAM_MSG_WINDOW: u32 = 16;

/// Bytes of streamed tensors a receiver accepts open at once, from all its
/// peers together (it allocates each whole tensor once its stream begins);
/// a stream past it is refused with an error.
pub const MAX_STREAM_TOTAL: u64 = 1 << 36;

/// Steps remembered as finished, so late pushes for them are dropped
/// instead of waiting forever. TF keeps few steps in flight; 4096 covers
/// any realistic pipelining with margin at ~100 KB of memory.
pub const FINISHED_STEPS_REMEMBERED: usize = 4096;

/// How long a step with no object left on this task stays open before it
/// ends on its own (`node::idle`): TensorFlow may make a new rendezvous for
/// the same step meanwhile (an eager function's second component on this
/// task). Steps TensorFlow cleans up end at once.
pub const IDLE_STEP_LINGER_MS: u64 = 5000;

/// At most this many steps are idle at once (`node::idle`); past it the
/// oldest ends at once.
pub const IDLE_STEPS_MAX: usize = 4096;

/// Magic at the start of every slot header and handshake ("RDEV").
pub const MAGIC: u32 = 0x5244_4556;

/// Wire protocol version: both handshakes carry it; a mismatch is refused
/// with a clear error instead of misparsing. 3: streamed tensors (chunk
/// headers, `Stream*` messages) replace the `Inline` messages (a tensor
/// cut into chunks carried by control messages). 4: each published slot
/// carries the key its sender writes it with. 5: `Ping`.
/// 6: `Call`, `Reply`, `CallCancel` (worker RPCs over the transport).
/// 8: `Call` and `Reply` parts carry their index. 9: the receiver opens
/// each connection with a nonce that the token proof covers. 10: `Abort`
/// carries the TensorFlow code of the failure that caused it.
pub const PROTOCOL_VERSION: u32 = 10;

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
/// sender streams the tensor instead of waiting for a credit that may
/// never come.
pub const MAX_SLOTS_PER_EDGE: usize = 64;

/// Refused or abandoned tensors (streams) whose receives have not been
/// made yet, kept so that the receive fails when it comes: past this many
/// in the node, the link that adds one more fails instead.
pub const MAX_FAILED_AHEAD: usize = 4096;

/// Edges (distinct keys) one sender may have placed at a receiver, and
/// all senders together: each holds an interned name and its slots' state,
/// so a peer announcing ever new keys cannot grow them without bound (a
/// TensorFlow graph has some thousands of edges per pair of tasks). Past
/// either, the Announce fails its link with the reason.
pub const MAX_EDGES_PER_LINK: usize = 1 << 16;
pub const MAX_EDGES_PER_NODE: usize = 1 << 20;

/// Of those, most one link may leave: a quarter, so that at least four
/// peers' refusals fit before the node's cap is reached.
pub const MAX_FAILED_AHEAD_PER_LINK: usize = MAX_FAILED_AHEAD / 4;

/// Streamed tensors (assembled in memory of ours) that arrived before
/// their receives were made, kept until the receive or the step's end: at
/// most this many in the node and a quarter of it from one link (their
/// bytes also count against `MAX_STREAM_TOTAL`); the link that would pass
/// either fails. Without it a peer could send streams, empty ones
/// included, for steps that never run here, without bound.
pub const MAX_STREAMED_AHEAD: usize = 4096;
pub const MAX_STREAMED_AHEAD_PER_LINK: usize = MAX_STREAMED_AHEAD / 4;

/// Live incoming links one task (by the name its hello gives, all its
/// lives together) may hold at once, and all tasks together. The per-link caps above are a quarter of
/// the node's: without this a sender could open four links and take a
/// node-wide budget alone. Two, not one: a reconnecting or restarted task
/// may connect again before its old link's loss is seen. One more is
/// refused in the handshake, naming the cap.
pub const MAX_RX_LINKS_PER_PEER: usize = 2;
pub const MAX_RX_LINKS: usize = 1 << 14;

/// Placements one peer may ask us to make on its behalf (`PlaceFor`) that
/// are queued or running at once, and all peers together; one more is
/// answered at once with an error naming the cap (the peer's placement
/// fails; the edge is placed on first use instead). A graph asks for at
/// most one per edge between two tasks, and they are answered as they go.
pub const MAX_PLACEMENTS_PER_LINK: usize = 1024;
pub const MAX_PLACEMENTS_PER_NODE: usize = 4 * MAX_PLACEMENTS_PER_LINK;

/// How long a control message's send may wait for its peer to drain the
/// connection's socket (shm: a stopped or swapped-out peer reads nothing);
/// then the send fails and so does the link, instead of wedging the
/// sending thread (a progress thread, the keepalive thread, TF's) forever.
pub const CONTROL_SEND_TIMEOUT_MS: u64 = 10_000;

/// How often a link with work waiting on its peer is probed (`Msg::Ping`;
/// see `node::keepalive`): a vanished host is noticed within this plus the
/// transport's own bound (verbs: ACK timeout × retries).
pub const KEEPALIVE_INTERVAL_MS: u64 = 1000;

/// Tensor writes of at least this many bytes are posted to the node's
/// write engine (`rdev-write-N`) instead of running on the caller's
/// (TensorFlow's) thread. Below it a copy (~2 µs at 64 KiB in cache) costs
/// less than waking another thread (tens of µs on a busy 2-core machine,
/// measured with `bench trace`).
pub const WRITE_ENGINE_MIN: usize = 64 << 10;
/// Threads of a node's write engine: two, so one slow write (a receiver
/// whose ring stays full) does not hold up every other.
pub const WRITE_ENGINE_THREADS: usize = 2;
/// Jobs the write engine's queue has room for before it first grows (more
/// than the writes in flight per receiver, `RDMA_DEVICE_MAX_OUTSTANDING_WRITES`).
pub const ENGINE_QUEUE: usize = 256;
