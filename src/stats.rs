//! Counters a user reads to see what the transport is doing: how many
//! tensors and bytes went by push, streamed in chunks (`inline_tensors`,
//! named after the `Inline` messages that streams replaced) and by stock gRPC
//! (with reasons), per-peer transports, arena use. Process-wide: a process
//! normally hosts one TensorFlow server; tests with several contexts in one
//! process see their sum.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;

use parking_lot::Mutex;

/// The one table of counters. Protocol counters are moved by the protocol
/// state machine into a per-node [`Tally`] (plain integers, under its
/// lock) and added to the process-wide [`Counters`] in one step; process
/// counters are moved directly by the layers that own them. Each name,
/// its help line and its place in `stats()` are written once, here.
macro_rules! counters {
    (protocol { $($p:ident : $ph:literal,)* } process { $($q:ident : $qh:literal,)* }) => {
        /// One node's protocol counters (see the `counters!` table).
        #[derive(Debug, Default, Clone, PartialEq, Eq)]
        pub struct Tally { $(#[doc = $ph] pub $p: u64,)* }
        impl Tally {
            /// Add every counter of `o` to ours.
            pub fn add(&mut self, o: &Tally) { $(self.$p += o.$p;)* }
        }
        /// Monotonic counters (plus a few gauges, noted as such).
        #[derive(Default)]
        pub struct Counters { $(#[doc = $ph] pub $p: AtomicU64,)* $(#[doc = $qh] pub $q: AtomicU64,)* }
        impl Counters {
            fn each(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($p), self.$p.load(Relaxed)),)* $((stringify!($q), self.$q.load(Relaxed)),)*]
            }
            fn clear(&self) { $(self.$p.store(0, Relaxed);)* $(self.$q.store(0, Relaxed);)* }
            /// Add a node's protocol counters to the process-wide ones.
            pub fn add_tally(&self, t: &Tally) { $(if t.$p != 0 { self.$p.fetch_add(t.$p, Relaxed); })* }
            /// Every counter's name and help line, in `stats()` order.
            pub fn help() -> &'static [(&'static str, &'static str)] {
                &[$((stringify!($p), $ph),)* $((stringify!($q), $qh),)*]
            }
        }
    };
}

counters! {
    protocol {
        tensors_pushed: "tensors written one-sided into a receiver's slot",
        bytes_pushed: "payload bytes of those tensors",
        tensors_received: "tensors handed to a receiver (pushed or streamed)",
        bytes_received: "payload bytes of those tensors",
        inline_tensors: "tensors streamed in chunks instead of one slot (larger than a slot the receiver can place, arena full, rank > 24, edge out of slots)",
        inline_bytes: "payload bytes of those tensors",
        stream_chunks: "chunks of streamed tensors written one-sided into stream slots",
        stream_messages: "chunks of streamed tensors sent as control messages (no room for stream slots)",
        negotiation_messages: "announce/publish messages (first use, size change)",
        credits_sent: "slot credits returned to senders",
        edges_static: "edges placed ahead of time from static shapes",
        edges_traced: "edges placed on first use",
        replacements: "edges re-placed after a size change",
        slots_reclaimed: "idle slots reclaimed to make room in the arena",
        rejected_writes: "pushes rejected (stale generation, bad header)",
        dropped_late: "pushes that arrived after their step finished or their receive was cancelled",
        waiters_failed: "receives that completed with an error",
        receives_cancelled: "receives cancelled one by one (rdev_cancel_recv: the eager context's receives; its step went on)",
        aborts_propagated: "steps this task aborted as failed and told its peers of (rdev_abort_step with propagate), once per step; TensorFlow's normal end of a step is never one",
        aborts_received: "steps a peer told this task it aborted, once per peer and step",
        requests_sent: "RDMA_DEVICE_MODE=rpc: tensors this receiver requested (one round trip each)",
        requests_served: "RDMA_DEVICE_MODE=rpc: requests this sender answered with a write or inline send",
    }
    process {
        fallback_tensors: "tensors that went over stock gRPC",
        fallback_bytes: "payload bytes of those tensors",
        peers_lost: "connections lost (peer exit, transport error)",
        polled_writes: "one-sided writes that a thread waiting for a receive (rdev_wait) delivered itself while it polled, so no event thread woke for them (caller-driven progress, RDMA_DEVICE_POLL_US)",
        steps_ended: "steps TensorFlow ended on this task (its cleanup of the step: rdev_step_done)",
        steps_reopened: "steps whose rendezvous TensorFlow made again after the last one had gone (an eager function's later component on this task): what peers pushed for them meanwhile was kept",
        worker_rpcs_over_transport: "per-step worker RPCs (RunGraph, CleanupGraph) this task made over the transport's message channel",
        worker_rpcs_over_grpc: "per-step worker RPCs this task made over gRPC (peer off the transport, not connected yet, or RDMA_DEVICE_WORKER_RPCS=0)",
        worker_rpcs_served_inline: "per-step worker RPCs this task served from a peer on the transport's thread that read them (a RunGraph of at most 16 KiB)",
        worker_rpcs_served_on_pool: "per-step worker RPCs this task served from a peer on TensorFlow's compute pool, where stock's gRPC worker service serves them (a larger RunGraph, every CleanupGraph)",
        worker_rpc_large_replies: "RunGraph replies of more than 64 KiB this task received over the transport (step stats, cost graphs, partition graphs), each parsed on the plugin's data-path pool rather than on `rdev-callbacks`",
        worker_rpc_large_reply_bytes: "bytes of those replies",
        collective_tensors: "collective chunks (all-reduce, broadcast, gather) received over this transport; also in tensors_received",
        collective_bytes: "payload bytes of those chunks",
        collective_sent_tensors: "collective chunks this task wrote to a peer over this transport",
        collective_sent_bytes: "payload bytes of those chunks",
        collective_fallback_tensors: "collective chunks received over stock gRPC (RecvBuf); also in fallback_tensors",
        collective_fallback_bytes: "payload bytes of those chunks",
        arena_bytes_in_use: "gauge: bytes of the receive arena placed in slots",
        arena_bytes_total: "gauge: size of the receive arena",
        verbs_windows_bound: "verbs: arena ranges granted to one sender each through a memory window bound to its connection",
        verbs_shared_grants: "verbs: arena ranges granted through the arena's shared memory region (the device has no type-2 memory windows: verbs senders are not isolated from each other)",
        verbs_write_registrations: "verbs: registrations (ibv_reg_mr) of tensor memory for zero-copy writes: registration-cache misses and memory the cache cannot keep",
        verbs_mr_cache_hits: "verbs: zero-copy write segments sent through a cached registration (no registration)",
        verbs_mr_cache_invalidations: "verbs: cached registrations dropped because the application unmapped or discarded their pages",
        verbs_mr_cache_evictions: "verbs: cached registrations evicted (least recently used) for the cache's bound or RLIMIT_MEMLOCK",
        verbs_staged_copies_handed_off: "verbs: staging-chunk copies of staged writes that a completion (on the progress thread) released and `rdev-verbs-copy` made",
        verbs_staged_fallbacks: "verbs: writes large enough for zero-copy that were copied through staging buffers instead (RLIMIT_MEMLOCK would be exceeded, or registration failed)",
        verbs_pinned_bytes: "gauge: bytes the verbs backend has pinned (registered): receive buffers, arena extents, connection buffers, cached and in-flight write registrations",
        verbs_arena_pinned_bytes: "gauge: bytes of receive arenas registered so far (extents follow the slots placed)",
    }
}

pub struct Stats {
    pub c: Counters,
    peers: Mutex<BTreeMap<String, String>>,
    fallback_reasons: Mutex<BTreeMap<String, u64>>,
}

static GLOBAL: OnceLock<Stats> = OnceLock::new();

impl Stats {
    pub fn global() -> &'static Stats {
        GLOBAL.get_or_init(|| Stats {
            c: Counters::default(),
            peers: Mutex::new(BTreeMap::new()),
            fallback_reasons: Mutex::new(BTreeMap::new()),
        })
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }

    /// Record which transport serves `peer` ("shm", "verbs", "grpc (reason)").
    pub fn set_peer(&self, peer: &str, transport: &str) {
        self.peers.lock().insert(peer.to_string(), transport.to_string());
    }

    pub fn record_fallback(&self, bytes: u64, reason: &str) {
        Stats::add(&self.c.fallback_tensors, 1);
        Stats::add(&self.c.fallback_bytes, bytes);
        *self.fallback_reasons.lock().entry(reason.to_string()).or_insert(0) += 1;
    }

    /// A collective chunk (see `rdev_collective_event`); a fallback is also
    /// counted in `fallback_tensors` with its reason.
    pub fn record_collective(&self, received: bool, over_transport: bool, bytes: u64, reason: &str) {
        let c = &self.c;
        let (t, b) = match (received, over_transport) {
            (true, true) => (&c.collective_tensors, &c.collective_bytes),
            (false, true) => (&c.collective_sent_tensors, &c.collective_sent_bytes),
            (_, false) => (&c.collective_fallback_tensors, &c.collective_fallback_bytes),
        };
        Stats::add(t, 1);
        Stats::add(b, bytes);
        if !over_transport {
            self.record_fallback(bytes, reason);
        }
    }

    /// Zero every counter (gauges included) and forget peers; for benchmarks
    /// and tests that measure one phase.
    pub fn reset(&self) {
        self.c.clear();
        self.peers.lock().clear();
        self.fallback_reasons.lock().clear();
    }

    pub fn get(&self, name: &str) -> Option<u64> {
        self.c.each().into_iter().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    /// `{"counters": {...}, "peers": {...}, "fallback_reasons": {...}}`
    pub fn to_json(&self) -> String {
        let mut out = String::from("{\"counters\": {");
        for (i, (k, v)) in self.c.each().into_iter().enumerate() {
            let _ = write!(out, "{}\"{k}\": {v}", if i > 0 { ", " } else { "" });
        }
        out.push_str("}, \"peers\": {");
        for (i, (k, v)) in self.peers.lock().iter().enumerate() {
            let _ = write!(out, "{}{}: {}", if i > 0 { ", " } else { "" }, json_str(k), json_str(v));
        }
        out.push_str("}, \"fallback_reasons\": {");
        for (i, (k, v)) in self.fallback_reasons.lock().iter().enumerate() {
            let _ = write!(out, "{}{}: {v}", if i > 0 { ", " } else { "" }, json_str(k));
        }
        out.push_str("}}");
        out
    }
}

/// A JSON string literal for `s`.
pub fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for ch in s.chars() {
        match ch {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            '\r' => o.push_str("\\r"),
            '\t' => o.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collective_chunks_are_counted_apart() {
        let s = Stats { c: Counters::default(), peers: Mutex::new(BTreeMap::new()), fallback_reasons: Mutex::new(BTreeMap::new()) };
        s.record_collective(true, true, 10, "");
        s.record_collective(false, true, 20, "");
        s.record_collective(true, false, 30, "peer runs grpc");
        assert_eq!((s.get("collective_tensors"), s.get("collective_bytes")), (Some(1), Some(10)));
        assert_eq!((s.get("collective_sent_tensors"), s.get("collective_sent_bytes")), (Some(1), Some(20)));
        assert_eq!((s.get("collective_fallback_tensors"), s.get("fallback_bytes")), (Some(1), Some(30)));
        assert!(s.to_json().contains("\"peer runs grpc\": 1"));
    }

    #[test]
    fn json_escapes() {
        assert_eq!(json_str("a\"b\\c\n\u{1}"), "\"a\\\"b\\\\c\\n\\u0001\"");
    }
}
