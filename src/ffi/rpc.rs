//! Calls over the transport (see `node::rpc`): the shim's per-step worker
//! RPCs (RunGraph, CleanupGraph) between tasks that have a link, with
//! TensorFlow's call semantics (codes, cancellation, deadlines).

use std::ffi::{c_char, c_void};
use std::sync::Arc;

use super::{boundary, rdev_context, status, UserData};
use crate::node::rpc::Server;
use crate::stats::Stats;
use status::rdev_status;

/// Outcome of `rdev_call`: `code` 0 (OK) with the response `body`, or
/// TensorFlow's error code with its message in `body` (UTF-8). `body` is
/// valid during the call. Runs exactly once, on the context's callback
/// thread (`rdev-callbacks`), or for `rdev_call_inline` on the event thread
/// that read a successful reply.
#[allow(non_camel_case_types)]
pub type rdev_call_done_cb = Option<unsafe extern "C" fn(userdata: *mut c_void, code: u32, body: *const u8, body_len: usize)>;

/// A call from a peer (`rdev_serve`): answer it exactly once with
/// `rdev_serve_reply(handle, ...)`, from any thread. `body` is valid
/// during the call. Runs on `rdev-callbacks`, or, for a method declared
/// with `rdev_serve_inline`, on the event thread that read the call.
#[allow(non_camel_case_types)]
pub type rdev_serve_call_cb = Option<unsafe extern "C" fn(userdata: *mut c_void, handle: u64, method: u32, body: *const u8, body_len: usize)>;

/// Served call `handle` was cancelled (its caller gave up, or the
/// connection was lost): stop it; its reply goes nowhere. Runs on
/// `rdev-callbacks`.
#[allow(non_camel_case_types)]
pub type rdev_serve_cancel_cb = Option<unsafe extern "C" fn(userdata: *mut c_void, handle: u64)>;

/// Call `method` on `peer` over the transport with `body`; `cb` gets the
/// outcome (UNAVAILABLE when the connection is lost first,
/// DEADLINE_EXCEEDED after `timeout_ms` (0: none; checked every second),
/// CANCELLED after `rdev_call_cancel`). `*out_id` names the call.
/// RDEV_NOT_VIABLE: no connection with `peer` (yet), nothing was sent and
/// `cb` will not run: make the call another way.
#[no_mangle]
pub unsafe extern "C" fn rdev_call(
    ctx: *const rdev_context,
    peer: *const c_char,
    peer_len: usize,
    method: u32,
    body: *const u8,
    body_len: usize,
    timeout_ms: u64,
    cb: rdev_call_done_cb,
    userdata: *mut c_void,
    out_id: *mut u64,
) -> rdev_status {
    // SAFETY: the caller's contract is this function's.
    unsafe { call_as(ctx, peer, peer_len, method, body, body_len, timeout_ms, cb, userdata, out_id, false) }
}

/// `rdev_call`, for a callback fit to run on the transport's event thread
/// (the thread that read the reply; "inline" as in `rdev_recv_inline`): a
/// successful reply of at most 64 KiB then runs `cb` there, one thread
/// wake-up sooner; failures, deadlines, cancellations and larger replies
/// still run it on `rdev-callbacks`. The caller promises what
/// `rdev_recv_inline` asks: `cb` returns within microseconds, waits for
/// nothing and calls only functions that never block.
#[no_mangle]
pub unsafe extern "C" fn rdev_call_inline(
    ctx: *const rdev_context,
    peer: *const c_char,
    peer_len: usize,
    method: u32,
    body: *const u8,
    body_len: usize,
    timeout_ms: u64,
    cb: rdev_call_done_cb,
    userdata: *mut c_void,
    out_id: *mut u64,
) -> rdev_status {
    // SAFETY: the caller's contract is rdev_call's.
    unsafe { call_as(ctx, peer, peer_len, method, body, body_len, timeout_ms, cb, userdata, out_id, true) }
}

/// `rdev_call` and `rdev_call_inline`: `on_event_thread` says whether a
/// successful reply may complete on the event thread.
#[allow(clippy::too_many_arguments)]
unsafe fn call_as(
    ctx: *const rdev_context,
    peer: *const c_char,
    peer_len: usize,
    method: u32,
    body: *const u8,
    body_len: usize,
    timeout_ms: u64,
    cb: rdev_call_done_cb,
    userdata: *mut c_void,
    out_id: *mut u64,
    on_event_thread: bool,
) -> rdev_status {
    boundary(|| {
        let c = ctx!(ctx);
        let peer = text!(peer, peer_len, "peer");
        let cb = callback!(cb, "callback");
        let body = bytes!(body, body_len, "body");
        let out_id = opt_out!(out_id);
        let ud = UserData(userdata);
        let done = Box::new(move |code: u32, reply: Vec<u8>| {
            let ud = ud;
            // SAFETY: the callback and userdata per the caller's contract.
            unsafe { cb(ud.0, code, reply.as_ptr(), reply.len()) };
        });
        let timeout = (timeout_ms > 0).then(|| std::time::Duration::from_millis(timeout_ms));
        let id = if on_event_thread {
            c.node.rpc_call_on_event_thread(peer, method, body, timeout, done)
        } else {
            c.node.rpc_call(peer, method, body, timeout, done)
        }?;
        if let Some(out_id) = out_id {
            out_id.write(id);
        }
        Ok(())
    })
}

/// Give up call `id`: its callback runs with CANCELLED unless it ran
/// already; the peer is told.
#[no_mangle]
pub unsafe extern "C" fn rdev_call_cancel(ctx: *const rdev_context, id: u64) -> rdev_status {
    boundary(|| {
        ctx!(ctx).node.rpc_cancel(id);
        Ok(())
    })
}

struct CServer {
    call: unsafe extern "C" fn(*mut c_void, u64, u32, *const u8, usize),
    cancel: rdev_serve_cancel_cb,
    ud: usize,
}

impl Server for CServer {
    fn call(&self, handle: u64, method: u32, body: Vec<u8>) {
        // SAFETY: the callback and userdata per `rdev_serve`'s contract.
        unsafe { (self.call)(self.ud as *mut c_void, handle, method, body.as_ptr(), body.len()) };
    }

    fn cancel(&self, handle: u64) {
        if let Some(f) = self.cancel {
            // SAFETY: as above.
            unsafe { f(self.ud as *mut c_void, handle) };
        }
    }
}

/// Serve calls from peers: `call` for each (see `rdev_serve_call_cb`),
/// `cancel` (may be NULL) when one is cancelled. `call` NULL: serve no
/// more (calls are answered UNIMPLEMENTED). `userdata` must stay valid, and
/// usable from any thread, until serving stops or the context is freed.
#[no_mangle]
pub unsafe extern "C" fn rdev_serve(ctx: *const rdev_context, call: rdev_serve_call_cb, cancel: rdev_serve_cancel_cb, userdata: *mut c_void) -> rdev_status {
    boundary(|| {
        let c = ctx!(ctx);
        let server = call.map(|call| Arc::new(CServer { call, cancel, ud: userdata as usize }) as Arc<dyn Server>);
        c.node.rpc_serve(server);
        Ok(())
    })
}

/// Serve calls of `method` (below 64) on the transport's event thread that
/// read them ("inline" as in `rdev_recv_inline`) instead of
/// `rdev-callbacks`, one thread wake-up sooner: for a method whose `call`
/// callback returns within microseconds, waits for nothing and calls only
/// functions that never block (it delays every other message that thread
/// handles meanwhile); its `rdev_serve_reply` may then come from inside the
/// callback. Lasts as long as the context.
#[no_mangle]
pub unsafe extern "C" fn rdev_serve_inline(ctx: *const rdev_context, method: u32) -> rdev_status {
    boundary(|| {
        ctx!(ctx).node.rpc_serve_on_event_thread(method)
    })
}

/// Answer served call `handle`: `code` 0 with the response `body`, or an
/// error code with its message. A call cancelled meanwhile: nothing.
#[no_mangle]
pub unsafe extern "C" fn rdev_serve_reply(ctx: *const rdev_context, handle: u64, code: u32, body: *const u8, body_len: usize) -> rdev_status {
    boundary(|| {
        let c = ctx!(ctx);
        let body = bytes!(body, body_len, "body");
        c.node.rpc_reply(handle, code, body);
        Ok(())
    })
}

/// Count a per-step worker RPC that went over gRPC (`worker_rpcs_over_grpc`).
#[no_mangle]
pub extern "C" fn rdev_record_worker_rpc_over_grpc() {
    Stats::add(&Stats::global().c.worker_rpcs_over_grpc, 1);
}

/// Count a peer's per-step worker RPC served on the transport's thread that
/// read it (`worker_rpcs_served_inline`; "inline" as in
/// `rdev_serve_inline`).
#[no_mangle]
pub extern "C" fn rdev_record_worker_rpc_served_inline() {
    Stats::add(&Stats::global().c.worker_rpcs_served_inline, 1);
}

/// Count a peer's per-step worker RPC handed to TensorFlow's compute pool
/// (`worker_rpcs_served_on_pool`).
#[no_mangle]
pub extern "C" fn rdev_record_worker_rpc_served_on_pool() {
    Stats::add(&Stats::global().c.worker_rpcs_served_on_pool, 1);
}

/// Count a RunGraph reply of more than 64 KiB received over the transport,
/// whose parse the shim hands to the data-path pool
/// (`worker_rpc_large_replies`, `worker_rpc_large_reply_bytes`).
#[no_mangle]
pub extern "C" fn rdev_record_worker_rpc_large_reply(bytes: u64) {
    let c = &Stats::global().c;
    Stats::add(&c.worker_rpc_large_replies, 1);
    Stats::add(&c.worker_rpc_large_reply_bytes, bytes);
}

