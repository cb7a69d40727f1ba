//! Tensors that no slot holds, over real shm between two nodes: streamed
//! through the link's stream slots (see `rendezvous::stream`). The arena is
//! 64 MiB, so every tensor here is larger than the whole arena; the
//! largest is 2.5 GiB (past 2^31 bytes: offsets and lengths must not pass
//! through 32-bit or signed types anywhere), with a checksum of every byte.

mod common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use rdma_device::node::{Lease, Node};
use rdma_device::rendezvous::{stream_chunk_bytes, TensorMeta};

const ARENA: usize = 64 << 20;

fn pair() -> (Node, Node, String, String) {
    let mut cfg = small_config();
    cfg.arena_bytes = ARENA;
    let (pa, pb) = (free_port(), free_port());
    let (ta, tb) = (task(0), task(1));
    let a = Node::new(cfg.clone(), &ta, &format!("localhost:{pa}")).unwrap();
    let b = Node::new(cfg, &tb, &format!("localhost:{pb}")).unwrap();
    assert!(a.add_peer(&tb, &format!("localhost:{pb}")).transport.is_some());
    assert!(b.add_peer(&ta, &format!("localhost:{pa}")).transport.is_some());
    (a, b, ta, tb)
}

/// Deterministic bytes, 8 at a time (fast enough for GiBs in a debug build).
fn fill(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let mut x = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    let mut words = v.chunks_exact_mut(8);
    for w in &mut words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&x.to_le_bytes());
    }
    for (i, b) in words.into_remainder().iter_mut().enumerate() {
        *b = (x >> (8 * i)) as u8;
    }
    v
}

/// A checksum of every byte, position-dependent (a swapped or shifted
/// chunk changes it).
fn sum(b: &[u8]) -> u64 {
    let mut h = 0x243f_6a88_85a3_08d3u64;
    let mut words = b.chunks_exact(8);
    for w in &mut words {
        h = (h ^ u64::from_le_bytes(w.try_into().unwrap())).wrapping_mul(0x100_0000_01b3).rotate_left(29);
    }
    for x in words.remainder() {
        h = (h ^ *x as u64).wrapping_mul(0x100_0000_01b3);
    }
    h ^ b.len() as u64
}

fn meta(len: usize) -> TensorMeta {
    TensorMeta { dtype: 4, flags: 0, dims: vec![len as i64].into() }
}

/// Send without waiting; the completion comes on the channel.
fn send(n: &Node, peer: &str, key: &str, step: u64, data: Vec<u8>) -> mpsc::Receiver<rdma_device::Result<()>> {
    let (tx, rx) = mpsc::channel();
    let len = data.len();
    n.send(peer, key, step, meta(len), Box::new(data), Box::new(move |r| tx.send(r).unwrap())).unwrap();
    rx
}

fn wait<T>(rx: &mpsc::Receiver<T>, what: &str, n: &Node) -> T {
    rx.recv_timeout(Duration::from_secs(300)).unwrap_or_else(|_| panic!("{what} did not complete; state:\n{}", n.describe()))
}

fn chunk() -> u64 {
    stream_chunk_bytes(ARENA as u64).unwrap()
}

#[test]
fn tensor_of_2_5_gib_through_a_64_mib_arena() {
    let (a, b, ta, tb) = pair();
    let len = (5usize << 30) / 2;
    let data = fill(25, len);
    let want = sum(&data);
    let r = recv_async(&b, &ta, "huge", 1);
    let t0 = Instant::now();
    let done = send(&a, &tb, "huge", 1, data);
    let lease: Lease = wait(&r, "the 2.5 GiB receive", &b).unwrap();
    let secs = t0.elapsed().as_secs_f64();
    wait(&done, "the 2.5 GiB send", &a).unwrap();
    assert_eq!(lease.len(), len);
    assert_eq!(lease.meta(), &meta(len));
    assert!(!lease.in_place());
    assert_eq!(sum(lease.bytes()), want, "the 2.5 GiB tensor arrived corrupted");
    eprintln!("2.5 GiB over shm (64 MiB arena, {} B chunks): {secs:.2} s, {:.2} GB/s", chunk(), len as f64 / secs / 1e9);
    let (ca, cb) = (a.counters(), b.counters());
    assert_eq!(ca.inline_tensors, 1, "{ca:?}");
    assert_eq!(ca.inline_bytes, len as u64);
    // Every byte went through the stream slots, none as messages: one write
    // per chunk, so the sender never held more than the payload itself.
    assert_eq!(ca.stream_chunks, (len as u64).div_ceil(chunk()), "{ca:?}");
    assert_eq!(ca.stream_messages, 0);
    assert_eq!(cb.tensors_received, 1);
    assert_eq!(cb.bytes_received, len as u64);
    assert_eq!(cb.rejected_writes, 0);
}

#[test]
fn sizes_around_the_arena_and_the_chunk() {
    let (a, b, ta, tb) = pair();
    let c = chunk() as usize;
    let sizes = [ARENA + 1, ARENA - 4096 + 1, 40 * c, 40 * c + 1, 40 * c - 1];
    let mut chunks = 0;
    for (i, len) in sizes.into_iter().enumerate() {
        let step = i as u64 + 1;
        let data = fill(step, len);
        let r = recv_async(&b, &ta, "edge", step);
        let done = send(&a, &tb, "edge", step, data.clone());
        let l = wait(&r, "receive", &b).unwrap();
        wait(&done, "send", &a).unwrap();
        assert!(l.bytes() == &data[..], "size {len} corrupted");
        chunks += (len as u64).div_ceil(c as u64);
    }
    assert_eq!(a.counters().stream_chunks, chunks);
    assert_eq!(a.counters().inline_tensors, sizes.len() as u64);
}

#[test]
fn many_oversized_tensors_at_once_on_different_edges() {
    let (a, b, ta, tb) = pair();
    let len = ARENA + 3 * 4096 + 5;
    let n = 6;
    // Some receives wait before the send, some are made after.
    let mut recvs = Vec::new();
    for e in 0..n / 2 {
        recvs.push((e, recv_async(&b, &ta, &format!("e{e}"), 7)));
    }
    let dones: Vec<_> = (0..n).map(|e| send(&a, &tb, &format!("e{e}"), 7, fill(100 + e as u64, len))).collect();
    for e in n / 2..n {
        recvs.push((e, recv_async(&b, &ta, &format!("e{e}"), 7)));
    }
    for (e, r) in recvs {
        let l = wait(&r, "receive", &b).unwrap();
        assert_eq!(sum(l.bytes()), sum(&fill(100 + e as u64, len)), "edge {e}");
    }
    for d in dones {
        wait(&d, "send", &a).unwrap();
    }
    assert_eq!(a.counters().inline_tensors, n as u64);
    assert_eq!(b.counters().tensors_received, n as u64);
}

#[test]
fn a_step_ended_mid_stream_frees_both_sides_and_the_link_goes_on() {
    let (a, b, ta, tb) = pair();
    let len = 512 << 20;
    let done = send(&a, &tb, "big", 3, fill(1, len));
    // Wait until some chunks moved, then end the step at the receiver.
    let t0 = Instant::now();
    while a.counters().stream_chunks < 4 && t0.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(1));
    }
    b.step_done(3);
    let e = wait(&done, "the cancelled send", &a).unwrap_err();
    assert!(matches!(e, rdma_device::Error::Aborted(_)), "{e}");
    // The stream slots are still the link's, and carry the next one.
    let data = fill(2, ARENA * 2);
    let r = recv_async(&b, &ta, "big", 4);
    let d = send(&a, &tb, "big", 4, data.clone());
    assert!(wait(&r, "receive", &b).unwrap().bytes() == &data[..]);
    wait(&d, "send", &a).unwrap();
}
