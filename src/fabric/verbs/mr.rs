//! Memory registration: the RAII memory region, the account of what this
//! process pinned (checked against RLIMIT_MEMLOCK before pinning more), and
//! each connection's registered buffer slab (message send buffers, small
//! write buffers, write staging chunks) carved from one allocation and one
//! registration.
//!
//! - `cache`: the sender's registration cache for write sources (zero-copy
//!   writes without a registration per write), kept honest by `watch`;
//! - `watch`: userfaultfd events that say a registered range's pages may
//!   no longer be the ones the process maps there;
//! - `arena`: the receiver's arena, registered in chunks as slots are
//!   placed in them.
//!
//! Deregistration unpins every page of a region and can take long for a
//! large one: a region dropped on a backend's event thread (the progress
//! thread) is handed to `rdev-verbs-dereg` instead (see `dereg`).

pub(crate) mod arena;
pub(crate) mod cache;
mod dereg;
pub(crate) mod watch;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rdma_sys::*;

use super::device::Pd;
use crate::error::{Error, Result};

/// Access for memory the NIC only reads (write sources).
pub const ACCESS_LOCAL_READ: u32 = 0;
/// Access for memory the NIC writes locally (receives, read targets).
pub const ACCESS_LOCAL_WRITE: u32 = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
/// Access for the receive arena without memory windows: peers write it
/// through this region's rkey (all senders share it). No remote read:
/// nothing in the protocol reads a peer's memory, so no peer can read ours.
pub const ACCESS_REMOTE: u32 = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
/// Access for the receive arena with memory windows (see `mw`): no remote
/// access through the region itself; type-2 windows bound over granted
/// ranges give it. Remote-write windows need local write on the region.
pub const ACCESS_WINDOWS: u32 = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 | ibv_access_flags::IBV_ACCESS_MW_BIND.0;

/// Bytes pinned by every region this process has registered and not yet
/// deregistered (whole pages, as the kernel counts them against
/// RLIMIT_MEMLOCK; regions over the same pages count twice there too).
static PINNED: AtomicU64 = AtomicU64::new(0);

/// Bytes this backend has pinned (see [`PINNED`]).
pub fn pinned_bytes() -> u64 {
    PINNED.load(Ordering::Relaxed)
}

/// Whether `len` more bytes may be pinned under RLIMIT_MEMLOCK, counting
/// what this backend pinned already (`getrlimit` per call: a cheap
/// syscall, asked only before a new registration). Without a limit (or
/// with CAP_IPC_LOCK) always. Other pinning in the process (mlock) is not
/// seen: `ibv_reg_mr` failing with ENOMEM is then the backstop.
pub fn may_pin(len: u64) -> bool {
    match super::device::memlock_limit() {
        None => true,
        Some(lim) => pinned_bytes().saturating_add(len) <= lim,
    }
}

/// The page-aligned span `[start, end)` that holds `len` bytes at `addr`.
pub fn page_span(addr: u64, len: usize) -> (u64, u64) {
    let page = crate::fabric::arena::page_size() as u64;
    let start = addr & !(page - 1);
    let end = (addr + len as u64).div_ceil(page) * page;
    (start, end)
}

fn account(delta: i64) {
    let now = if delta >= 0 {
        PINNED.fetch_add(delta as u64, Ordering::Relaxed) + delta as u64
    } else {
        PINNED.fetch_sub(delta.unsigned_abs(), Ordering::Relaxed) - delta.unsigned_abs()
    };
    crate::stats::Stats::global().c.verbs_pinned_bytes.store(now, Ordering::Relaxed);
}

/// A registered memory region. Holds its PD (and so the context) alive.
pub struct Mr {
    raw: *mut ibv_mr,
    pub lkey: u32,
    pub rkey: u32,
    pub addr: u64,
    pub len: usize,
    /// The access flags it was registered with.
    pub access: u32,
    _pd: Arc<Pd>,
}

// SAFETY: an MR is an immutable handle after registration.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    /// Register `len` bytes at `addr`.
    ///
    /// # Safety
    /// The memory must stay mapped (and, for write access, writable) for the
    /// lifetime of the returned `Mr` and of every work request using it.
    pub unsafe fn register(pd: &Arc<Pd>, addr: *const u8, len: usize, access: u32) -> Result<Mr> {
        // Pinning takes milliseconds per 64 MiB: never on an event thread
        // or under the node's protocol lock (checked in debug builds).
        debug_assert!(crate::fabric::may_block(), "memory registered on {:?}, an event thread or under a lock others wait on", std::thread::current().name());
        // SAFETY: pd is live; the memory contract is the caller's.
        let raw = unsafe { ibv_reg_mr(pd.raw, addr as *mut _, len, access as i32) };
        if raw.is_null() {
            let err = std::io::Error::last_os_error();
            let hint = match err.raw_os_error() {
                Some(libc::ENOMEM) | Some(libc::EPERM) | Some(libc::EAGAIN) => format!(
                    "; memlock limit is {}: raise it with `ulimit -l unlimited` or \
                     `* - memlock unlimited` in /etc/security/limits.conf",
                    super::device::memlock_limit()
                        .map(|l| format!("{l} bytes"))
                        .unwrap_or_else(|| "unlimited".into())
                ),
                _ => String::new(),
            };
            return Err(Error::ResourceExhausted(format!(
                "ibv_reg_mr of {len} bytes on {}: {err}{hint}",
                pd.ctx.info.name
            )));
        }
        // SAFETY: raw is a valid MR just returned.
        let (lkey, rkey) = unsafe { ((*raw).lkey, (*raw).rkey) };
        let (s, e) = page_span(addr as u64, len);
        account((e - s) as i64);
        Ok(Mr { raw, lkey, rkey, addr: addr as u64, len, access, _pd: pd.clone() })
    }

    /// Deregister now, on this thread, whichever it is.
    pub(crate) fn release_here(mut self) {
        self.dereg();
    }

    fn dereg(&mut self) {
        let raw = std::mem::replace(&mut self.raw, std::ptr::null_mut());
        if raw.is_null() {
            return;
        }
        // SAFETY: raw from ibv_reg_mr, deregistered once (nulled); no
        // posted work uses it any more (owners drop regions only after
        // their QP is destroyed or the work request completed).
        let rc = unsafe { ibv_dereg_mr(raw) };
        if rc != 0 {
            log::warn!("verbs: ibv_dereg_mr failed ({rc})");
        }
        account(-(self.pinned() as i64));
    }

    /// The bytes this region pins (whole pages).
    pub fn pinned(&self) -> u64 {
        let (s, e) = page_span(self.addr, self.len);
        e - s
    }

    pub(crate) fn raw(&self) -> *mut ibv_mr {
        self.raw
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        if self.raw.is_null() {
            return;
        }
        if !crate::fabric::may_block() {
            // Not on the progress thread, nor under a lock others wait
            // on (a window revoked under the node's protocol lock drops
            // its extent): unpinning may take long. The
            // region moves to the deregistration thread as it is (the
            // pages stay pinned and valid until then; no work request
            // uses it any more).
            let moved = Mr {
                raw: std::mem::replace(&mut self.raw, std::ptr::null_mut()),
                lkey: self.lkey,
                rkey: self.rkey,
                addr: self.addr,
                len: self.len,
                access: self.access,
                _pd: self._pd.clone(),
            };
            dereg::later(moved);
            return;
        }
        self.dereg();
    }
}

/// Page-aligned heap memory (registered slabs want whole pages).
pub struct PageBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain owned memory.
unsafe impl Send for PageBuf {}
// SAFETY: shared access is coordinated by the owner (index ownership).
unsafe impl Sync for PageBuf {}

impl PageBuf {
    pub fn new(len: usize) -> Result<PageBuf> {
        let page = crate::fabric::arena::page_size();
        let len = len.max(1).div_ceil(page) * page;
        let mut p: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: p is a valid out-pointer; alignment is a power of two.
        let rc = unsafe { libc::posix_memalign(&mut p, page, len) };
        if rc != 0 || p.is_null() {
            return Err(Error::ResourceExhausted(format!("allocating {len} bytes of buffers")));
        }
        // SAFETY: fresh allocation of len bytes.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, len) };
        Ok(PageBuf { ptr: p.cast(), len })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        // SAFETY: ptr came from posix_memalign.
        unsafe { libc::free(self.ptr.cast()) };
    }
}

/// One connection's registered buffers: `n_recv` receive buffers and
/// `n_send` send buffers of `slot` bytes each, then `n_chunks` staging
/// chunks of `chunk` bytes. Field order matters for drop: the MR goes first.
pub struct Slab {
    pub mr: Mr,
    mem: PageBuf,
    pub slot: usize,
    pub n_recv: u32,
    pub n_send: u32,
    pub chunk: usize,
}

impl Slab {
    pub fn new(pd: &Arc<Pd>, slot: usize, n_recv: u32, n_send: u32, chunk: usize, n_chunks: u32) -> Result<Slab> {
        let len = slot * (n_recv + n_send) as usize + chunk * n_chunks as usize;
        let mem = PageBuf::new(len)?;
        // SAFETY: mem lives in the same struct and is dropped after mr.
        let mr = unsafe { Mr::register(pd, mem.as_ptr(), mem.len(), ACCESS_LOCAL_WRITE)? };
        Ok(Slab { mr, mem, slot, n_recv, n_send, chunk })
    }

    fn base(&self) -> *mut u8 {
        self.mem.as_ptr()
    }

    /// Address of send buffer `i`.
    pub fn send_buf(&self, i: u32) -> *mut u8 {
        // SAFETY: i < n_send keeps the offset inside the allocation.
        unsafe { self.base().add(self.slot * (self.n_recv + i) as usize) }
    }

    /// Address of staging chunk `i`.
    pub fn chunk_buf(&self, i: u32) -> *mut u8 {
        let off = self.slot * (self.n_recv + self.n_send) as usize + self.chunk * i as usize;
        // SAFETY: i < n_chunks keeps the offset inside the allocation.
        unsafe { self.base().add(off) }
    }
}
