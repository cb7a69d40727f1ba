//! The receive arena: one shared, page-aligned memory mapping per context.
//!
//! It is a memfd so the shm backend can hand the same pages to peers on this
//! host, and the verbs backend registers the same mapping as its memory
//! region: one arena, whatever transport fills it. Pages are only committed
//! when first touched, so a large arena costs address space, not memory.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::error::{Error, Result};

pub struct Arena {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping lives as long as the Arena; concurrent access to its
// bytes is coordinated by the rendezvous protocol (slot ownership), and the
// Arena itself only hands out the base pointer.
unsafe impl Send for Arena {}
// SAFETY: as above; no interior state besides the immutable mapping.
unsafe impl Sync for Arena {}

impl Arena {
    /// A new arena of `len` bytes (rounded up to whole pages).
    pub fn new(name: &str, len: usize) -> Result<Arena> {
        if len == 0 {
            return Err(Error::InvalidArgument("arena length must be > 0".into()));
        }
        let page = page_size();
        let len = len.div_ceil(page) * page;
        let cname = std::ffi::CString::new(name)
            .map_err(|_| Error::InvalidArgument("arena name contains NUL".into()))?;
        // SAFETY: cname is a valid C string; flags are plain constants.
        let raw = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(Error::last_os("memfd_create for the receive arena"));
        }
        // SAFETY: raw is a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: fd is valid; len fits off_t on 64-bit Linux.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(Error::last_os("ftruncate of the receive arena"));
        }
        let ptr = map_shared(fd.as_raw_fd(), len)?;
        Ok(Arena { fd, ptr, len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Base address of the local mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The memfd, for backends that share the pages with other processes.
    pub fn fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// A copy of `len` bytes at `off` (bounds-checked). For tests and
    /// diagnostics; the data path reads slots in place.
    pub fn copy_out(&self, off: usize, len: usize) -> Result<Vec<u8>> {
        check_range(off, len, self.len)?;
        let mut v = vec![0u8; len];
        // SAFETY: range checked against the mapping length.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), v.as_mut_ptr(), len) };
        Ok(v)
    }

    /// Copy `src` to `off` (bounds-checked). For tests and diagnostics.
    pub fn copy_in(&self, off: usize, src: &[u8]) -> Result<()> {
        check_range(off, src.len(), self.len)?;
        // SAFETY: range checked against the mapping length.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(off), src.len()) };
        Ok(())
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly what mmap returned.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

pub(crate) fn check_range(off: usize, len: usize, total: usize) -> Result<()> {
    match off.checked_add(len) {
        Some(end) if end <= total => Ok(()),
        _ => Err(Error::InvalidArgument(format!(
            "range {off}+{len} is outside a region of {total} bytes"
        ))),
    }
}

/// Map `len` bytes of `fd` shared and writable.
pub(crate) fn map_shared(fd: i32, len: usize) -> Result<*mut u8> {
    // SAFETY: a fresh mapping at a kernel-chosen address; fd validity is
    // checked by the kernel.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(Error::last_os("mmap of shared memory"));
    }
    Ok(p.cast())
}
