//! The steady-state hot path allocates nothing: a counting global
//! allocator watches every thread of the process (the caller's, the shm
//! progress and reader threads, `rdev-callbacks`) while two transports in
//! this process move tensors through the C ABI, as the TensorFlow shim
//! calls it, on an edge placed ahead.

use std::alloc::{GlobalAlloc, Layout, System};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use rdma_device::ffi::buffer::*;
use rdma_device::ffi::*;

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);
/// `ALLOC_TRACE=1`: print a backtrace of every counted allocation.
static TRACE: AtomicBool = AtomicBool::new(false);

thread_local! {
    static IN_TRACE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn note_alloc() {
    if !COUNTING.load(Ordering::Relaxed) {
        return;
    }
    // Allocations made while printing a trace are the test's own.
    if IN_TRACE.try_with(|t| t.get()).unwrap_or(true) {
        return;
    }
    // One allocation is not the tensor path's: a thread's first wait on a
    // contended lock sets up that thread's parking record for its whole
    // life (parking_lot's `ThreadData`), which a busy machine can delay
    // into the counted steps. Anything else counts. (Symbolizing a
    // backtrace is slow, but the steady state makes no allocation to
    // look at.)
    let _ = IN_TRACE.try_with(|t| {
        t.set(true);
        let trace = std::backtrace::Backtrace::force_capture().to_string();
        if !trace.contains("parking_lot::ThreadData::new") {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
            if TRACE.load(Ordering::Relaxed) {
                eprintln!("=== alloc on {:?}\n{trace}", std::thread::current().name());
            }
        }
        t.set(false);
    });
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note_alloc();
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        note_alloc();
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        note_alloc();
        unsafe { System.realloc(p, l, n) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

static SENT: AtomicU64 = AtomicU64::new(0);
static RECEIVED: AtomicU64 = AtomicU64::new(0);
static LAST_BUF: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static FAILED: AtomicU64 = AtomicU64::new(0);

extern "C" fn on_sent(_ud: *mut c_void, st: rdev_status, _m: *const std::ffi::c_char, _l: usize) {
    if st != rdev_status::RDEV_OK {
        FAILED.fetch_add(1, Ordering::SeqCst);
    }
    SENT.fetch_add(1, Ordering::SeqCst);
}

extern "C" fn on_received(_ud: *mut c_void, st: rdev_status, _m: *const std::ffi::c_char, _l: usize, buf: *mut rdev_buffer) {
    if st != rdev_status::RDEV_OK {
        FAILED.fetch_add(1, Ordering::SeqCst);
    }
    LAST_BUF.store(buf as usize, Ordering::SeqCst);
    RECEIVED.fetch_add(1, Ordering::SeqCst);
}

/// Spin (yielding) until `c` reaches `n`; allocation-free, with a deadline.
fn wait_for(c: &AtomicU64, n: u64) {
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while c.load(Ordering::SeqCst) < n {
        assert!(std::time::Instant::now() < until, "timed out waiting for a completion");
        std::thread::yield_now();
    }
}

fn new_ctx(task: &str, addr: &str) -> *mut rdev_context {
    let mut c = std::ptr::null_mut();
    // SAFETY: valid strings and out-param.
    let st = unsafe { rdev_context_new(task.as_ptr().cast(), task.len(), addr.as_ptr().cast(), addr.len(), &mut c) };
    assert_eq!(st, rdev_status::RDEV_OK);
    c
}

fn add_peer(c: *mut rdev_context, task: &str, addr: &str) {
    let mut t = rdev_transport::RDEV_TRANSPORT_NONE;
    // SAFETY: valid context, strings and out-param.
    let st = unsafe { rdev_context_add_peer(c, task.as_ptr().cast(), task.len(), addr.as_ptr().cast(), addr.len(), &mut t) };
    assert_eq!(st, rdev_status::RDEV_OK);
    assert_ne!(t, rdev_transport::RDEV_TRANSPORT_NONE);
}

/// Move `steps` tensors of `len` bytes over one edge; returns the number of
/// allocations the whole process made during the last `measured` steps.
#[allow(clippy::too_many_arguments)]
fn run(a: *mut rdev_context, b: *mut rdev_context, ta: &str, tb: &str, key: &str, len: usize, recv_first: bool, first_step: u64, steps: u64, measured: u64) -> u64 {
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
    let dims = [len as i64];
    let meta = rdev_tensor_meta { dtype: 4, flags: 0, ndims: 1, dims: dims.as_ptr() };
    let mut placed = false;
    // SAFETY: valid context and strings.
    let st = unsafe { rdev_place_edge(a, tb.as_ptr().cast(), tb.len(), key.as_ptr().cast(), key.len(), len as u64, 10_000, &mut placed) };
    assert_eq!(st, rdev_status::RDEV_OK);
    assert!(placed);
    let before = ALLOCS.load(Ordering::SeqCst);
    for i in 0..steps {
        let step = first_step + i;
        if i == steps - measured {
            // Every thread is idle here (the previous step completed).
            COUNTING.store(true, Ordering::SeqCst);
        }
        let (s0, r0) = (SENT.load(Ordering::SeqCst), RECEIVED.load(Ordering::SeqCst));
        // SAFETY: valid contexts, strings, meta and data (kept alive until on_sent).
        let recv = || unsafe { rdev_recv(b, ta.as_ptr().cast(), ta.len(), key.as_ptr().cast(), key.len(), step, Some(on_received), std::ptr::null_mut()) };
        // SAFETY: as above.
        let send = || unsafe { rdev_send(a, tb.as_ptr().cast(), tb.len(), key.as_ptr().cast(), key.len(), step, &meta, data.as_ptr(), len, Some(on_sent), std::ptr::null_mut()) };
        if recv_first {
            assert_eq!(recv(), rdev_status::RDEV_OK);
            assert_eq!(send(), rdev_status::RDEV_OK);
        } else {
            // The tensor arrives before its receive is made.
            assert_eq!(send(), rdev_status::RDEV_OK);
            wait_for(&SENT, s0 + 1);
            assert_eq!(recv(), rdev_status::RDEV_OK);
        }
        wait_for(&SENT, s0 + 1);
        wait_for(&RECEIVED, r0 + 1);
        assert_eq!(FAILED.load(Ordering::SeqCst), 0);
        let buf = LAST_BUF.load(Ordering::SeqCst) as *mut rdev_buffer;
        // SAFETY: a buffer handed to on_received, released once below.
        unsafe {
            assert!(rdev_buffer_in_place(buf), "step {step}: not received in place");
            let got = std::slice::from_raw_parts(rdev_buffer_data(buf), rdev_buffer_len(buf));
            assert!(got == &data[..], "step {step}: bytes differ");
            rdev_buffer_release(buf);
            assert_eq!(rdev_step_done(a, step), rdev_status::RDEV_OK);
            assert_eq!(rdev_step_done(b, step), rdev_status::RDEV_OK);
        }
    }
    // Let completions that trail the callbacks (credits, releases) finish.
    std::thread::sleep(Duration::from_millis(50));
    COUNTING.store(false, Ordering::SeqCst);
    let _ = before;
    ALLOCS.swap(0, Ordering::SeqCst)
}

/// Its own `main` (no libtest harness): the harness's threads allocate
/// while a test runs, and the counter sees every thread of the process.
fn main() {
    steady_state_send_and_receive_allocate_nothing();
    println!("alloc: ok");
}

fn steady_state_send_and_receive_allocate_nothing() {
    let (pa, pb) = (free_port(), free_port());
    let (ta, tb) = ("/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1");
    let (aa, ab) = (format!("localhost:{pa}"), format!("localhost:{pb}"));
    std::env::set_var("RDMA_DEVICE_ARENA_BYTES", "64M");
    TRACE.store(std::env::var_os("ALLOC_TRACE").is_some(), Ordering::SeqCst);
    // The counter counts (a test that cannot fail is no test),
    // checked before any transport thread runs.
    COUNTING.store(true, Ordering::SeqCst);
    drop(std::hint::black_box(vec![1u8; 10]));
    COUNTING.store(false, Ordering::SeqCst);
    assert_eq!(ALLOCS.swap(0, Ordering::SeqCst), 1);

    let a = new_ctx(ta, &aa);
    let b = new_ctx(tb, &ab);
    add_peer(a, tb, &ab);
    add_peer(b, ta, &aa);
    let mut step = 1;
    for (i, (len, recv_first)) in [(4096usize, true), (4096, false), (1 << 20, true), (16 << 20, false)].into_iter().enumerate() {
        let key = format!("edge{i};0:0");
        ALLOCS.store(0, Ordering::SeqCst);
        let n = run(a, b, ta, tb, &key, len, recv_first, step, 300, 200);
        step += 300;
        let order = if recv_first { "receive first" } else { "send first" };
        eprintln!("{len} B, {order}: {n} allocations over 200 steps");
        assert_eq!(n, 0, "{len}-byte tensors, {order}: {n} heap allocations in 200 steady-state steps ({} per step)", n as f64 / 200.0);
    }
    // Every tensor went through a placed slot (one-sided writes), none
    // through a stream.
    let pushed = rdma_device::stats::Stats::global().c.tensors_pushed.load(Ordering::SeqCst);
    assert_eq!(pushed, 4 * 300);
    // SAFETY: contexts from rdev_context_new, freed once.
    unsafe {
        rdev_context_free(a);
        rdev_context_free(b);
    }
}

/// A loopback port held by this process until it exits (the shm socket is
/// named after the address, so no other test may get the same port).
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::mem::forget(l);
    port
}
