//! The C ABI: every `extern "C"` function of the library lives here.
//!
//! Conventions (see include/rdma_device.h):
//! - Every function runs inside one panic boundary ([`boundary`]); a panic
//!   becomes `RDEV_PANIC`, never an unwind into C or an abort.
//! - Errors are `rdev_status` values; details via `rdev_last_error`
//!   (thread-local: the message of the last failed call on this thread).
//! - Opaque handles: `rdev_*_new(..., out)` writes `*out` only on success;
//!   `rdev_*_free(NULL)` / `rdev_buffer_release(NULL)` are no-ops.
//! - Strings are (pointer, length) pairs, UTF-8, not NUL-terminated.
//! - Callbacks run exactly once, on the calling thread or on a library
//!   thread; no library lock is held while they run, so they may call back
//!   into the library. They must not block for long, and callbacks must
//!   not call blocking rdev_* functions (`rdev_context_new`,
//!   `rdev_context_free`, `rdev_place_edge`, `rdev_request_placement`,
//!   `rdev_connect_peer`): they may run on a progress thread, which never
//!   waits.

#![allow(non_camel_case_types)]
#![allow(clippy::missing_safety_doc)] // each function documents its contract in the header

#[macro_use]
mod args;
pub mod buffer;
mod collective;
mod introspect;
mod status;
mod trace;
mod rpc;
mod routes;
pub use routes::{
    rdev_connect_peer, rdev_context_add_peer, rdev_context_set_peer, rdev_grpc_fallback, rdev_place_edge, rdev_request_placement, rdev_route, rdev_route_kind, rdev_settings,
    rdev_settings_get, rdev_transport,
};
mod wait;

use std::cell::RefCell;
use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::completion::{Complete, Recycler, KEPT};
use crate::config::Config;
use crate::error::Error;
use crate::node::{Lease, Node};
use crate::rendezvous::Payload;
pub use status::rdev_status;
pub use introspect::rdev_last_error;
pub use wait::{rdev_recv_waitable, rdev_wait, rdev_waiter, rdev_waiter_free};

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
    /// While a receive's callback runs with a peer's failure: its code.
    static ABORT_CAUSE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

fn set_last_error(msg: String) {
    LAST_ERROR.with(|l| *l.borrow_mut() = msg);
}

/// Run `f`, turning errors into a status (with the message recorded) and
/// panics into `RDEV_PANIC`.
fn boundary(f: impl FnOnce() -> Result<(), Error>) -> rdev_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => rdev_status::RDEV_OK,
        Ok(Err(e)) => {
            let s = status::from_error(&e);
            set_last_error(e.to_string());
            s
        }
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(format!("internal panic in rdma_device: {what}"));
            rdev_status::RDEV_PANIC
        }
    }
}

/// Bits of `rdev_tensor_meta.flags`. Values never change.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum rdev_flag {
    /// Dead tensor (a not-taken branch): no payload.
    RDEV_FLAG_DEAD = 1,
    /// The payload is an opaque serialization (strings, variants).
    RDEV_FLAG_SERIALIZED = 2,
}

const _: () = assert!(rdev_flag::RDEV_FLAG_DEAD as u32 == crate::rendezvous::FLAG_DEAD);
const _: () = assert!(rdev_flag::RDEV_FLAG_SERIALIZED as u32 == crate::rendezvous::FLAG_SERIALIZED);

/// dtype (TensorFlow's DataType value, opaque to the library), flags
/// (RDEV_FLAG_*), and shape (`ndims` entries at `dims`; at most 24 take the
/// fast path, more go through a slower chunked path).
#[repr(C)]
pub struct rdev_tensor_meta {
    pub dtype: u32,
    pub flags: u32,
    pub ndims: u32,
    pub dims: *const i64,
}

/// One task's transport (one per TensorFlow server).
pub struct rdev_context {
    node: Node,
}

/// A received tensor. Its bytes stay valid until `rdev_buffer_release`.
pub struct rdev_buffer {
    /// `None` only while the box waits in `BUFFERS` for reuse.
    lease: Option<Lease>,
}

// Per-tensor objects of the C ABI, reused rather than allocated anew for
// every tensor (see `completion`).
// Buffer boxes are never freed (all are kept, so the memory is the most
// tensors ever held at once, a few dozen bytes each): a box released twice
// is then still a box, and `rdev_buffer_release` can tell.
static BUFFERS: Recycler<rdev_buffer> = Recycler::new(usize::MAX);
static PAYLOADS: Recycler<RawPayload> = Recycler::new(KEPT);
static SEND_DONES: Recycler<SendCb> = Recycler::new(KEPT);
static RECV_DONES: Recycler<RecvCb> = Recycler::new(KEPT);

/// `rdev_send`'s callback as a completion.
struct SendCb {
    cb: rdev_send_done_cb,
    ud: UserData,
}

impl Complete<Result<(), Error>> for SendCb {
    fn complete(self: Box<Self>, r: Result<(), Error>) {
        let (cb, ud) = (self.cb, UserData(self.ud.0));
        SEND_DONES.recycle(self);
        call_send_cb(cb, ud, r);
    }
}

/// `rdev_recv`'s callback as a completion.
struct RecvCb {
    cb: unsafe extern "C" fn(*mut c_void, rdev_status, *const c_char, usize, *mut rdev_buffer),
    ud: UserData,
    /// `rdev_recv_inline`: a success may run on the event thread.
    on_event_thread: bool,
}

impl Complete<Result<Lease, Error>> for RecvCb {
    fn event_thread_ok(&self) -> bool {
        self.on_event_thread
    }

    fn complete(self: Box<Self>, r: Result<Lease, Error>) {
        let (cb, ud) = (self.cb, self.ud.0);
        RECV_DONES.recycle(self);
        match r {
            Ok(lease) => {
                let b = Box::into_raw(BUFFERS.boxed(rdev_buffer { lease: Some(lease) }));
                // SAFETY: caller-provided callback; buffer ownership passes to it.
                unsafe { cb(ud, rdev_status::RDEV_OK, std::ptr::null(), 0, b) };
            }
            Err(e) => {
                let msg = e.to_string();
                let cause = if let Error::PeerFailed(code, _) = e { code } else { 0 };
                ABORT_CAUSE.with(|c| c.set(cause));
                // SAFETY: caller-provided callback; msg lives for the call.
                unsafe { cb(ud, status::from_error(&e), msg.as_ptr().cast(), msg.len(), std::ptr::null_mut()) };
                ABORT_CAUSE.with(|c| c.set(0));
            }
        }
    }
}

/// Called from inside a receive's callback that got RDEV_ABORTED: the
/// TensorFlow error code of the failure the sending peer aborted the step
/// for (what it passed to `rdev_abort_step`), or 0 when the step was
/// aborted here, or by a peer that gave no code. 0 outside such a
/// callback. The code comes from the peer as is: check its range.
#[no_mangle]
pub extern "C" fn rdev_abort_cause() -> u32 {
    ABORT_CAUSE.with(|c| c.get())
}

/// Completion of `rdev_send`: `status` RDEV_OK once the data may be reused,
/// or an error (message `msg`, `msg_len` bytes, valid during the call).
pub type rdev_send_done_cb =
    Option<unsafe extern "C" fn(userdata: *mut c_void, status: rdev_status, msg: *const c_char, msg_len: usize)>;

/// Completion of `rdev_recv`: on RDEV_OK `buf` is a new buffer owned by the
/// callee (release it with `rdev_buffer_release`); on error `buf` is NULL
/// and `msg`/`msg_len` say why (valid during the call).
pub type rdev_recv_done_cb = Option<
    unsafe extern "C" fn(userdata: *mut c_void, status: rdev_status, msg: *const c_char, msg_len: usize, buf: *mut rdev_buffer),
>;

struct UserData(*mut c_void);
// SAFETY: the caller promises the userdata may be used from any thread
// (documented on every callback-taking function).
unsafe impl Send for UserData {}

struct RawPayload {
    ptr: *const u8,
    len: usize,
}
// SAFETY: the caller of rdev_send keeps the bytes valid and unmodified
// until the completion callback runs.
unsafe impl Send for RawPayload {}
// SAFETY: as above; only read.
unsafe impl Sync for RawPayload {}

impl Payload for RawPayload {
    fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: see the Send impl: valid for the whole send.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    fn release(self: Box<Self>) {
        PAYLOADS.recycle(self);
    }
}

fn call_send_cb(cb: rdev_send_done_cb, ud: UserData, r: Result<(), Error>) {
    let Some(cb) = cb else { return };
    let (st, msg) = match r {
        Ok(()) => (rdev_status::RDEV_OK, String::new()),
        Err(e) => (status::from_error(&e), e.to_string()),
    };
    // SAFETY: the callback and its userdata come from the caller, who
    // promised they are valid until called.
    unsafe { cb(ud.0, st, msg.as_ptr().cast(), msg.len()) };
}

/// Create the transport for task `task` (e.g. "/job:worker/replica:0/task:0")
/// serving at `addr` ("host:port", the task's address in the cluster spec).
/// Reads `RDMA_DEVICE_*` settings from the environment; a bad value fails
/// with RDEV_CONFIG naming the variable.
#[no_mangle]
pub unsafe extern "C" fn rdev_context_new(
    task: *const c_char,
    task_len: usize,
    addr: *const c_char,
    addr_len: usize,
    out: *mut *mut rdev_context,
) -> rdev_status {
    boundary(|| {
        let task = text!(task, task_len, "task");
        let addr = text!(addr, addr_len, "addr");
        let out = out!(out);
        let cfg = Config::from_env()?;
        let node = Node::new(cfg, task, addr)?;
        out.write(Box::into_raw(Box::new(rdev_context { node })));
        Ok(())
    })
}

/// Destroy a context: pending receives and queued sends fail with
/// RDEV_ABORTED; connections close. NULL is a no-op. Buffers still held
/// stay readable until released. Those failed operations' callbacks may
/// run after this returns (on the transport's callback thread, never on
/// the caller's): keep what their user data points to alive until each
/// has run; every callback runs exactly once.
#[no_mangle]
pub unsafe extern "C" fn rdev_context_free(ctx: *mut rdev_context) {
    let _ = boundary(|| {
        if !ctx.is_null() {
            // SAFETY: ctx came from rdev_context_new and is freed once.
            drop(unsafe { Box::from_raw(ctx) });
        }
        Ok(())
    });
}

/// Push the tensor `(key, step_id)` to `peer`. Never blocks: it does not
/// connect or wait for ring space on the caller's thread (a first send to a
/// peer queues while a transport thread connects). `data`/`len` must stay
/// valid and unmodified until `cb` runs. If this returns RDEV_OK, `cb` runs
/// exactly once (possibly before this returns, possibly on a transport
/// thread); on any other status `cb` is never called and nothing was sent.
/// RDEV_NOT_VIABLE, returned here or given to `cb`, means the peer does not
/// take this transport from us (it runs plain gRPC, or routes this task
/// over gRPC): the caller may send the tensor another way, and the peer is
/// routed over gRPC from then on. `cb` must not call blocking `rdev_*`
/// functions (connect, placement).
#[no_mangle]
pub unsafe extern "C" fn rdev_send(
    ctx: *const rdev_context,
    peer: *const c_char,
    peer_len: usize,
    key: *const c_char,
    key_len: usize,
    step_id: u64,
    meta: *const rdev_tensor_meta,
    data: *const u8,
    len: usize,
    cb: rdev_send_done_cb,
    userdata: *mut c_void,
) -> rdev_status {
    boundary(|| {
        let c = ctx!(ctx);
        let peer = text!(peer, peer_len, "peer");
        let key = text!(key, key_len, "key");
        let meta = meta!(meta);
        // Valid until `cb` runs, not only during the call: kept as a pointer.
        let data = bytes!(data, len, "data");
        let ud = UserData(userdata);
        c.node.send(
            peer,
            key,
            step_id,
            meta,
            PAYLOADS.boxed(RawPayload { ptr: data.as_ptr(), len: data.len() }),
            SEND_DONES.boxed(SendCb { cb, ud }),
        )
    })
}

/// Receive the tensor `(key, step_id)` from `peer`. Never blocks. If this
/// returns RDEV_OK, `cb` runs exactly once (possibly before this returns,
/// possibly on a transport thread): with a buffer, or with an error (peer
/// lost, step aborted, context freed; RDEV_NOT_VIABLE when the peer does
/// not push to us, so the tensor must be fetched another way). `cb` must
/// not call blocking `rdev_*` functions (connect, placement).
#[no_mangle]
pub unsafe extern "C" fn rdev_recv(
    ctx: *const rdev_context,
    peer: *const c_char,
    peer_len: usize,
    key: *const c_char,
    key_len: usize,
    step_id: u64,
    cb: rdev_recv_done_cb,
    userdata: *mut c_void,
) -> rdev_status {
    // SAFETY: the caller's contract is rdev_recv's.
    unsafe { recv_as(ctx, peer, peer_len, key, key_len, step_id, cb, userdata, false) }
}

/// `rdev_recv`, for a callback fit to run on the transport's event thread
/// (the thread that saw the tensor land: shm progress or reader thread,
/// verbs completion thread). "Inline" in this name, `rdev_call_inline`'s
/// and `rdev_serve_inline`'s means exactly that: on the event thread,
/// without the hop to `rdev-callbacks` (it has nothing to do with the
/// `inline_tensors` counter, which counts streamed tensors). A successful
/// receive's `cb` then runs there, which saves a thread wake-up per tensor;
/// a failed one still runs on `rdev-callbacks`, the calling thread, or
/// where `rdev_recv` says. The caller promises that `cb` returns promptly
/// (microseconds: no waiting, no I/O, no copy of the tensor) and calls only
/// the functions that never block (`rdev_send`, `rdev_recv*`,
/// `rdev_buffer_release`, `rdev_step_done`, `rdev_step_idle`,
/// `rdev_step_active`, `rdev_abort_step`, `rdev_cancel_recv`, and
/// `rdev_context_free`): it delays every other completion that thread
/// handles while it runs.
#[no_mangle]
pub unsafe extern "C" fn rdev_recv_inline(
    ctx: *const rdev_context,
    peer: *const c_char,
    peer_len: usize,
    key: *const c_char,
    key_len: usize,
    step_id: u64,
    cb: rdev_recv_done_cb,
    userdata: *mut c_void,
) -> rdev_status {
    // SAFETY: the caller's contract is rdev_recv's.
    unsafe { recv_as(ctx, peer, peer_len, key, key_len, step_id, cb, userdata, true) }
}

/// `rdev_recv` and `rdev_recv_inline`: `on_event_thread` says whether a
/// successful completion may run on the event thread.
#[allow(clippy::too_many_arguments)]
unsafe fn recv_as(
    ctx: *const rdev_context,
    peer: *const c_char,
    peer_len: usize,
    key: *const c_char,
    key_len: usize,
    step_id: u64,
    cb: rdev_recv_done_cb,
    userdata: *mut c_void,
    on_event_thread: bool,
) -> rdev_status {
    boundary(|| {
        let c = ctx!(ctx);
        let peer = text!(peer, peer_len, "peer");
        let key = text!(key, key_len, "key");
        let cb = callback!(cb, "callback");
        c.node.recv(peer, key, step_id, RECV_DONES.boxed(RecvCb { cb, ud: UserData(userdata), on_event_thread }));
        Ok(())
    })
}

/// The step is over: unclaimed arrivals for it are released and late
/// pushes for it dropped.
#[no_mangle]
pub unsafe extern "C" fn rdev_step_done(ctx: *const rdev_context, step_id: u64) -> rdev_status {
    boundary(|| {
        ctx!(ctx).node.step_done(step_id);
        Ok(())
    })
}

/// The last object of the step on this task is gone, but the step may go
/// on: an object made for it later (`rdev_step_active`) finds what peers
/// pushed for it meanwhile. The step ends at `rdev_step_done`, or after
/// 5 s idle, or when it is the oldest of more than 4096 idle steps. For
/// TensorFlow's rendezvous, which its cache holds weakly and may make
/// again for a step that is still running.
#[no_mangle]
pub unsafe extern "C" fn rdev_step_idle(ctx: *const rdev_context, step_id: u64) -> rdev_status {
    boundary(|| {
        ctx!(ctx).node.step_idle(step_id);
        Ok(())
    })
}

/// An object of the step exists on this task (again): the step is not
/// idle (`rdev_step_idle`). Cheap; a step that already ended stays ended.
#[no_mangle]
pub unsafe extern "C" fn rdev_step_active(ctx: *const rdev_context, step_id: u64) -> rdev_status {
    boundary(|| {
        ctx!(ctx).node.step_active(step_id);
        Ok(())
    })
}

/// Abort a step: its pending receives and queued sends fail with
/// RDEV_ABORTED carrying `msg`. With `propagate`, every connected peer is
/// told, and fails its pending and later receives of this step from this
/// task (a pushed tensor never comes once its sender aborted): with
/// RDEV_ABORTED, and `code` (the TensorFlow error code of the failure that
/// made this task abort; 0: none) from `rdev_abort_cause` in their
/// callbacks. Pass false for TensorFlow's normal end-of-step cleanup.
#[no_mangle]
pub unsafe extern "C" fn rdev_abort_step(
    ctx: *const rdev_context,
    step_id: u64,
    code: u32,
    msg: *const c_char,
    msg_len: usize,
    propagate: bool,
) -> rdev_status {
    boundary(|| {
        let c = ctx!(ctx);
        let m = text!(msg, msg_len, "msg");
        c.node.abort_step_caused(step_id, code, Error::Aborted(m.to_string()), propagate);
        Ok(())
    })
}

/// Cancel the one receive of `(key, step_id)`: if it still waits, its
/// callback runs with RDEV_ABORTED carrying `msg` (on this thread or a
/// transport thread); otherwise nothing happens. Unlike `rdev_abort_step`
/// the step goes on: its other receives and sends are untouched and no
/// peer is told. A tensor that arrives for the cancelled receive later is
/// released at once; a new receive of the same key and step waits for it
/// again. For a step that lives long (an eager context's), where one
/// cancelled operation must not fail the rest.
#[no_mangle]
pub unsafe extern "C" fn rdev_cancel_recv(
    ctx: *const rdev_context,
    key: *const c_char,
    key_len: usize,
    step_id: u64,
    msg: *const c_char,
    msg_len: usize,
) -> rdev_status {
    boundary(|| {
        let c = ctx!(ctx);
        let key = text!(key, key_len, "key");
        let m = text!(msg, msg_len, "msg");
        c.node.cancel_recv(key, step_id, Error::Aborted(m.to_string()));
        Ok(())
    })
}

/// Abort everything pending (e.g. server shutdown).
#[no_mangle]
pub unsafe extern "C" fn rdev_abort_all(ctx: *const rdev_context, msg: *const c_char, msg_len: usize) -> rdev_status {
    boundary(|| {
        let c = ctx!(ctx);
        let m = text!(msg, msg_len, "msg");
        c.node.abort_all(Error::Aborted(m.to_string()));
        Ok(())
    })
}

/// Drop every connection with `peer`; its pending receives fail.
#[no_mangle]
pub unsafe extern "C" fn rdev_abort_peer(ctx: *const rdev_context, peer: *const c_char, peer_len: usize) -> rdev_status {
    boundary(|| {
        let c = ctx!(ctx);
        let p = text!(peer, peer_len, "peer");
        c.node.abort_peer(p);
        Ok(())
    })
}

