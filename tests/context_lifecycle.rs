//! A context's life through the C ABI, as the TensorFlow shim drives it:
//! one receive cancelled alone (`rdev_cancel_recv`, the eager context's
//! receives), and a context freed from inside one of its own callbacks
//! (the shim's last reference to its transport can drop there), and
//! receives whose callbacks run on the event thread (`rdev_recv_inline`).

mod common;

use std::ffi::{c_char, c_void};
use std::sync::mpsc;
use std::time::Duration;

use common::*;
use rdma_device::ffi::buffer::*;
use rdma_device::ffi::*;

/// What a receive callback saw: its status, message and payload checksum.
type Outcome = (rdev_status, String, Option<u64>);

/// A receive's user data: where its outcome goes, and optionally a context
/// the callback frees (the last reference dropped on the callback thread).
struct Rx {
    out: mpsc::Sender<(String, Outcome)>,
    name: String,
    free: Option<*mut rdev_context>,
}

unsafe extern "C" fn received(ud: *mut c_void, st: rdev_status, msg: *const c_char, len: usize, buf: *mut rdev_buffer) {
    // SAFETY: `ud` is the Box<Rx> leaked by `recv`, handed back once.
    let rx = unsafe { Box::from_raw(ud as *mut Rx) };
    let msg = if msg.is_null() {
        String::new()
    } else {
        // SAFETY: a valid (msg, len) for the call.
        String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(msg as *const u8, len) }).into_owned()
    };
    let sum = (!buf.is_null()).then(|| {
        // SAFETY: a live buffer; released right after.
        let b = unsafe { std::slice::from_raw_parts(rdev_buffer_data(buf), rdev_buffer_len(buf)) };
        let s = checksum(b);
        unsafe { rdev_buffer_release(buf) };
        s
    });
    if let Some(c) = rx.free {
        // SAFETY: the test hands each context to one callback, freed once.
        unsafe { rdev_context_free(c) };
    }
    let _ = rx.out.send((rx.name, (st, msg, sum)));
}

fn recv(c: *mut rdev_context, peer: &str, key: &str, step: u64, out: &mpsc::Sender<(String, Outcome)>, free: Option<*mut rdev_context>) {
    let ud = Box::into_raw(Box::new(Rx { out: out.clone(), name: format!("{key}@{step}"), free }));
    // SAFETY: valid context and strings; `ud` lives until the callback.
    let st = unsafe { rdev_recv(c, peer.as_ptr().cast(), peer.len(), key.as_ptr().cast(), key.len(), step, Some(received), ud.cast()) };
    assert_eq!(st, rdev_status::RDEV_OK);
}

unsafe extern "C" fn sent(ud: *mut c_void, st: rdev_status, _: *const c_char, _: usize) {
    // SAFETY: `ud` is the Box leaked by `send`, handed back once.
    let tx = unsafe { Box::from_raw(ud as *mut mpsc::Sender<rdev_status>) };
    let _ = tx.send(st);
}

fn send(c: *mut rdev_context, peer: &str, key: &str, step: u64, data: &[u8], done: &mpsc::Sender<rdev_status>) {
    let dims = [data.len() as i64];
    let meta = rdev_tensor_meta { dtype: 4, flags: 0, ndims: 1, dims: dims.as_ptr() };
    let ud = Box::into_raw(Box::new(done.clone()));
    // SAFETY: valid context, strings, meta; `data` outlives the send (its
    // completion is waited for by the caller).
    let st = unsafe { rdev_send(c, peer.as_ptr().cast(), peer.len(), key.as_ptr().cast(), key.len(), step, &meta, data.as_ptr(), data.len(), Some(sent), ud.cast()) };
    assert_eq!(st, rdev_status::RDEV_OK);
}

fn next(rx: &mpsc::Receiver<(String, Outcome)>) -> (String, Outcome) {
    rx.recv_timeout(Duration::from_secs(10)).expect("a receive completes within 10 s")
}

#[test]
fn a_cancelled_receive_fails_alone_and_its_step_goes_on() {
    let (pa, pb) = (free_port(), free_port());
    let (ta, tb) = (task(0), task(1));
    let (a, b) = (new_ctx(&ta, &addr(pa)), new_ctx(&tb, &addr(pb)));
    add_peer(a, &tb, &addr(pb));
    add_peer(b, &ta, &addr(pa));
    let (out, got) = mpsc::channel();
    let (done, sends) = mpsc::channel();
    recv(b, &ta, "x", 5, &out, None);
    recv(b, &ta, "y", 5, &out, None);
    let why = "CANCELLED: the op was cancelled";
    // SAFETY: valid context and strings.
    let st = unsafe { rdev_cancel_recv(b, "x".as_ptr().cast(), 1, 5, why.as_ptr().cast(), why.len()) };
    assert_eq!(st, rdev_status::RDEV_OK);
    let (name, (st, msg, sum)) = next(&got);
    assert_eq!((name.as_str(), st, sum), ("x@5", rdev_status::RDEV_ABORTED, None));
    assert!(msg.contains(why), "{msg}");
    // Both tensors are sent: y's receive gets its bytes (the step was not
    // aborted), x's is released on arrival, and nothing else completes.
    let (dx, dy) = (pattern(1, 4096), pattern(2, 1 << 16));
    send(a, &tb, "x", 5, &dx, &done);
    send(a, &tb, "y", 5, &dy, &done);
    for _ in 0..2 {
        assert_eq!(sends.recv_timeout(Duration::from_secs(10)).unwrap(), rdev_status::RDEV_OK);
    }
    let (name, (st, _, sum)) = next(&got);
    assert_eq!((name.as_str(), st, sum), ("y@5", rdev_status::RDEV_OK, Some(checksum(&dy))));
    assert!(got.recv_timeout(Duration::from_millis(300)).is_err(), "the cancelled receive completed twice");
    // x's edge still works in the next step.
    recv(b, &ta, "x", 6, &out, None);
    send(a, &tb, "x", 6, &dx, &done);
    assert_eq!(sends.recv_timeout(Duration::from_secs(10)).unwrap(), rdev_status::RDEV_OK);
    let (name, (st, _, sum)) = next(&got);
    assert_eq!((name.as_str(), st, sum), ("x@6", rdev_status::RDEV_OK, Some(checksum(&dx))));
    // SAFETY: each freed once, after every callback ran.
    unsafe {
        rdev_context_free(a);
        rdev_context_free(b);
    }
}

#[test]
fn a_context_freed_inside_its_own_callback_fails_the_rest_once_and_hangs_nothing() {
    let (pa, pb) = (free_port(), free_port());
    let (ta, tb) = (task(0), task(1));
    let (a, b) = (new_ctx(&ta, &addr(pa)), new_ctx(&tb, &addr(pb)));
    add_peer(a, &tb, &addr(pb));
    add_peer(b, &ta, &addr(pa));
    let (out, got) = mpsc::channel();
    let (done, sends) = mpsc::channel();
    // The first receive's callback frees b; three more wait on b.
    recv(b, &ta, "first", 1, &out, Some(b));
    for k in ["p", "q", "r"] {
        recv(b, &ta, k, 1, &out, None);
    }
    let data = pattern(3, 1 << 20);
    send(a, &tb, "first", 1, &data, &done);
    assert_eq!(sends.recv_timeout(Duration::from_secs(10)).unwrap(), rdev_status::RDEV_OK);
    // Every receive completes exactly once: the first with its bytes, the
    // others failed by the free (their callbacks may run inside the first
    // one's, on the same thread, before it reports).
    let mut seen: Vec<(String, Outcome)> = (0..4).map(|_| next(&got)).collect();
    assert!(got.recv_timeout(Duration::from_millis(300)).is_err(), "a callback ran twice: {seen:?}");
    seen.sort_by(|x, y| x.0.cmp(&y.0));
    let names: Vec<&str> = seen.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["first@1", "p@1", "q@1", "r@1"]);
    assert_eq!((seen[0].1 .0, seen[0].1 .2), (rdev_status::RDEV_OK, Some(checksum(&data))));
    for (name, (st, msg, _)) in &seen[1..] {
        assert_eq!(*st, rdev_status::RDEV_ABORTED, "{name}: {msg}");
    }
    // The sender sees its peer go, and a fresh context at b's address
    // works with it again.
    let b2 = new_ctx(&tb, &addr(pb));
    add_peer(b2, &ta, &addr(pa));
    recv(b2, &ta, "again", 2, &out, None);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        send(a, &tb, "again", 2, &data, &done);
        let st = sends.recv_timeout(Duration::from_secs(10)).unwrap();
        if st == rdev_status::RDEV_OK {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no send reached the new context: {st:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (name, (st, _, sum)) = next(&got);
    assert_eq!((name.as_str(), st, sum), ("again@2", rdev_status::RDEV_OK, Some(checksum(&data))));
    // SAFETY: each freed once.
    unsafe {
        rdev_context_free(a);
        rdev_context_free(b2);
    }
}

/// Where an `rdev_recv_inline` callback ran, and what it got.
struct Where {
    out: WhereTx,
    name: String,
    free: Option<*mut rdev_context>,
}

unsafe extern "C" fn received_where(ud: *mut c_void, st: rdev_status, _: *const c_char, _: usize, buf: *mut rdev_buffer) {
    // SAFETY: `ud` is the Box<Where> leaked by `recv_inline`, handed back once.
    let w = unsafe { Box::from_raw(ud as *mut Where) };
    let thread = std::thread::current().name().unwrap_or("?").to_string();
    let event = rdma_device::fabric::on_event_thread();
    let sum = (!buf.is_null()).then(|| {
        // SAFETY: a live buffer; released right after, here.
        let b = unsafe { std::slice::from_raw_parts(rdev_buffer_data(buf), rdev_buffer_len(buf)) };
        let s = checksum(b);
        unsafe { rdev_buffer_release(buf) };
        s
    });
    if let Some(c) = w.free {
        // SAFETY: the test hands each context to one callback, freed once.
        unsafe { rdev_context_free(c) };
    }
    let _ = w.out.send((w.name, st, event, thread, sum));
}

type WhereTx = mpsc::Sender<(String, rdev_status, bool, String, Option<u64>)>;

fn recv_where(c: *mut rdev_context, peer: &str, key: &str, step: u64, out: &WhereTx, free: Option<*mut rdev_context>, inline: bool) {
    let ud = Box::into_raw(Box::new(Where { out: out.clone(), name: format!("{key}@{step}"), free }));
    let f = if inline { rdev_recv_inline } else { rdev_recv };
    // SAFETY: valid context and strings; `ud` lives until the callback.
    let st = unsafe { f(c, peer.as_ptr().cast(), peer.len(), key.as_ptr().cast(), key.len(), step, Some(received_where), ud.cast()) };
    assert_eq!(st, rdev_status::RDEV_OK);
}

fn recv_inline(c: *mut rdev_context, peer: &str, key: &str, step: u64, out: &WhereTx, free: Option<*mut rdev_context>) {
    recv_where(c, peer, key, step, out, free, true)
}

#[test]
fn an_inline_receive_completes_on_the_event_thread_a_failed_one_does_not_and_freeing_there_hangs_nothing() {
    let (pa, pb) = (free_port(), free_port());
    let (ta, tb) = (task(0), task(1));
    let (a, b) = (new_ctx(&ta, &addr(pa)), new_ctx(&tb, &addr(pb)));
    add_peer(a, &tb, &addr(pb));
    add_peer(b, &ta, &addr(pa));
    let (out, got) = mpsc::channel();
    let (done, sends) = mpsc::channel();
    let next_where = || got.recv_timeout(Duration::from_secs(10)).expect("a receive completes within 10 s");
    // Posted before the tensor lands, small and large (a written slot, or
    // streamed): the callback runs on the thread that saw it land.
    for (step, len) in [(1u64, 4096usize), (2, 1 << 20)] {
        recv_inline(b, &ta, "x", step, &out, None);
        let data = pattern(step, len);
        send(a, &tb, "x", step, &data, &done);
        assert_eq!(sends.recv_timeout(Duration::from_secs(10)).unwrap(), rdev_status::RDEV_OK);
        let (name, st, event, thread, sum) = next_where();
        assert_eq!((name, st, sum), (format!("x@{step}"), rdev_status::RDEV_OK, Some(checksum(&data))));
        assert!(event, "an inline receive's callback ran on {thread}, not on an event thread");
    }
    // A plain receive's callback never runs there (rdev-callbacks).
    recv_where(b, &ta, "x", 3, &out, None, false);
    let data = pattern(3, 4096);
    send(a, &tb, "x", 3, &data, &done);
    assert_eq!(sends.recv_timeout(Duration::from_secs(10)).unwrap(), rdev_status::RDEV_OK);
    let (name, st, event, thread, sum) = next_where();
    assert_eq!((name.as_str(), st, sum), ("x@3", rdev_status::RDEV_OK, Some(checksum(&data))));
    assert!(!event && thread == "rdev-callbacks", "a plain receive's callback ran on {thread}");
    // A receive failed by an event (the sender aborts its step, the abort
    // arrives as a message) is handed to rdev-callbacks all the same.
    recv_inline(b, &ta, "y", 4, &out, None);
    let why = "the sender gave up";
    // SAFETY: valid context and strings.
    assert_eq!(unsafe { rdev_abort_step(a, 4, 3, why.as_ptr().cast(), why.len(), true) }, rdev_status::RDEV_OK);
    let (name, st, event, thread, _) = next_where();
    assert_eq!((name.as_str(), st), ("y@4", rdev_status::RDEV_ABORTED));
    assert!(!event && thread == "rdev-callbacks", "a failed inline receive ran on {thread}");
    // Freeing the context inside an inline callback, on the event thread
    // (the shim's last reference to its transport can drop there): the
    // other receive fails once, nothing hangs, and a new context at the
    // same address works with the same peer.
    recv_inline(b, &ta, "first", 5, &out, Some(b));
    recv_inline(b, &ta, "other", 5, &out, None);
    let data = pattern(9, 1 << 16);
    send(a, &tb, "first", 5, &data, &done);
    assert_eq!(sends.recv_timeout(Duration::from_secs(10)).unwrap(), rdev_status::RDEV_OK);
    let mut seen = [next_where(), next_where()];
    assert!(got.recv_timeout(Duration::from_millis(300)).is_err(), "a callback ran twice: {:?}", seen.len());
    seen.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!((seen[0].0.as_str(), seen[0].1, seen[0].4), ("first@5", rdev_status::RDEV_OK, Some(checksum(&data))));
    assert!(seen[0].2, "the freeing callback ran on {}", seen[0].3);
    assert_eq!((seen[1].0.as_str(), seen[1].1), ("other@5", rdev_status::RDEV_ABORTED));
    let b2 = new_ctx(&tb, &addr(pb));
    add_peer(b2, &ta, &addr(pa));
    recv_inline(b2, &ta, "again", 6, &out, None);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        send(a, &tb, "again", 6, &data, &done);
        if sends.recv_timeout(Duration::from_secs(10)).unwrap() == rdev_status::RDEV_OK {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no send reached the new context");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (name, st, _, _, sum) = next_where();
    assert_eq!((name.as_str(), st, sum), ("again@6", rdev_status::RDEV_OK, Some(checksum(&data))));
    // SAFETY: each freed once.
    unsafe {
        rdev_context_free(a);
        rdev_context_free(b2);
    }
}

unsafe extern "C" fn received_cause(ud: *mut c_void, st: rdev_status, _: *const c_char, _: usize, buf: *mut rdev_buffer) {
    // SAFETY: `ud` is the Box leaked by the test, handed back once.
    let out = unsafe { Box::from_raw(ud as *mut mpsc::Sender<(rdev_status, u32)>) };
    // SAFETY: a live buffer or NULL.
    unsafe { rdev_buffer_release(buf) };
    let _ = out.send((st, rdev_abort_cause()));
}

/// A step aborted with the TensorFlow code of its failure (`rdev_abort_step`'s
/// `code`) fails the peer's receives of that step from it with RDEV_ABORTED
/// and that code from `rdev_abort_cause` inside the callback: a receive
/// already waiting and one made after the abort arrived alike. An abort
/// with no code (0), and any receive outside such a callback, read 0.
#[test]
fn a_peers_abort_carries_the_code_of_its_failure_to_the_receives_it_fails() {
    let (pa, pb) = (free_port(), free_port());
    let (ta, tb) = (task(0), task(1));
    let (a, b) = (new_ctx(&ta, &addr(pa)), new_ctx(&tb, &addr(pb)));
    add_peer(a, &tb, &addr(pb));
    add_peer(b, &ta, &addr(pa));
    let (out, got) = mpsc::channel::<(rdev_status, u32)>();
    let (done, sends) = mpsc::channel();
    let recv_cause = |key: &str, step: u64| {
        let ud = Box::into_raw(Box::new(out.clone()));
        // SAFETY: valid context and strings; `ud` lives until the callback.
        let st = unsafe { rdev_recv(b, ta.as_ptr().cast(), ta.len(), key.as_ptr().cast(), key.len(), step, Some(received_cause), ud.cast()) };
        assert_eq!(st, rdev_status::RDEV_OK);
    };
    let next = || got.recv_timeout(Duration::from_secs(10)).expect("a receive completes within 10 s");
    // A tensor first: the link is up.
    recv_cause("up", 1);
    send(a, &tb, "up", 1, &pattern(1, 4096), &done);
    assert_eq!(sends.recv_timeout(Duration::from_secs(10)).unwrap(), rdev_status::RDEV_OK);
    assert_eq!(next(), (rdev_status::RDEV_OK, 0));
    // INVALID_ARGUMENT (3) on the sender: the waiting receive, then a new one.
    recv_cause("x", 2);
    let why = "INVALID_ARGUMENT: s must be positive";
    // SAFETY: valid context and strings.
    assert_eq!(unsafe { rdev_abort_step(a, 2, 3, why.as_ptr().cast(), why.len(), true) }, rdev_status::RDEV_OK);
    assert_eq!(next(), (rdev_status::RDEV_ABORTED, 3));
    recv_cause("y", 2);
    assert_eq!(next(), (rdev_status::RDEV_ABORTED, 3));
    // No code: aborted, cause 0.
    recv_cause("x", 3);
    // SAFETY: valid context and strings.
    assert_eq!(unsafe { rdev_abort_step(a, 3, 0, why.as_ptr().cast(), why.len(), true) }, rdev_status::RDEV_OK);
    assert_eq!(next(), (rdev_status::RDEV_ABORTED, 0));
    assert_eq!(rdev_abort_cause(), 0, "outside a callback");
    // SAFETY: contexts made here, freed once.
    unsafe {
        rdev_context_free(a);
        rdev_context_free(b);
    }
}
