//! Memory registration: the RAII memory region, and each connection's
//! registered buffer slab (receive buffers, message send buffers, write
//! staging chunks) carved from one allocation and one registration.

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
        Ok(Mr { raw, lkey, rkey, addr: addr as u64, len, access, _pd: pd.clone() })
    }

    /// Registered for memory-window binds (the arena with windows)?
    pub fn windows(&self) -> bool {
        self.access & ibv_access_flags::IBV_ACCESS_MW_BIND.0 != 0
    }

    pub(crate) fn raw(&self) -> *mut ibv_mr {
        self.raw
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: raw from ibv_reg_mr; no posted work uses it any more (owners
        // drop MRs only after their QP is destroyed or the WR completed).
        let rc = unsafe { ibv_dereg_mr(self.raw) };
        if rc != 0 {
            log::warn!("verbs: ibv_dereg_mr failed ({rc})");
        }
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
