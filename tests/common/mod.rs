//! Shared helpers for the integration tests.
#![allow(dead_code)]

use std::net::TcpListener;
use std::sync::mpsc;
use std::time::Duration;

use rdma_device::config::Config;
use rdma_device::node::{Lease, Node};
use rdma_device::rendezvous::TensorMeta;
use rdma_device::Result;

/// Say that the running test checks nothing here, and why. Written to the
/// process's stderr directly (libtest captures only `print!`/`eprint!`),
/// so `cargo test` shows the line although the test reports "ok"; a test
/// that calls this returns at once.
///
/// With `RDMA_DEVICE_SKIP_LOG` set (`.ci/test.sh` sets it), the line is
/// also appended to that file, which the suite prints as a summary of what
/// did not run, since libtest itself counts such a test as passed.
pub fn skipped(reason: &str) {
    use std::io::Write;
    let name = std::thread::current().name().unwrap_or("?").to_string();
    let _ = writeln!(std::io::stderr(), "SKIPPED {name}: {reason}");
    if let Some(path) = std::env::var_os("RDMA_DEVICE_SKIP_LOG") {
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
            let exe = std::env::current_exe().ok().and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned())).unwrap_or_default();
            // One write per line (O_APPEND): tests skip from several threads.
            let _ = f.write_all(format!("{} {name}: {reason}\n", exe.split('-').next().unwrap_or(&exe)).as_bytes());
        }
    }
}

/// A loopback port no other test holds. Nodes do not bind TCP, but the
/// shm transport names its socket after the address, so two nodes given
/// the same port collide (one cannot listen). The port stays bound by this
/// test process until it exits, so neither the kernel nor a concurrent
/// test can hand it out again.
pub fn free_port() -> u16 {
    static HELD: std::sync::Mutex<Vec<TcpListener>> = std::sync::Mutex::new(Vec::new());
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    HELD.lock().unwrap_or_else(|e| e.into_inner()).push(l);
    port
}

/// The host part of the tests' node addresses: "localhost", or, to run the
/// node-level suites over verbs, an address of an RDMA port
/// (`RDMA_DEVICE_TEST_HOST`; tests/softroce/suites_over_verbs.sh sets it to
/// the VM's 10.0.2.15 together with `RDMA_DEVICE_TRANSPORTS=verbs`).
pub fn host() -> String {
    std::env::var("RDMA_DEVICE_TEST_HOST").unwrap_or_else(|_| "localhost".into())
}

pub fn addr(port: impl std::fmt::Display) -> String {
    format!("{}:{port}", host())
}

/// The transport two nodes of one host choose: the first one allowed
/// (`RDMA_DEVICE_TRANSPORTS`, default "shm").
pub fn local_transport() -> String {
    small_config().transports.first().cloned().unwrap_or_default()
}

pub fn task(i: usize) -> String {
    format!("/job:worker/replica:0/task:{i}")
}

pub fn small_config() -> Config {
    let mut c = Config { arena_bytes: 256 << 20, ..Config::default() };
    if let Ok(l) = std::env::var("RDMA_DEVICE_LOG") {
        c.log = l;
    }
    if let Ok(t) = std::env::var("RDMA_DEVICE_TRANSPORTS") {
        c.transports = t.split(',').map(|x| x.trim().to_string()).filter(|x| !x.is_empty()).collect();
    }
    c
}

/// Deterministic bytes for (seed, len).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn checksum(b: &[u8]) -> u64 {
    // FNV-1a
    let mut h: u64 = 0xcbf29ce484222325;
    for &x in b {
        h ^= x as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// The backends' event threads: no application callback may run on one
/// (issue 18, N3: they would run TensorFlow's code there).
pub const EVENT_THREADS: &[&str] = &["rdev-verbs", "rdev-shm-progress", "rdev-shm-conn", "rdev-shm-accept", "rdev-shm-reader"];

/// `Err` on a backend's event thread (call it in a callback; the helpers
/// below do, and report it on the test's thread).
pub fn callback_thread_ok() -> std::result::Result<(), String> {
    let t = std::thread::current();
    match t.name() {
        Some(n) if EVENT_THREADS.contains(&n) => Err(format!("a callback ran on the event thread {n}")),
        _ => Ok(()),
    }
}

/// Blocking send (waits for the completion, which must not run on an
/// event thread).
pub fn send_wait(n: &Node, peer: &str, key: &str, step: u64, meta: TensorMeta, data: Vec<u8>) -> Result<()> {
    let (tx, rx) = mpsc::channel();
    n.send(peer, key, step, meta, Box::new(data), Box::new(move |r| tx.send((r, callback_thread_ok())).unwrap()))?;
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok((r, thread)) => {
            if let Err(e) = thread {
                panic!("send of {key} step {step}: {e}");
            }
            r
        }
        Err(_) => panic!("send of {key} step {step} did not complete; state:\n{}", n.describe()),
    }
}

/// Start a receive; the result comes on the returned channel (a callback
/// run on an event thread arrives as an error saying so).
pub fn recv_async(n: &Node, peer: &str, key: &str, step: u64) -> mpsc::Receiver<Result<Lease>> {
    let (tx, rx) = mpsc::channel();
    n.recv(peer, key, step, Box::new(move |r| {
        let r = match callback_thread_ok() {
            Ok(()) => r,
            Err(e) => Err(rdma_device::error::Error::Internal(e)),
        };
        let _ = tx.send(r);
    }));
    rx
}

pub fn recv_wait(n: &Node, peer: &str, key: &str, step: u64) -> Result<Lease> {
    match recv_async(n, peer, key, step).recv_timeout(Duration::from_secs(30)) {
        Ok(r) => r,
        Err(_) => panic!("recv of {key} step {step} did not complete; state:\n{}", n.describe()),
    }
}

/// A context for `task` listening at `addr`, through the C ABI.
pub fn new_ctx(task: &str, addr: &str) -> *mut rdma_device::ffi::rdev_context {
    use rdma_device::ffi::*;
    let mut c = std::ptr::null_mut();
    // SAFETY: valid strings and out-param.
    let st = unsafe { rdev_context_new(task.as_ptr().cast(), task.len(), addr.as_ptr().cast(), addr.len(), &mut c) };
    assert_eq!(st, rdev_status::RDEV_OK);
    c
}

/// Tell context `c` about peer `task` at `addr`, through the C ABI.
pub fn add_peer(c: *mut rdma_device::ffi::rdev_context, task: &str, addr: &str) {
    use rdma_device::ffi::*;
    let mut t = rdev_transport::RDEV_TRANSPORT_NONE;
    // SAFETY: valid context, strings and out-param.
    let st = unsafe { rdev_context_add_peer(c, task.as_ptr().cast(), task.len(), addr.as_ptr().cast(), addr.len(), &mut t) };
    assert_eq!(st, rdev_status::RDEV_OK);
}
