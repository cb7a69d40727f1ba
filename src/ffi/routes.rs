//! Peers, their routes, connects and placements, and the settings a caller
//! acts on: the C ABI of node/routes.rs and node/placing.rs. The caller keeps no route table and no strict flag: it
//! tells the context of its peers (`rdev_context_set_peer`), asks how each
//! travels (`rdev_route`), and takes the stock path only on
//! `RDEV_NOT_VIABLE` (`RDEV_STRICT` is the strict-mode refusal: fail).

use std::ffi::c_char;

use super::status::rdev_status;
use super::{boundary, rdev_context, set_last_error};
use crate::config::Config;
use crate::fabric::TransportKind;
use crate::node::RouteNow;

/// Which transport serves a peer. Values never change.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum rdev_transport {
    /// No transport of ours: use stock gRPC (reason in rdev_last_error).
    RDEV_TRANSPORT_NONE = 0,
    /// Shared memory (same host).
    RDEV_TRANSPORT_SHM = 1,
    /// RDMA verbs.
    RDEV_TRANSPORT_VERBS = 2,
}

/// How tensors with a peer travel now (`rdev_route`). Values never change.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum rdev_route_kind {
    /// Being chosen (name resolution, probing): send and receive as over
    /// the transport; what waits for the choice waits in the transport,
    /// and fails with RDEV_NOT_VIABLE if the peer ends up on gRPC.
    RDEV_ROUTE_PENDING = 0,
    /// Shared memory.
    RDEV_ROUTE_SHM = 1,
    /// RDMA verbs.
    RDEV_ROUTE_VERBS = 2,
    /// Stock gRPC; `rdev_last_error` holds the reason. Never in strict
    /// mode (that is RDEV_STRICT).
    RDEV_ROUTE_GRPC = 3,
}

/// The settings a caller acts on, from one call (`rdev_settings_get`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub struct rdev_settings {
    /// RDMA_DEVICE_STRICT: any fallback to gRPC is an error. Applied by the
    /// library (RDEV_STRICT); for the caller's logs only.
    pub strict: bool,
    /// RDMA_DEVICE_STATIC_PLACEMENT: place edges with static shapes when a
    /// graph is registered (`rdev_place_edge`).
    pub static_placement: bool,
    /// RDMA_DEVICE_WORKER_RPCS: per-step worker RPCs to peers on the
    /// transport go over it (`rdev_call`).
    pub worker_rpcs: bool,
}

fn settings_of(cfg: &Config) -> rdev_settings {
    rdev_settings { strict: cfg.strict, static_placement: cfg.static_placement, worker_rpcs: cfg.worker_rpcs }
}

/// The settings of `ctx`, or with `ctx` NULL those of the environment now
/// (a bad value: RDEV_CONFIG, the reason in `rdev_last_error`). `*out` is
/// written only on RDEV_OK.
#[no_mangle]
pub unsafe extern "C" fn rdev_settings_get(ctx: *const rdev_context, out: *mut rdev_settings) -> rdev_status {
    boundary(|| {
        let out = out!(out);
        let s = match opt_ctx!(ctx) {
            Some(c) => settings_of(c.node.config()),
            None => settings_of(&Config::from_env()?),
        };
        out.write(s);
        Ok(())
    })
}

/// Tell the context about peer `task` at `addr`, choosing its route on this
/// thread (a name lookup; with verbs, an rdma_cm probe of up to 500 ms);
/// `*out` says which transport will carry tensors to and from it.
/// RDEV_TRANSPORT_NONE means use stock gRPC; `rdev_last_error` then holds
/// the reason. `rdev_context_set_peer` does the same without waiting.
#[no_mangle]
pub unsafe extern "C" fn rdev_context_add_peer(
    ctx: *const rdev_context,
    task: *const c_char,
    task_len: usize,
    addr: *const c_char,
    addr_len: usize,
    out: *mut rdev_transport,
) -> rdev_status {
    boundary(|| {
        let c = ctx!(ctx);
        let task = text!(task, task_len, "task");
        let addr = text!(addr, addr_len, "addr");
        let out = out!(out);
        let choice = c.node.add_peer(task, addr);
        let t = match choice.transport {
            Some(TransportKind::Shm) => rdev_transport::RDEV_TRANSPORT_SHM,
            Some(TransportKind::Verbs) => rdev_transport::RDEV_TRANSPORT_VERBS,
            None => {
                set_last_error(choice.reason);
                rdev_transport::RDEV_TRANSPORT_NONE
            }
        };
        out.write(t);
        Ok(())
    })
}

/// Tell the context about peer `task` at `addr` without waiting. A new
/// peer, or one at a new address, gets a pending route, chosen on a
/// library thread (`rdev-route`), every peer at once; the same address
/// again changes nothing. Work for a peer whose route is pending waits in
/// the library, up to 20 s (`rdev_route`). Never blocks.
#[no_mangle]
pub unsafe extern "C" fn rdev_context_set_peer(
    ctx: *const rdev_context,
    task: *const c_char,
    task_len: usize,
    addr: *const c_char,
    addr_len: usize,
) -> rdev_status {
    boundary(|| {
        let c = ctx!(ctx);
        let task = text!(task, task_len, "task");
        let addr = text!(addr, addr_len, "addr");
        c.node.set_peer(task, addr);
        Ok(())
    })
}

/// How tensors with `peer` travel now, into `*out` (written only on
/// RDEV_OK). RDEV_ROUTE_GRPC puts its reason in `rdev_last_error`; a task
/// the context was never told of goes over gRPC. Errors: RDEV_STRICT when
/// the route is gRPC and RDMA_DEVICE_STRICT is set; RDEV_TIMEOUT when the
/// route has been pending for 20 s. Never blocks.
#[no_mangle]
pub unsafe extern "C" fn rdev_route(ctx: *const rdev_context, peer: *const c_char, peer_len: usize, out: *mut rdev_route_kind) -> rdev_status {
    boundary(|| {
        let c = ctx!(ctx);
        let peer = text!(peer, peer_len, "peer");
        let out = out!(out);
        let r = match c.node.route(peer)? {
            RouteNow::Pending => rdev_route_kind::RDEV_ROUTE_PENDING,
            RouteNow::Device(TransportKind::Shm) => rdev_route_kind::RDEV_ROUTE_SHM,
            RouteNow::Device(TransportKind::Verbs) => rdev_route_kind::RDEV_ROUTE_VERBS,
            RouteNow::Grpc(why) => {
                set_last_error(why);
                rdev_route_kind::RDEV_ROUTE_GRPC
            }
        };
        out.write(r);
        Ok(())
    })
}

/// May a tensor with `peer` go over stock gRPC because of `why` (a reason
/// the caller found, e.g. it is in device memory)? RDEV_OK, or RDEV_STRICT
/// (its message naming the peer and `why`) with RDMA_DEVICE_STRICT. `ctx`
/// NULL: a task whose transport did not start, with the environment's
/// settings (a bad value: RDEV_CONFIG). Never blocks.
#[no_mangle]
pub unsafe extern "C" fn rdev_grpc_fallback(ctx: *const rdev_context, peer: *const c_char, peer_len: usize, why: *const c_char, why_len: usize) -> rdev_status {
    boundary(|| {
        let peer = text!(peer, peer_len, "peer");
        let why = text!(why, why_len, "why");
        match opt_ctx!(ctx) {
            Some(c) => c.node.grpc_fallback(peer, why),
            None if Config::from_env()?.strict => Err(crate::node::strict_refusal(peer, why)),
            None => Ok(()),
        }
    })
}

/// Sender side, before the first step (static shapes known at graph
/// registration): ask `peer` to place the edge `key` for `bytes` bytes and
/// wait up to `timeout_ms` until it has, so the edge's first send is
/// already a one-sided write. `*placed` is false when the peer had no
/// arena room (the edge then uses the slower path; not an error).
#[no_mangle]
pub unsafe extern "C" fn rdev_place_edge(
    ctx: *const rdev_context,
    peer: *const c_char,
    peer_len: usize,
    key: *const c_char,
    key_len: usize,
    bytes: u64,
    timeout_ms: u64,
    placed: *mut bool,
) -> rdev_status {
    boundary(|| {
        let c = ctx!(ctx);
        let peer = text!(peer, peer_len, "peer");
        let key = text!(key, key_len, "key");
        let placed = opt_out!(placed);
        let ok = c.node.place_ahead(peer, key, bytes, std::time::Duration::from_millis(timeout_ms))?;
        if let Some(placed) = placed {
            placed.write(ok);
        }
        Ok(())
    })
}

/// Static placement on behalf of another task (graphs partitioned in one
/// process and run in others, e.g. tf.function): ask task `sender` to do
/// what `rdev_place_edge(receiver, key, bytes)` does on it, and wait up to
/// `timeout_ms` for the outcome. `sender` may be this task, `receiver` may
/// be this task or a third one. Same `*placed` semantics as
/// `rdev_place_edge`.
#[no_mangle]
pub unsafe extern "C" fn rdev_request_placement(
    ctx: *const rdev_context,
    sender: *const c_char,
    sender_len: usize,
    receiver: *const c_char,
    receiver_len: usize,
    key: *const c_char,
    key_len: usize,
    bytes: u64,
    timeout_ms: u64,
    placed: *mut bool,
) -> rdev_status {
    boundary(|| {
        let c = ctx!(ctx);
        let sender = text!(sender, sender_len, "sender");
        let receiver = text!(receiver, receiver_len, "receiver");
        let key = text!(key, key_len, "key");
        let placed = opt_out!(placed);
        let ok = c.node.request_placement(sender, receiver, key, bytes, std::time::Duration::from_millis(timeout_ms))?;
        if let Some(placed) = placed {
            placed.write(ok);
        }
        Ok(())
    })
}

/// Connect to `peer` now (e.g. at graph registration) instead of at its
/// first tensor. Fails with RDEV_TIMEOUT / RDEV_PEER_LOST when it cannot.
#[no_mangle]
pub unsafe extern "C" fn rdev_connect_peer(ctx: *const rdev_context, peer: *const c_char, peer_len: usize) -> rdev_status {
    boundary(|| {
        let c = ctx!(ctx);
        let peer = text!(peer, peer_len, "peer");
        c.node.connect(peer)
    })
}
