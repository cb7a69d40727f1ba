//! The one table of settings. Every `RDMA_DEVICE_*` variable is declared
//! here with its default and help line, parsed and validated once; nothing
//! else in the crate reads the environment. docs/configuration.md's table
//! is generated from `VARS` (`python -m rdma_device config --markdown`).

use std::fmt::Write as _;

use crate::error::{Error, Result};

/// Effective settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Bytes of registered receive memory per task.
    pub arena_bytes: usize,
    /// Receive slots placed per edge (pipelining depth).
    pub slots_per_edge: usize,
    /// Writes a sender may have in flight to one receiver.
    pub max_outstanding_writes: usize,
    /// Any fallback to stock gRPC becomes an error.
    pub strict: bool,
    /// Transports allowed, in preference order.
    pub transports: Vec<String>,
    /// How long a sender waits to connect to a receiver.
    pub connect_timeout_ms: u64,
    /// How long a progress thread spins before it blocks.
    pub spin_us: u64,
    /// How long a thread waiting for a receive polls before it parks.
    pub poll_us: u64,
    /// Threads that copy a large shm write (the sender's included).
    pub shm_copy_threads: usize,
    /// Place edges with static shapes when graphs are registered.
    pub static_placement: bool,
    /// RPC-over-RDMA ablation (`RDMA_DEVICE_MODE=rpc`): receivers request each tensor.
    pub rpc_mode: bool,
    /// Log filter (env_logger syntax).
    pub log: String,
    /// Record the per-transfer timeline from the start (`trace`).
    pub trace: bool,
    /// Per-step worker RPCs to peers on the transport go over it.
    pub worker_rpcs: bool,
    /// Shared secret every task of the cluster proves in its handshake
    /// (empty: no check). Never shown by `values()`.
    pub cluster_token: String,
    /// Verbs: device name (empty = automatic).
    pub verbs_device: String,
    /// Verbs: port number (0 = automatic).
    pub verbs_port: u8,
    /// Verbs: GID index (-1 = automatic).
    pub verbs_gid_index: i32,
    /// Verbs: offset added to the task's port for rdma_cm (iWARP needs != 0).
    pub verbs_cm_port_offset: u16,
    /// Verbs: writes of at least this many bytes register their source
    /// memory (zero-copy) instead of copying into staging buffers.
    pub verbs_register_bytes: usize,
    /// Verbs: local ACK timeout exponent (4.096 us x 2^n per try).
    pub verbs_ack_timeout: u8,
    /// Verbs: transport retries after an ACK timeout (0-7).
    pub verbs_retry_count: u8,
    /// Verbs: retries after a receiver-not-ready NAK (0-7; 7 = forever).
    pub verbs_rnr_retry: u8,
    /// Verbs: IP TOS / traffic class of RoCE v2 traffic (-1 = kernel default).
    pub verbs_tos: i32,
    /// Verbs: receive buffers in each device's shared receive queue.
    pub verbs_srq_depth: u32,
    /// Verbs: pinned bytes of tensor memory the registration cache keeps.
    pub verbs_mr_cache_bytes: usize,
}

/// One row of the table.
pub struct Var {
    pub name: &'static str,
    pub default: &'static str,
    pub help: &'static str,
}

/// Every variable, in the order `config()` shows them.
pub const VARS: &[Var] = &[
    Var { name: "RDMA_DEVICE_ARENA_BYTES", default: "1G",
          help: "Registered receive memory per task (suffix K/M/G). Pages are committed only when used. A tensor that does not fit (too big, or the arena full) is streamed instead, with a warning in the log, through a few stream slots per link: chunks of up to 16 MiB, at most 1/8 of the arena per link." },
    Var { name: "RDMA_DEVICE_SLOTS_PER_EDGE", default: "2",
          help: "Receive slots first placed per edge (1-64): how many steps of one tensor may be in flight before the sender waits for a credit. An edge whose slots are all busy grows by one, up to 64; past that its tensors are streamed." },
    Var { name: "RDMA_DEVICE_MAX_OUTSTANDING_WRITES", default: "64",
          help: "Writes a sender may have in flight to one receiver (1-4096); more wait in a queue." },
    Var { name: "RDMA_DEVICE_STRICT", default: "0",
          help: "1: any tensor that would fall back to stock gRPC fails instead (use to prove the transport carries everything)." },
    Var { name: "RDMA_DEVICE_TRANSPORTS", default: "shm,verbs",
          help: "Comma-separated transports allowed, in order of preference: shm (same host), verbs (RDMA NIC). A peer with none in common goes by stock gRPC." },
    Var { name: "RDMA_DEVICE_CONNECT_TIMEOUT_MS", default: "10000",
          help: "How long a sender waits for a receiver to accept a connection (ms)." },
    Var { name: "RDMA_DEVICE_SPIN_US", default: "50",
          help: "How long a progress thread polls before it sleeps (microseconds); lower saves CPU, higher cuts latency." },
    Var { name: "RDMA_DEVICE_POLL_US", default: "50",
          help: "How long a thread waiting for a receive (the endpoint API's recv) delivers arriving writes itself before it parks (microseconds; stretched up to 200 across a steady exchange's gaps; it yields the core on every pass); 0: it parks at once and the progress thread wakes it." },
    Var { name: "RDMA_DEVICE_SHM_COPY_THREADS", default: "0",
          help: "Threads that copy one large (>= 4 MiB) write between tasks on this host, the sender's own included (0: min(4, CPUs); 1: the sender alone)." },
    Var { name: "RDMA_DEVICE_STATIC_PLACEMENT", default: "1",
          help: "1: edges whose shapes are known when a graph is registered get their receive slots then, so the first step needs no negotiation; 0: every edge is placed on first use (traced)." },
    Var { name: "RDMA_DEVICE_MODE", default: "push",
          help: "push: senders write each tensor into a slot the receiver placed ahead (zero-copy receive); rpc: an ablation in the style of RPC-over-RDMA transports: the receiver requests each tensor when its Recv runs (one round trip), then the sender writes it as in push (the same copy into the same receiver-placed slot, zero-copy receive). Must be the same on every task." },
    Var { name: "RDMA_DEVICE_LOG", default: "warn",
          help: "Log filter for the library (error, warn, info, debug, trace), env_logger syntax." },
    Var { name: "RDMA_DEVICE_WORKER_RPCS", default: "1",
          help: "1: the per-step worker RPCs (RunGraph, CleanupGraph) to a peer this task has a connection with go over the transport's message channel instead of gRPC (set-up RPCs stay on gRPC); 0: all over gRPC. Counted in worker_rpcs_over_transport / worker_rpcs_over_grpc." },
    Var { name: "RDMA_DEVICE_CLUSTER_TOKEN", default: "",
          help: "A secret shared by every task of the job (e.g. generated by the launcher). When set, each connection's handshake proves it both ways (HMAC-SHA256 of the task names, the incarnation and a fresh nonce the receiver opens each connection with; the token itself never travels) and a peer without it is refused: its tensors go by stock gRPC (an error with RDMA_DEVICE_STRICT=1). Keeps out processes that do not know the token, and a handshake recorded on one connection is refused on another; it does not encrypt or authenticate the data that follows. Empty: no check (shm still admits only the same user). Shown as (set) by config()." },
    Var { name: "RDMA_DEVICE_TRACE", default: "0",
          help: "1: record every transfer's timeline (send, write, arrival, delivery, release, worker RPCs) from the start, for rdma_device.trace_take() and `python -m rdma_device.bench trace`. Spans also go to TensorFlow's profiler while it records, whatever this says. Off costs one atomic load per event." },
    Var { name: "RDMA_DEVICE_VERBS_DEVICE", default: "",
          help: "Verbs: RDMA device name (e.g. mlx5_0, rxe0); empty chooses the device that carries the task's address." },
    Var { name: "RDMA_DEVICE_VERBS_PORT", default: "0",
          help: "Verbs: port number on the device (0: first active port)." },
    Var { name: "RDMA_DEVICE_VERBS_GID_INDEX", default: "-1",
          help: "Verbs: GID index (-1: prefer a RoCE v2 IPv4 GID of the task's interface)." },
    Var { name: "RDMA_DEVICE_VERBS_CM_PORT_OFFSET", default: "0",
          help: "Verbs: rdma_cm listens on the task's port plus this offset (IB/RoCE have their own port space; iWARP needs a non-zero offset)." },
    Var { name: "RDMA_DEVICE_VERBS_REGISTER_BYTES", default: "1M",
          help: "Verbs: writes of at least this size are sent zero-copy from the tensor's memory, registered through a cache (RDMA_DEVICE_VERBS_MR_CACHE_BYTES); smaller ones are copied into pre-registered staging buffers (suffix K/M/G)." },
    Var { name: "RDMA_DEVICE_VERBS_ACK_TIMEOUT", default: "17",
          help: "Verbs: local ACK timeout exponent (1-31): each try waits 4.096 us x 2^n (17: 537 ms). A dead peer host is detected within 4.096 us x 2^n x (RETRY_COUNT + 1) (defaults: ~3.76 s), plus what the NIC adds to the timeout; a network blip shorter than that is ridden through, as TCP does (14 or less fails a link on a blip of half a second)." },
    Var { name: "RDMA_DEVICE_VERBS_RETRY_COUNT", default: "6",
          help: "Verbs: how often a work request is resent after an ACK timeout before the connection fails (0-7; Soft-RoCE treats 7 as forever)." },
    Var { name: "RDMA_DEVICE_VERBS_RNR_RETRY", default: "6",
          help: "Verbs: how often a message is resent after a receiver-not-ready NAK (receiver out of posted buffers) before the connection fails (0-7; 7 means retry forever: a receiver that stops consuming then stalls its senders for good)." },
    Var { name: "RDMA_DEVICE_VERBS_TOS", default: "-1",
          help: "Verbs: IP type of service (DSCP << 2) of RoCE v2 traffic, e.g. 106 for DSCP 26, to put it on the network's lossless priority (-1: the kernel's default_roce_tos)." },
    Var { name: "RDMA_DEVICE_VERBS_SRQ_DEPTH", default: "4096",
          help: "Verbs: receive buffers (4 KiB each) in the shared receive queue of each device, shared by all connections for control messages and write immediates (64-65536; capped by the device's max_srq_wr)." },
    Var { name: "RDMA_DEVICE_VERBS_MR_CACHE_BYTES", default: "1G",
          help: "Verbs: tensor memory the sender keeps registered (pinned) after a zero-copy write, so that the next write from the same pages needs no registration; least recently used first out, also under RLIMIT_MEMLOCK pressure. Entries are dropped when the application unmaps or discards their pages (userfaultfd). 0: register per write (suffix K/M/G)." },
];

impl Default for Config {
    fn default() -> Self {
        Config::from_lookup(|_| None).expect("defaults are valid")
    }
}

impl Config {
    /// Read and validate the process environment.
    pub fn from_env() -> Result<Config> {
        Config::from_lookup(|k| std::env::var(k).ok())
    }

    /// Read and validate through `get` (tests pass a map).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let val = |name: &str| -> String {
            let d = VARS.iter().find(|v| v.name == name).map(|v| v.default).unwrap_or("");
            get(name).map(|s| s.trim().to_string()).unwrap_or_else(|| d.to_string())
        };
        let transports: Vec<String> = val("RDMA_DEVICE_TRANSPORTS")
            .split(',')
            .map(|s| s.trim().to_ascii_lowercase())
            .filter(|s| !s.is_empty())
            .collect();
        for t in &transports {
            if t != "shm" && t != "verbs" {
                return Err(bad("RDMA_DEVICE_TRANSPORTS", t, "known transports are shm and verbs"));
            }
        }
        Ok(Config {
            arena_bytes: bytes("RDMA_DEVICE_ARENA_BYTES", &val("RDMA_DEVICE_ARENA_BYTES"), 1 << 20, 1 << 40)?,
            slots_per_edge: int("RDMA_DEVICE_SLOTS_PER_EDGE", &val("RDMA_DEVICE_SLOTS_PER_EDGE"), 1, 64)? as usize,
            max_outstanding_writes: int("RDMA_DEVICE_MAX_OUTSTANDING_WRITES", &val("RDMA_DEVICE_MAX_OUTSTANDING_WRITES"), 1, 4096)? as usize,
            strict: boolean("RDMA_DEVICE_STRICT", &val("RDMA_DEVICE_STRICT"))?,
            transports,
            connect_timeout_ms: int("RDMA_DEVICE_CONNECT_TIMEOUT_MS", &val("RDMA_DEVICE_CONNECT_TIMEOUT_MS"), 1, 3_600_000)? as u64,
            spin_us: int("RDMA_DEVICE_SPIN_US", &val("RDMA_DEVICE_SPIN_US"), 0, 1_000_000)? as u64,
            poll_us: int("RDMA_DEVICE_POLL_US", &val("RDMA_DEVICE_POLL_US"), 0, 1_000_000)? as u64,
            shm_copy_threads: match int("RDMA_DEVICE_SHM_COPY_THREADS", &val("RDMA_DEVICE_SHM_COPY_THREADS"), 0, 64)? {
                0 => std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(4),
                n => n as usize,
            },
            static_placement: boolean("RDMA_DEVICE_STATIC_PLACEMENT", &val("RDMA_DEVICE_STATIC_PLACEMENT"))?,
            rpc_mode: match val("RDMA_DEVICE_MODE").trim() {
                "push" => false,
                "rpc" => true,
                v => return Err(bad("RDMA_DEVICE_MODE", v, "expected push or rpc")),
            },
            log: val("RDMA_DEVICE_LOG"),
            trace: boolean("RDMA_DEVICE_TRACE", &val("RDMA_DEVICE_TRACE"))?,
            worker_rpcs: boolean("RDMA_DEVICE_WORKER_RPCS", &val("RDMA_DEVICE_WORKER_RPCS"))?,
            cluster_token: val("RDMA_DEVICE_CLUSTER_TOKEN"),
            verbs_device: val("RDMA_DEVICE_VERBS_DEVICE"),
            verbs_port: int("RDMA_DEVICE_VERBS_PORT", &val("RDMA_DEVICE_VERBS_PORT"), 0, 255)? as u8,
            verbs_gid_index: int("RDMA_DEVICE_VERBS_GID_INDEX", &val("RDMA_DEVICE_VERBS_GID_INDEX"), -1, 65535)? as i32,
            verbs_cm_port_offset: int("RDMA_DEVICE_VERBS_CM_PORT_OFFSET", &val("RDMA_DEVICE_VERBS_CM_PORT_OFFSET"), 0, 65535)? as u16,
            verbs_register_bytes: bytes("RDMA_DEVICE_VERBS_REGISTER_BYTES", &val("RDMA_DEVICE_VERBS_REGISTER_BYTES"), 0, 1 << 40)?,
            verbs_ack_timeout: int("RDMA_DEVICE_VERBS_ACK_TIMEOUT", &val("RDMA_DEVICE_VERBS_ACK_TIMEOUT"), 1, 31)? as u8,
            verbs_retry_count: int("RDMA_DEVICE_VERBS_RETRY_COUNT", &val("RDMA_DEVICE_VERBS_RETRY_COUNT"), 0, 7)? as u8,
            verbs_rnr_retry: int("RDMA_DEVICE_VERBS_RNR_RETRY", &val("RDMA_DEVICE_VERBS_RNR_RETRY"), 0, 7)? as u8,
            verbs_tos: int("RDMA_DEVICE_VERBS_TOS", &val("RDMA_DEVICE_VERBS_TOS"), -1, 255)? as i32,
            verbs_srq_depth: int("RDMA_DEVICE_VERBS_SRQ_DEPTH", &val("RDMA_DEVICE_VERBS_SRQ_DEPTH"), 64, 65536)? as u32,
            verbs_mr_cache_bytes: bytes("RDMA_DEVICE_VERBS_MR_CACHE_BYTES", &val("RDMA_DEVICE_VERBS_MR_CACHE_BYTES"), 0, 1 << 44)?,
        })
    }

    pub fn allows(&self, transport: &str) -> bool {
        self.transports.iter().any(|t| t == transport)
    }

    /// The effective value of each variable, as text, in table order.
    pub fn values(&self) -> Vec<(&'static Var, String)> {
        VARS.iter()
            .map(|v| {
                let s = match v.name {
                    "RDMA_DEVICE_ARENA_BYTES" => self.arena_bytes.to_string(),
                    "RDMA_DEVICE_SLOTS_PER_EDGE" => self.slots_per_edge.to_string(),
                    "RDMA_DEVICE_MAX_OUTSTANDING_WRITES" => self.max_outstanding_writes.to_string(),
                    "RDMA_DEVICE_STRICT" => (self.strict as u8).to_string(),
                    "RDMA_DEVICE_TRANSPORTS" => self.transports.join(","),
                    "RDMA_DEVICE_CONNECT_TIMEOUT_MS" => self.connect_timeout_ms.to_string(),
                    "RDMA_DEVICE_SPIN_US" => self.spin_us.to_string(),
                    "RDMA_DEVICE_POLL_US" => self.poll_us.to_string(),
                    "RDMA_DEVICE_SHM_COPY_THREADS" => self.shm_copy_threads.to_string(),
                    "RDMA_DEVICE_STATIC_PLACEMENT" => (self.static_placement as u8).to_string(),
                    "RDMA_DEVICE_MODE" => (if self.rpc_mode { "rpc" } else { "push" }).to_string(),
                    "RDMA_DEVICE_LOG" => self.log.clone(),
                    "RDMA_DEVICE_TRACE" => (self.trace as u8).to_string(),
                    "RDMA_DEVICE_WORKER_RPCS" => (self.worker_rpcs as u8).to_string(),
                    "RDMA_DEVICE_CLUSTER_TOKEN" => if self.cluster_token.is_empty() { String::new() } else { "(set)".into() },
                    "RDMA_DEVICE_VERBS_DEVICE" => self.verbs_device.clone(),
                    "RDMA_DEVICE_VERBS_PORT" => self.verbs_port.to_string(),
                    "RDMA_DEVICE_VERBS_GID_INDEX" => self.verbs_gid_index.to_string(),
                    "RDMA_DEVICE_VERBS_CM_PORT_OFFSET" => self.verbs_cm_port_offset.to_string(),
                    "RDMA_DEVICE_VERBS_REGISTER_BYTES" => self.verbs_register_bytes.to_string(),
                    "RDMA_DEVICE_VERBS_ACK_TIMEOUT" => self.verbs_ack_timeout.to_string(),
                    "RDMA_DEVICE_VERBS_RETRY_COUNT" => self.verbs_retry_count.to_string(),
                    "RDMA_DEVICE_VERBS_RNR_RETRY" => self.verbs_rnr_retry.to_string(),
                    "RDMA_DEVICE_VERBS_TOS" => self.verbs_tos.to_string(),
                    "RDMA_DEVICE_VERBS_SRQ_DEPTH" => self.verbs_srq_depth.to_string(),
                    "RDMA_DEVICE_VERBS_MR_CACHE_BYTES" => self.verbs_mr_cache_bytes.to_string(),
                    _ => String::new(),
                };
                (v, s)
            })
            .collect()
    }

    /// `{"RDMA_DEVICE_X": {"value": "...", "default": "...", "help": "..."}, ...}`
    pub fn to_json(&self) -> String {
        let mut out = String::from("{");
        for (i, (v, s)) in self.values().into_iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            let _ = write!(
                out,
                "{}: {{\"value\": {}, \"default\": {}, \"help\": {}}}",
                crate::stats::json_str(v.name),
                crate::stats::json_str(&s),
                crate::stats::json_str(v.default),
                crate::stats::json_str(v.help)
            );
        }
        out.push('}');
        out
    }
}

fn bad(name: &str, value: &str, why: &str) -> Error {
    let help = VARS.iter().find(|v| v.name == name).map(|v| v.help).unwrap_or("");
    Error::Config(format!("{name}={value:?} is invalid: {why}. ({name}: {help})"))
}

fn int(name: &str, s: &str, min: i64, max: i64) -> Result<i64> {
    let v: i64 = s.parse().map_err(|_| bad(name, s, "expected an integer"))?;
    if v < min || v > max {
        return Err(bad(name, s, &format!("must be between {min} and {max}")));
    }
    Ok(v)
}

fn bytes(name: &str, s: &str, min: u64, max: u64) -> Result<usize> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m = match c.to_ascii_uppercase() {
                'K' => 1u64 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                _ => return Err(bad(name, s, "size suffix must be K, M or G")),
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    let n: u64 = num.trim().parse().map_err(|_| bad(name, s, "expected a byte count like 512M"))?;
    let v = n.checked_mul(mult).ok_or_else(|| bad(name, s, "too large"))?;
    if v < min || v > max {
        return Err(bad(name, s, &format!("must be between {min} and {max} bytes")));
    }
    Ok(v as usize)
}

fn boolean(name: &str, s: &str) -> Result<bool> {
    match s.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" | "" => Ok(false),
        _ => Err(bad(name, s, "expected 0 or 1")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn with(pairs: &[(&str, &str)]) -> Result<Config> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn defaults_are_valid() {
        let c = Config::default();
        assert_eq!(c.arena_bytes, 1 << 30);
        assert_eq!(c.slots_per_edge, 2);
        assert!(!c.strict);
        assert!(c.allows("shm") && c.allows("verbs"));
    }

    #[test]
    fn parses_sizes_and_flags() {
        let c = with(&[("RDMA_DEVICE_ARENA_BYTES", "64M"), ("RDMA_DEVICE_STRICT", "1"), ("RDMA_DEVICE_TRANSPORTS", "shm")]).unwrap();
        assert_eq!(c.arena_bytes, 64 << 20);
        assert!(c.strict);
        assert!(!c.allows("verbs"));
    }

    #[test]
    fn bad_values_name_the_variable() {
        for (k, v) in [
            ("RDMA_DEVICE_ARENA_BYTES", "lots"),
            ("RDMA_DEVICE_ARENA_BYTES", "12Q"),
            ("RDMA_DEVICE_SLOTS_PER_EDGE", "0"),
            ("RDMA_DEVICE_STRICT", "maybe"),
            ("RDMA_DEVICE_TRANSPORTS", "tcp"),
            ("RDMA_DEVICE_VERBS_PORT", "300"),
            ("RDMA_DEVICE_VERBS_ACK_TIMEOUT", "0"),
            ("RDMA_DEVICE_VERBS_RETRY_COUNT", "8"),
            ("RDMA_DEVICE_VERBS_RNR_RETRY", "9"),
            ("RDMA_DEVICE_VERBS_TOS", "256"),
            ("RDMA_DEVICE_VERBS_SRQ_DEPTH", "10"),
        ] {
            let e = with(&[(k, v)]).unwrap_err();
            assert!(matches!(e, Error::Config(_)), "{k}={v}: {e}");
            assert!(e.message().contains(k), "{e}");
        }
    }

    #[test]
    fn json_lists_every_variable() {
        let j = Config::default().to_json();
        for v in VARS {
            assert!(j.contains(v.name));
        }
    }
}
