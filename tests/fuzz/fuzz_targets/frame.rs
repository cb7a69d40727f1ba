//! The shm control socket's framing, fed through a real unix socket pair:
//! arbitrary bytes (as a hostile peer would write them) must give frames or
//! errors, never a panic or an allocation beyond the frame cap.
#![no_main]

use std::io::Write;
use std::os::unix::net::UnixStream;

use rdma_device::fuzzing::{recv_frame, MAX_FRAME};
use rdma_device::rendezvous::Msg;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok((mut a, b)) = UnixStream::pair() else { return };
    // Small inputs only: the socket buffer must hold all of it, since this
    // thread both writes and reads.
    if data.len() > 64 * 1024 || a.write_all(data).is_err() {
        return;
    }
    drop(a);
    for _ in 0..1024 {
        match recv_frame(&b) {
            Ok((_kind, body, _fds)) => {
                assert!(body.len() <= MAX_FRAME);
                let _ = Msg::decode(&body);
            }
            Err(_) => break,
        }
    }
});
