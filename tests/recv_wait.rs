//! Receives a thread waits for (`rdev_recv_waitable` / `rdev_wait`): the
//! deadline, the outcome taken once, errors with their message, and the
//! hand-off: the event thread that finished the receive wakes the waiter
//! itself, while a callback receive still goes through `rdev-callbacks`.

mod common;

use std::ffi::c_void;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use rdma_device::completion::Complete;
use rdma_device::ffi::buffer::*;
use rdma_device::ffi::*;
use rdma_device::node::{Lease, Node};
use rdma_device::rendezvous::TensorMeta;

fn waitable(c: *mut rdev_context, peer: &str, key: &str, step: u64) -> *mut rdev_waiter {
    let mut w = std::ptr::null_mut();
    // SAFETY: valid context, strings and out-param.
    let st = unsafe { rdev_recv_waitable(c, peer.as_ptr().cast(), peer.len(), key.as_ptr().cast(), key.len(), step, &mut w) };
    assert_eq!(st, rdev_status::RDEV_OK);
    assert!(!w.is_null());
    w
}

fn wait(w: *mut rdev_waiter, ms: u64) -> (rdev_status, *mut rdev_buffer) {
    let mut b = std::ptr::null_mut();
    // SAFETY: a live waiter and an out-param.
    let st = unsafe { rdev_wait(w, ms, &mut b) };
    (st, b)
}

unsafe extern "C" fn sent(_: *mut c_void, st: rdev_status, _: *const std::ffi::c_char, _: usize) {
    assert_eq!(st, rdev_status::RDEV_OK);
}

fn last_error() -> String {
    let mut buf = vec![0u8; 4096];
    // SAFETY: a writable buffer of its length.
    let n = unsafe { rdev_last_error(buf.as_mut_ptr().cast(), buf.len()) };
    buf.truncate(n.min(buf.len() - 1));
    String::from_utf8_lossy(&buf).into_owned()
}

#[test]
fn a_waited_receive_times_out_then_gets_its_tensor_once() {
    let (pa, pb) = (free_port(), free_port());
    let (ta, tb) = (task(0), task(1));
    let (a, b) = (new_ctx(&ta, &addr(pa)), new_ctx(&tb, &addr(pb)));
    add_peer(a, &tb, &addr(pb));
    add_peer(b, &ta, &addr(pa));
    let w = waitable(b, &ta, "w", 1);
    // Nothing sent yet: the deadline holds, and the receive stays posted.
    let t0 = Instant::now();
    let (st, buf) = wait(w, 200);
    let waited = t0.elapsed();
    assert_eq!(st, rdev_status::RDEV_TIMEOUT);
    assert!(buf.is_null());
    assert!(waited >= Duration::from_millis(200) && waited < Duration::from_secs(2), "waited {waited:?}");
    let data = pattern(7, 4096);
    let dims = [4096i64];
    let meta = rdev_tensor_meta { dtype: 4, flags: 0, ndims: 1, dims: dims.as_ptr() };
    // SAFETY: valid context, strings, meta; data outlives the send (waited below).
    let st = unsafe { rdev_send(a, tb.as_ptr().cast(), tb.len(), "w".as_ptr().cast(), 1, 1, &meta, data.as_ptr(), data.len(), Some(sent), std::ptr::null_mut()) };
    assert_eq!(st, rdev_status::RDEV_OK);
    let (st, buf) = wait(w, 10_000);
    assert_eq!(st, rdev_status::RDEV_OK, "{}", last_error());
    // SAFETY: a buffer the wait handed us.
    let got = unsafe { std::slice::from_raw_parts(rdev_buffer_data(buf), rdev_buffer_len(buf)) };
    assert_eq!(checksum(got), checksum(&data));
    // One call says what the accessors say.
    let mut d = std::mem::MaybeUninit::<rdev_buffer_desc>::uninit();
    // SAFETY: a live buffer and a writable struct, read only once filled.
    let d = unsafe {
        assert!(rdev_buffer_describe(buf, d.as_mut_ptr()));
        d.assume_init()
    };
    // SAFETY: as above.
    unsafe {
        assert_eq!((d.data, d.len, d.dtype, d.flags, d.ndims, d.in_place), (rdev_buffer_data(buf), rdev_buffer_len(buf), rdev_buffer_dtype(buf), rdev_buffer_flags(buf), rdev_buffer_ndims(buf), rdev_buffer_in_place(buf)));
        assert_eq!(std::slice::from_raw_parts(d.dims, d.ndims as usize), &[4096]);
    }
    assert!(!unsafe { rdev_buffer_describe(std::ptr::null(), std::ptr::null_mut()) });
    // Taken once.
    let (st, again) = wait(w, 0);
    assert_eq!(st, rdev_status::RDEV_INVALID_ARGUMENT);
    assert!(again.is_null());
    // SAFETY: each freed once.
    unsafe {
        rdev_buffer_release(buf);
        rdev_waiter_free(w);
    }
    // A failed receive: its error and message come out of the wait.
    let w = waitable(b, &ta, "w", 2);
    let msg = "the step is over";
    // SAFETY: valid context and message.
    assert_eq!(unsafe { rdev_abort_step(b, 2, 0, msg.as_ptr().cast(), msg.len(), false) }, rdev_status::RDEV_OK);
    let (st, buf) = wait(w, 10_000);
    assert_eq!(st, rdev_status::RDEV_ABORTED);
    assert!(buf.is_null());
    assert!(last_error().contains(msg), "{}", last_error());
    // A waiter freed before its tensor came: the tensor is released when it
    // does (the edge's slot comes back: later steps still go through).
    let w = waitable(b, &ta, "w", 3);
    // SAFETY: freed once.
    unsafe { rdev_waiter_free(w) };
    for step in 3..10u64 {
        // SAFETY: as above.
        let st = unsafe { rdev_send(a, tb.as_ptr().cast(), tb.len(), "w".as_ptr().cast(), 1, step, &meta, data.as_ptr(), data.len(), Some(sent), std::ptr::null_mut()) };
        assert_eq!(st, rdev_status::RDEV_OK);
        if step > 3 {
            let w = waitable(b, &ta, "w", step);
            let (st, buf) = wait(w, 10_000);
            assert_eq!(st, rdev_status::RDEV_OK, "step {step}: {}", last_error());
            // SAFETY: freed once each.
            unsafe {
                rdev_buffer_release(buf);
                rdev_waiter_free(w);
            }
        }
    }
    // SAFETY: contexts from rdev_context_new, freed once.
    unsafe {
        rdev_context_free(a);
        rdev_context_free(b);
    }
}

/// A receive completion that reports the thread it ran on.
struct OnThread {
    tx: mpsc::Sender<String>,
    anywhere: bool,
}

impl Complete<rdma_device::Result<Lease>> for OnThread {
    fn complete(self: Box<Self>, r: rdma_device::Result<Lease>) {
        assert!(r.is_ok());
        let _ = self.tx.send(std::thread::current().name().unwrap_or("?").to_string());
    }

    fn runs_anywhere(&self) -> bool {
        self.anywhere
    }
}

#[test]
fn an_arrival_wakes_a_waiter_from_the_event_thread_and_a_callback_from_rdev_callbacks() {
    let cfg = small_config();
    if !cfg.allows("shm") {
        return skipped("shm is not among RDMA_DEVICE_TRANSPORTS (the event thread named here is shm's)");
    }
    let (pa, pb) = (free_port(), free_port());
    let (ta, tb) = (task(0), task(1));
    let a = Node::new(cfg.clone(), &ta, &addr(pa)).unwrap();
    let b = Node::new(cfg, &tb, &addr(pb)).unwrap();
    a.add_peer(&tb, &addr(pb));
    b.add_peer(&ta, &addr(pa));
    for (step, anywhere) in [(1u64, true), (2, false), (3, true), (4, false)] {
        // Posted first, so the arrival (on the event thread) completes it.
        let (tx, rx) = mpsc::channel();
        b.recv(&ta, "t", step, Box::new(OnThread { tx, anywhere }));
        let data = pattern(step, 1024);
        send_wait(&a, &tb, "t", step, TensorMeta { dtype: 4, flags: 0, dims: [1024].as_slice().into() }, data).unwrap();
        let thread = rx.recv_timeout(Duration::from_secs(10)).expect("the receive completed");
        let want = if anywhere { "rdev-shm-progress" } else { "rdev-callbacks" };
        assert_eq!(thread, want, "step {step}");
        b.step_done(step);
    }
}

/// Issue 33 (caller-driven progress): a thread that polls for its receive
/// (what `rdev_wait` does before it parks) delivers the write that lands
/// meanwhile itself: the receive completes on that thread, not on the
/// progress thread, and the write is counted in `polled_writes`. With
/// polling off the same receive completes on the progress thread.
#[test]
fn a_thread_polling_for_its_receive_completes_it_itself() {
    let cfg = small_config();
    if !cfg.allows("shm") {
        return skipped("shm is not among RDMA_DEVICE_TRANSPORTS (the event thread named here is shm's)");
    }
    // The progress threads sleep once idle; the waiting thread polls long
    // enough for a write sent 20 ms later.
    let cfg = rdma_device::config::Config { spin_us: 0, poll_us: 2_000_000, ..cfg };
    let me = std::thread::current().name().unwrap().to_string();
    let (pa, pb) = (free_port(), free_port());
    let (ta, tb) = (task(0), task(1));
    let a = std::sync::Arc::new(Node::new(cfg.clone(), &ta, &addr(pa)).unwrap());
    let b = Node::new(cfg.clone(), &tb, &addr(pb)).unwrap();
    let b_off = Node::new(rdma_device::config::Config { poll_us: 0, ..cfg }, &task(2), &addr(free_port())).unwrap();
    a.add_peer(&tb, &addr(pb));
    b.add_peer(&ta, &addr(pa));
    a.add_peer(&task(2), b_off.addr());
    b_off.add_peer(&ta, &addr(pa));
    let polled = || rdma_device::stats::Stats::global().c.polled_writes.load(std::sync::atomic::Ordering::Relaxed);
    for (step, node, peer, polls) in [(1u64, &b, &tb, true), (2, &b_off, &task(2), false), (3, &b, &tb, true)] {
        let (tx, rx) = mpsc::channel();
        node.recv(&ta, "t", step, Box::new(OnThread { tx, anywhere: true }));
        let before = polled();
        let (a2, peer2) = (a.clone(), peer.clone());
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            send_wait(&a2, &peer2, "t", step, TensorMeta { dtype: 4, flags: 0, dims: [256].as_slice().into() }, pattern(step, 256)).unwrap();
        });
        let got = parking_lot::Mutex::new(None);
        let done = node.poller().spin_until(|| {
            if let Ok(t) = rx.try_recv() {
                *got.lock() = Some(t);
            }
            got.lock().is_some()
        });
        assert_eq!(done, polls, "step {step}: the poll window");
        let thread = match got.into_inner() {
            Some(t) => t,
            None => rx.recv_timeout(Duration::from_secs(10)).expect("the receive completed"),
        };
        sender.join().unwrap();
        let want = if polls { me.as_str() } else { "rdev-shm-progress" };
        assert_eq!(thread, want, "step {step}: completed on the wrong thread");
        if polls {
            assert!(polled() > before, "step {step}: polled_writes did not count the write");
        }
        node.step_done(step);
    }
}

#[derive(Clone, Copy)]
struct Ctx(*mut rdev_context);
// SAFETY: a context may be used from any thread (the C ABI's contract).
unsafe impl Send for Ctx {}
// SAFETY: as above.
unsafe impl Sync for Ctx {}

/// Caller-driven progress under contention: two ping-pong pairs on the
/// same two contexts (two threads of each polling at once, beside the
/// progress threads, with gaps that land writes inside and outside the
/// poll window). Every round trip carries its bytes, none is lost, and
/// none waits on the progress thread's 200 ms timer (a lost doorbell).
#[test]
fn ping_pongs_with_polling_waiters_lose_no_write() {
    let (pa, pb) = (free_port(), free_port());
    let (ta, tb) = (task(0), task(1));
    let (a, b) = (Ctx(new_ctx(&ta, &addr(pa))), Ctx(new_ctx(&tb, &addr(pb))));
    add_peer(a.0, &tb, &addr(pb));
    add_peer(b.0, &ta, &addr(pa));
    const ROUNDS: u64 = 300;
    let send = |c: Ctx, peer: &str, key: &str, step: u64, data: &[u8]| {
        let dims = [data.len() as i64];
        let meta = rdev_tensor_meta { dtype: 4, flags: 0, ndims: 1, dims: dims.as_ptr() };
        // SAFETY: valid context, strings and meta; `data` lives until the
        // end of the test (a first send queues while it connects).
        let st = unsafe { rdev_send(c.0, peer.as_ptr().cast(), peer.len(), key.as_ptr().cast(), key.len(), step, &meta, data.as_ptr(), data.len(), Some(sent), std::ptr::null_mut()) };
        assert_eq!(st, rdev_status::RDEV_OK, "{}", last_error());
    };
    let recv = |c: Ctx, peer: &str, key: &str, step: u64, want: &[u8]| -> Duration {
        let w = waitable(c.0, peer, key, step);
        let t0 = Instant::now();
        let (st, buf) = wait(w, 10_000);
        let took = t0.elapsed();
        assert_eq!(st, rdev_status::RDEV_OK, "{key} step {step}: {}", last_error());
        // SAFETY: a buffer the wait handed us; released and freed once.
        unsafe {
            assert_eq!(std::slice::from_raw_parts(rdev_buffer_data(buf), rdev_buffer_len(buf)), want, "{key} step {step}");
            rdev_buffer_release(buf);
            rdev_waiter_free(w);
        }
        took
    };
    // Every payload, made before and dropped after the exchange.
    let payloads = |seed: u64, sized: bool| -> Vec<Vec<u8>> { (0..=ROUNDS).map(|i| pattern(i + seed, if sized { 64 + (i as usize % 7) * 512 } else { 64 })).collect() };
    let (pings, pongs) = (payloads(0, true), payloads(1000, false));
    let (pings, pongs) = (&pings, &pongs);
    let gap = |i: u64| Duration::from_micros([0, 0, 10, 80, 400, 3000][(i % 6) as usize]);
    let slowest = std::thread::scope(|s| {
        let mut hs = Vec::new();
        for pair in ["x", "y"] {
            let (ping, pong) = (format!("ping-{pair}"), format!("pong-{pair}"));
            let (ta2, tb2) = (ta.clone(), tb.clone());
            let (ping2, pong2) = (ping.clone(), pong.clone());
            hs.push(s.spawn(move || {
                let mut slowest = Duration::ZERO;
                for i in 1..=ROUNDS {
                    send(a, &tb2, &ping2, i, &pings[i as usize]);
                    slowest = slowest.max(recv(a, &tb2, &pong2, i, &pongs[i as usize]));
                    std::thread::sleep(gap(i));
                }
                slowest
            }));
            hs.push(s.spawn(move || {
                let mut slowest = Duration::ZERO;
                for i in 1..=ROUNDS {
                    slowest = slowest.max(recv(b, &ta2, &ping, i, &pings[i as usize]));
                    std::thread::sleep(gap(i + 3));
                    send(b, &ta2, &pong, i, &pongs[i as usize]);
                }
                slowest
            }));
        }
        hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    // Waits include the partner's gaps (at most 3 ms each) and scheduling
    // on a busy host; a lost doorbell costs the 200 ms timer.
    let worst = slowest.iter().max().copied().unwrap();
    assert!(worst < Duration::from_millis(150), "a wait took {worst:?}: {slowest:?}");
    // SAFETY: contexts from rdev_context_new, freed once.
    unsafe {
        rdev_context_free(a.0);
        rdev_context_free(b.0);
    }
}
