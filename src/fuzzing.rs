//! Re-exports for the fuzz targets in `tests/fuzz`: the decoders a peer can
//! feed that are private to their backend. Compiled only with
//! `--cfg fuzzing` (set by `tests/fuzz/run.sh`), never in a normal build.

pub use crate::constants::RING_ENTRIES;
pub use crate::fabric::shm::ring::{Ring, RingWord};
pub use crate::fabric::shm::socket::{recv_frame, MAX_FRAME};
#[cfg(feature = "verbs")]
pub use crate::fabric::verbs::cm::{AcceptData, ConnectData};
