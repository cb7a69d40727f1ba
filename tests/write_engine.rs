//! Large tensor writes run on the node's write engine, not on the thread
//! that calls `send` (TensorFlow's executor thread in a real job): the
//! caller posts the write and returns, as it would to a NIC. Small ones
//! stay on the caller (a copy of a few KiB is cheaper than a thread hop).
//! Shown with the transport's own timeline: each `write` span records the
//! thread that ran it. (Its own test binary: recording is process-wide.)

mod common;

use std::time::Duration;

use common::*;
use rdma_device::constants::WRITE_ENGINE_MIN;
use rdma_device::node::Node;
use rdma_device::rendezvous::TensorMeta;
use rdma_device::trace;

fn thread_name(tid: i32) -> String {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).unwrap_or_default().trim().to_string()
}

#[test]
fn large_writes_leave_the_senders_thread_small_ones_do_not() {
    let (pa, pb) = (free_port(), free_port());
    let (ta, tb) = (task(0), task(1));
    let a = Node::new(small_config(), &ta, &addr(pa)).unwrap();
    let b = Node::new(small_config(), &tb, &addr(pb)).unwrap();
    a.add_peer(&tb, &addr(pb));
    b.add_peer(&ta, &addr(pa));
    a.connect(&tb).unwrap();
    trace::set_enabled(true);
    let _ = trace::take();
    // SAFETY: plain syscall.
    let me = unsafe { libc::gettid() };
    let sizes = [4096usize, WRITE_ENGINE_MIN - 4096, WRITE_ENGINE_MIN, 1 << 20, 16 << 20];
    // Each size its own edge, two steps: the first waits for the edge's
    // placement (its write then runs where the placement arrives), the
    // second is pushed straight from this thread.
    for &len in &sizes {
        let key = format!("t{len}");
        for step in 1..=2u64 {
            let data = pattern(step + len as u64, len);
            let r = recv_async(&b, &ta, &key, step);
            send_wait(&a, &tb, &key, step, TensorMeta { dtype: 4, flags: 0, dims: [len as i64].as_slice().into() }, data.clone()).unwrap();
            let l = r.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
            assert_eq!(checksum(l.bytes()), checksum(&data), "{len} bytes arrived altered");
        }
    }
    trace::set_enabled(false);
    let (spans, _) = trace::take();
    for &len in &sizes {
        let w = spans.iter().find(|s| s.name.as_str() == "write" && s.bytes == len as u64 && s.step == 2).unwrap_or_else(|| panic!("no write span of {len} bytes: {spans:?}"));
        let name = thread_name(w.tid);
        if len >= WRITE_ENGINE_MIN {
            assert!(w.tid != me && name.starts_with("rdev-write"), "a {len}-byte write ran on {name} (tid {}), not the write engine", w.tid);
        } else {
            assert_eq!(w.tid, me, "a {len}-byte write left the caller's thread (for {name})");
        }
    }
}
