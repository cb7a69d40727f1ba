//! A streamed send's completion follows its buffer, not its error (issue 18,
//! N1): when a stream ends early (the receiver ends or aborts its step, the
//! sender aborts its own, the link is lost) while chunk writes are still
//! queued or copying, the send's `done` must wait for the last of them.
//!
//! The sender's tensor lives in its own anonymous mapping, and `done`
//! unmaps it at once, as TensorFlow frees a tensor once its send
//! completed: any chunk write that reads the tensor after `done` touches
//! unmapped memory and kills this test process with SIGSEGV.

mod common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use rdma_device::node::Node;
use rdma_device::rendezvous::{Payload, TensorMeta};
use rdma_device::Error;

/// A tensor in a mapping of its own; `done` unmaps it.
struct Mapped {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory, read only through `bytes` until the
// send completes; the pointer is just an address.
unsafe impl Send for Mapped {}
unsafe impl Sync for Mapped {}

impl Mapped {
    fn new(len: usize, seed: u8) -> Mapped {
        // SAFETY: a fresh private anonymous mapping, checked below.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
        assert_ne!(p, libc::MAP_FAILED, "mmap of {len} bytes");
        // SAFETY: the mapping is `len` bytes, ours.
        unsafe { std::ptr::write_bytes(p as *mut u8, seed, len) };
        Mapped { ptr: p as *mut u8, len }
    }

    /// The payload the send reads: a borrowed view, as the FFI's is of a
    /// TensorFlow tensor.
    fn payload(&self) -> Box<dyn Payload> {
        Box::new(View { ptr: self.ptr as usize, len: self.len })
    }

    /// What `done` does: the tensor is freed.
    fn unmap(ptr: usize, len: usize) {
        // SAFETY: unmapping our own mapping; any later read faults, which is
        // what the test is about.
        let r = unsafe { libc::munmap(ptr as *mut libc::c_void, len) };
        assert_eq!(r, 0);
    }
}

struct View {
    ptr: usize,
    len: usize,
}

impl Payload for View {
    fn bytes(&self) -> &[u8] {
        // SAFETY: valid until the send's done runs (the Payload contract).
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

/// Send a mapped tensor of `len` bytes whose done unmaps it; the result
/// comes on the channel.
fn send_mapped(node: &Node, peer: &str, key: &str, step: u64, len: usize) -> mpsc::Receiver<Result<(), Error>> {
    let m = Mapped::new(len, step as u8);
    let (ptr, len) = (m.ptr as usize, m.len);
    let (tx, rx) = mpsc::channel();
    let meta = TensorMeta { dtype: 4, flags: 0, dims: [len as i64].as_slice().into() };
    let r = node.send(peer, key, step, meta, m.payload(), Box::new(move |res| {
        Mapped::unmap(ptr, len);
        let _ = tx.send(res);
    }));
    r.expect("send accepted");
    rx
}

/// Nodes whose arena is small, so a 24 MiB tensor streams in 128 KiB
/// chunks, four in flight.
fn pair() -> (Node, Node, String, String) {
    let mut cfg = small_config();
    cfg.arena_bytes = 4 << 20;
    let (pa, pb) = (free_port(), free_port());
    let (ta, tb) = (task(0), task(1));
    let a = Node::new(cfg.clone(), &ta, &addr(pa)).unwrap();
    let b = Node::new(cfg, &tb, &addr(pb)).unwrap();
    a.add_peer(&tb, &addr(pb));
    b.add_peer(&ta, &addr(pa));
    (a, b, ta, tb)
}

const LEN: usize = 24 << 20;

/// Wait until `node` has started streaming (a chunk is on its way), or a
/// deadline passes.
fn wait_streaming(node: &Node) {
    let t0 = Instant::now();
    while node.counters().stream_chunks < 2 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::yield_now();
    }
    assert!(node.counters().stream_chunks >= 2, "the tensor never streamed: {}", node.describe());
}

/// The send's outcome: `true` if it failed (ended mid-stream), `false` if
/// the whole tensor got there first.
fn ended_early(rx: &mpsc::Receiver<Result<(), Error>>, what: &str) -> bool {
    match rx.recv_timeout(Duration::from_secs(10)) {
        Ok(r) => r.is_err(),
        Err(_) => panic!("{what}: the send never completed"),
    }
}

/// 12 streamed sends from `a` to `b`, each ended by `end(step)` once a few
/// chunks are out (`end` also finishes the step where it must); returns
/// how many sends ended mid-stream (failed rather than completed).
fn end_mid_stream(a: &Node, b: &Node, ta: &str, tb: &str, what: &str, end: impl Fn(u64)) -> u32 {
    let mut early = 0;
    for step in 1..=12u64 {
        let r = recv_async(b, ta, "big", step);
        let before = a.counters().stream_chunks;
        let done = send_mapped(a, tb, "big", step, LEN);
        let t0 = Instant::now();
        while a.counters().stream_chunks < before + 2 + step && t0.elapsed() < Duration::from_secs(10) {
            std::thread::yield_now();
        }
        end(step);
        early += ended_early(&done, what) as u32;
        let _ = r.recv_timeout(Duration::from_secs(10)).expect("the receive completed");
        b.step_done(step);
    }
    println!("{what}: {early} of 12 sends ended mid-stream");
    early
}

#[test]
fn receiver_ending_its_step_mid_stream_frees_the_buffer_only_after_the_last_chunk() {
    let (a, b, ta, tb) = pair();
    let early = end_mid_stream(&a, &b, &ta, &tb, "receiver ended its step", |step| {
        b.abort_step(step, Error::Aborted("the receiver's step ended".into()), false);
        b.step_done(step);
    });
    assert!(early >= 6, "only {early} of 12 sends were still streaming when the step ended: the test checks too little");
    // The link still works afterwards.
    let data = pattern(3, 1 << 20);
    let r = recv_async(&b, &ta, "after", 100);
    send_wait(&a, &tb, "after", 100, TensorMeta { dtype: 4, flags: 0, dims: [1 << 20].as_slice().into() }, data.clone()).unwrap();
    let l = r.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
    assert_eq!(checksum(l.bytes()), checksum(&data));
}

#[test]
fn sender_aborting_its_step_mid_stream_frees_the_buffer_only_after_the_last_chunk() {
    let (a, b, ta, tb) = pair();
    let early = end_mid_stream(&a, &b, &ta, &tb, "sender aborted its step", |step| {
        a.abort_step(step, Error::Aborted("the sender gives up".into()), true);
    });
    assert!(early >= 6, "only {early} of 12 sends were still streaming when the step was aborted: the test checks too little");
}

#[test]
fn link_lost_mid_stream_frees_the_buffer_only_after_the_last_chunk() {
    let mut early = 0;
    for round in 0..6u64 {
        let (a, b, ta, tb) = pair();
        let _r = recv_async(&b, &ta, "big", 1);
        let done = send_mapped(&a, &tb, "big", 1, LEN);
        wait_streaming(&a);
        for _ in 0..round * 3 {
            std::thread::yield_now();
        }
        if round % 2 == 0 {
            a.abort_peer(&tb);
        } else {
            drop(b);
        }
        early += ended_early(&done, "link lost") as u32;
    }
    println!("link lost: {early} of 6 sends ended mid-stream");
    assert!(early >= 3, "only {early} of 6 sends were still streaming when the link went: the test checks too little");
}
