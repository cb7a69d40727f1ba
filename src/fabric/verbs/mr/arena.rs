//! The receiver's arena registration: pinned memory follows the slots
//! placed, not the arena's size.
//!
//! The arena (default 1 GiB) is address space until slots are placed in
//! it; registering it whole at `listen` pinned (and so committed) all of
//! it. Here it is registered in *extents*: chunk-aligned ranges
//! ([`super::super::VerbsOptions::arena_chunk`], 64 MiB by default) made
//! on the first grant that touches them. A granted range must lie inside
//! one region (a memory window is bound within one region), so a range
//! that crosses extents gets a new extent covering it and every extent it
//! overlaps; the old ones leave the table (no new window uses them) and
//! are deregistered when the last window bound in them goes. Extents never
//! overlap in the table, so the pinned total exceeds what is in use only
//! by chunk rounding and by such superseded extents while their windows
//! live.
//!
//! Where the registration runs: the node calls `Listener::grant` under
//! its protocol lock (`fabric::no_blocking`), on any thread, the progress
//! thread and TensorFlow's (through `rdev_recv`) included. There, and on
//! any event thread, it never registers: a new extent (one chunk, 64 MiB:
//! milliseconds on a NIC, and many more on Soft-RoCE) is a job for
//! `rdev-verbs-setup`, and the window's bind
//! waits in its connection's ordered queue until the extent is ready
//! ([`Extent::ready_or_wait`]); the Publish naming the range is queued
//! behind the bind, so the sender learns the key only after the window is
//! valid. If the registration fails, the connections waiting on it are
//! closed with the reason (the memlock limit, typically), and a grant that
//! would pass RLIMIT_MEMLOCK fails at once. Only a caller holding no lock
//! on its own thread (tools and tests, which hand the key out directly)
//! registers the extent itself, so the key is usable when `grant` returns.
//!
//! Without type-2 memory windows the key a grant returns is a region's own
//! rkey, which must exist when `grant` returns: the arena is then
//! registered whole when its first connection is set up (on
//! `rdev-verbs-setup`) or at `listen` for an address bound to a device,
//! as before. On-demand paging (`IBV_ACCESS_ON_DEMAND`) would make all of
//! this unnecessary where the NIC has it; rxe (the tested device) does not.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::Mr;
use crate::error::{Error, Result};
use crate::fabric::verbs::device::{self, Pd};
use crate::fabric::ConnId;
use crate::stats::Stats;

/// Bytes of arena extents registered (the `verbs_arena_pinned_bytes` gauge).
static ARENA_PINNED: AtomicU64 = AtomicU64::new(0);

fn account(n: u64, add: bool) {
    let now = if add { ARENA_PINNED.fetch_add(n, Ordering::Relaxed) + n } else { ARENA_PINNED.fetch_sub(n, Ordering::Relaxed) - n };
    Stats::global().c.verbs_arena_pinned_bytes.store(now, Ordering::Relaxed);
}

/// One arena's registration on one device.
pub(crate) struct ArenaReg {
    pd: Arc<Pd>,
    /// Address of the arena's registration mapping (`Arena::registration_base`).
    pub base: u64,
    pub len: u64,
    chunk: u64,
    access: u32,
    /// Type-2 windows give access (lazy extents); else the whole arena is
    /// one region whose key every grant answers.
    pub windows: bool,
    /// Extents by start offset; never overlapping.
    table: Mutex<BTreeMap<u64, Arc<Extent>>>,
}

enum State {
    /// Registration queued; these connections' binds wait for it.
    Pending(Vec<ConnId>),
    Ready,
    Failed(Error),
}

/// A chunk-aligned range of the arena with its region (once registered).
pub(crate) struct Extent {
    /// Arena offsets.
    pub start: u64,
    pub end: u64,
    base: u64,
    access: u32,
    mr: OnceLock<Mr>,
    state: Mutex<State>,
}

/// What a bind waiting on an extent should do.
pub(crate) enum Ready {
    Yes,
    /// Not yet: the connection is pumped again when it is.
    Wait,
    Failed(Error),
}

impl ArenaReg {
    /// The registration of `len` bytes at `base` on `pd`. Without windows
    /// it registers (pins) all of it now: never on the progress thread.
    pub fn new(pd: &Arc<Pd>, base: *mut u8, len: u64, windows: bool, chunk: u64, access: u32) -> Result<Arc<ArenaReg>> {
        let a = Arc::new(ArenaReg {
            pd: pd.clone(),
            base: base as u64,
            len,
            chunk: chunk.max(crate::fabric::arena::page_size() as u64),
            access,
            windows,
            table: Mutex::new(BTreeMap::new()),
        });
        if !windows {
            device::memlock_check(super::pinned_bytes() + len, "the receive arena (no memory windows: registered whole)")?;
            let e = Arc::new(Extent::new(0, len, a.base, access));
            e.register(pd)?;
            a.table.lock().insert(0, e);
        }
        Ok(a)
    }

    /// Without windows: the region all senders write through.
    pub fn whole(&self) -> Option<Arc<Extent>> {
        self.table.lock().get(&0).filter(|e| e.end == self.len && e.mr.get().is_some()).cloned()
    }

    /// The extent a window over `off..off+len` is bound in; the flag says
    /// it is new and its registration must be started ([`Extent::register`]).
    pub fn cover(&self, off: u64, len: u64) -> Result<(Arc<Extent>, bool)> {
        let end = off + len;
        let mut t = self.table.lock();
        if let Some((_, e)) = t.range(..=off).next_back() {
            // A failed registration is tried again by a later grant.
            if e.end >= end && !e.failed() {
                return Ok((e.clone(), false));
            }
        }
        let mut s = off / self.chunk * self.chunk;
        let mut e = end.div_ceil(self.chunk).saturating_mul(self.chunk).min(self.len);
        let over: Vec<u64> = t.range(..e).filter(|(_, x)| x.end > s).map(|(k, _)| *k).collect();
        for k in &over {
            if let Some(x) = t.get(k) {
                s = s.min(x.start);
                e = e.max(x.end);
            }
        }
        let n = e - s;
        if !super::may_pin(n) {
            return Err(Error::ResourceExhausted(format!(
                "registering {n} bytes of the receive arena for a slot would exceed RLIMIT_MEMLOCK ({} bytes, {} pinned): \
                 raise it (`ulimit -l unlimited`, `* - memlock unlimited` in /etc/security/limits.conf, \
                 `--ulimit memlock=-1` for containers) or use a smaller RDMA_DEVICE_ARENA_BYTES",
                device::memlock_limit().unwrap_or(u64::MAX),
                super::pinned_bytes()
            )));
        }
        for k in over {
            t.remove(&k);
        }
        let x = Arc::new(Extent::new(s, e, self.base, self.access));
        t.insert(s, x.clone());
        Ok((x, true))
    }

    /// Keys of the registered extents (tests: they grant no remote access
    /// with windows).
    pub fn rkeys(&self) -> Vec<u32> {
        self.table.lock().values().filter_map(|e| e.mr.get().map(|m| m.rkey)).collect()
    }

    pub fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }
}

impl Extent {
    fn new(start: u64, end: u64, base: u64, access: u32) -> Extent {
        Extent { start, end, base, access, mr: OnceLock::new(), state: Mutex::new(State::Pending(Vec::new())) }
    }

    /// Register (pin) the extent; the connections that waited for it are
    /// returned, to be pumped. On the setup thread (or at `listen`).
    pub fn register(&self, pd: &Arc<Pd>) -> Result<Vec<ConnId>> {
        // SAFETY: the range lies in the arena's registration mapping, which
        // lives as long as its arena; the listener holds the arena, and the
        // extent (held by the listener's registration and its windows) is
        // dropped before the listener is.
        let r = unsafe { Mr::register(pd, (self.base + self.start) as *const u8, (self.end - self.start) as usize, self.access) };
        let mut st = self.state.lock();
        let waiters = match std::mem::replace(&mut *st, State::Ready) {
            State::Pending(w) => w,
            _ => Vec::new(),
        };
        match r {
            Ok(mr) => {
                let n = mr.pinned();
                let _ = self.mr.set(mr);
                account(n, true);
                log::debug!("verbs: arena bytes {}..{} registered ({n} bytes)", self.start, self.end);
                Ok(waiters)
            }
            Err(e) => {
                *st = State::Failed(e.clone());
                if waiters.is_empty() {
                    Err(e)
                } else {
                    log::warn!("verbs: registering arena bytes {}..{} failed: {e}", self.start, self.end);
                    Ok(waiters)
                }
            }
        }
    }

    /// Whether a bind in this extent can be posted now; if not yet, `conn`
    /// is pumped again once it is registered.
    pub fn ready_or_wait(&self, conn: ConnId) -> Ready {
        let mut st = self.state.lock();
        match &mut *st {
            State::Ready => match self.mr.get() {
                Some(_) => Ready::Yes,
                None => Ready::Failed(Error::Internal("arena extent without a region".into())),
            },
            State::Pending(w) => {
                if !w.contains(&conn) {
                    w.push(conn);
                }
                Ready::Wait
            }
            State::Failed(e) => Ready::Failed(e.clone()),
        }
    }

    pub fn mr(&self) -> Option<&Mr> {
        self.mr.get()
    }

    fn failed(&self) -> bool {
        matches!(*self.state.lock(), State::Failed(_))
    }
}

impl Drop for Extent {
    fn drop(&mut self) {
        if let Some(m) = self.mr.get() {
            account(m.pinned(), false);
        }
    }
}
