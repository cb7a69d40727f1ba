//! The receive arena: one shared, page-aligned memory mapping per context.
//!
//! Pages are only committed when first touched, so a large arena costs
//! address space, not memory.
//!
//! **Isolation between senders.** The arena is one range of our address
//! space, but no sender ever gets write access to all of it:
//! - An shm sender gets a [`Window`] of its own: a memfd as long as the
//!   arena, sealed against resizing, that only it maps. When a slot is
//!   placed for that sender, [`Arena::show`] maps the window's pages at the
//!   slot's offset of our mapping (`MAP_FIXED`), so what the sender writes
//!   at that offset of its window is what we read there. Whatever it writes
//!   elsewhere in its window lands in pages nobody else sees. When the
//!   range is placed for someone else, their pages are mapped over it and
//!   the old window's pages there are punched out.
//! - The verbs memory region is registered over a second mapping of the
//!   arena's own memfd (`base`) that is never remapped, and a slot placed
//!   for a verbs sender shows those base pages at its offset. A verbs peer
//!   can thus reach base pages only, never a page shown to an shm sender.
//!
//! Ranges are page-aligned (`SLOT_ALIGN`); a kernel whose page size does
//! not divide it gets no windows (senders share the arena, logged).

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Error, Result};

pub struct Arena {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
    /// A second mapping of `fd`, never remapped: what a memory region that
    /// pins pages registers (see the module docs). Mapped on first use.
    base: Mutex<Option<usize>>,
    /// What is mapped where in `ptr..ptr+len`: start → (end, window or
    /// None for the arena's own pages). Covers the whole arena.
    shown: Mutex<Shown>,
}

/// start → (end, the window shown there or None for the arena's own pages).
type Shown = BTreeMap<usize, (usize, Option<Arc<Window>>)>;

/// One sender's view of the arena (see the module docs).
pub struct Window {
    fd: OwnedFd,
}

impl Window {
    /// The descriptor to hand to the sender.
    pub fn fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }
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
        let fd = new_memfd(name, len).map_err(|e| e.context("the receive arena"))?;
        let ptr = map_shared(fd.as_raw_fd(), len)?;
        let mut shown = BTreeMap::new();
        shown.insert(0, (len, None));
        Ok(Arena { fd, ptr, len, base: Mutex::new(None), shown: Mutex::new(shown) })
    }

    /// Can ranges of this arena be given their own windows here?
    pub fn windows_supported() -> bool {
        crate::constants::SLOT_ALIGN % page_size() == 0
    }

    /// A window for one sender: a sparse memfd as long as the arena,
    /// sealed so that nobody can grow or shrink it.
    pub fn new_window(&self) -> Result<Arc<Window>> {
        let fd = new_memfd("rdma_device-window", self.len)?;
        Ok(Arc::new(Window { fd }))
    }

    /// Map `window`'s pages (None: the arena's own) at `off..off+len` of our
    /// mapping, so that only that window's owner can write what we read
    /// there. The range must be page-aligned and must not be in use (no
    /// slot, no lease in it). Pages of windows it replaces are released.
    pub fn show(&self, off: usize, len: usize, window: Option<&Arc<Window>>) -> Result<()> {
        check_range(off, len, self.len)?;
        let page = page_size();
        if off % page != 0 || len % page != 0 || len == 0 {
            return Err(Error::InvalidArgument(format!("range {off}+{len} is not whole pages")));
        }
        let end = off + len;
        let same = |w: &Option<Arc<Window>>| match (w, window) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        let mut shown = self.shown.lock();
        // Split the entries that straddle `off` and `end`.
        for at in [off, end] {
            let cut = shown.range(..at).next_back().map(|(s, (e, w))| (*s, *e, w.clone()));
            if let Some((s, e, w)) = cut {
                if s < at && at < e {
                    shown.insert(s, (at, w.clone()));
                    shown.insert(at, (e, w));
                }
            }
        }
        let inside: Vec<(usize, usize, Option<Arc<Window>>)> =
            shown.range(off..end).map(|(s, (e, w))| (*s, *e, w.clone())).collect();
        if inside.iter().all(|(_, _, w)| same(w)) {
            return Ok(());
        }
        let fd = window.map(|w| w.fd.as_raw_fd()).unwrap_or(self.fd.as_raw_fd());
        // SAFETY: [off, end) lies inside our own mapping (checked above),
        // and the caller guarantees nothing uses those bytes now; MAP_FIXED
        // replaces exactly those pages with the same-length range of `fd`.
        let p = unsafe {
            libc::mmap(
                self.ptr.add(off).cast(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                off as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::last_os("mmap of a sender's window into the arena"));
        }
        for (s, e, w) in inside {
            shown.remove(&s);
            if let Some(w) = w.filter(|w| !same(&Some(w.clone()))) {
                // Nobody reads these pages of the old window any more: give
                // them back. Its owner may still write there; that costs it
                // memory and reaches nobody.
                // SAFETY: fallocate on a valid fd; KEEP_SIZE leaves the seals' concern (the size) alone.
                unsafe {
                    libc::fallocate(w.fd.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, s as libc::off_t, (e - s) as libc::off_t)
                };
            }
        }
        shown.insert(off, (end, window.cloned()));
        // Coalesce with neighbours that show the same pages.
        let next = shown.get(&end).cloned();
        if let Some((e2, w2)) = next {
            if same(&w2) {
                shown.remove(&end);
                shown.insert(off, (e2, window.cloned()));
            }
        }
        let prev = shown.range(..off).next_back().map(|(s, (e, w))| (*s, *e, w.clone()));
        if let Some((s0, e0, w0)) = prev {
            if e0 == off && same(&w0) {
                let (e1, _) = shown.remove(&off).expect("just inserted");
                shown.insert(s0, (e1, w0));
            }
        }
        Ok(())
    }

    /// The address of a mapping of the arena's own pages that is never
    /// remapped, for memory registration (see the module docs). Offsets
    /// match the arena's.
    pub fn registration_base(&self) -> Result<*mut u8> {
        let mut b = self.base.lock();
        if let Some(p) = *b {
            return Ok(p as *mut u8);
        }
        let p = map_shared(self.fd.as_raw_fd(), self.len)?;
        *b = Some(p as usize);
        Ok(p)
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

    /// The memfd, for backends that share all its pages with another
    /// process (tests, and kernels without windows).
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

    /// Fill `out` from `off` (bounds-checked).
    pub fn read_into(&self, off: usize, out: &mut [u8]) -> Result<()> {
        check_range(off, out.len(), self.len)?;
        // SAFETY: range checked against the mapping length; `out` is a
        // distinct, writable buffer of that length.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), out.as_mut_ptr(), out.len()) };
        Ok(())
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
        // SAFETY: ptr/len cover exactly what mmap returned (windows were
        // mapped inside it, so this unmaps them too); the base likewise.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
        if let Some(b) = *self.base.lock() {
            // SAFETY: as above.
            unsafe { libc::munmap(b as *mut libc::c_void, self.len) };
        }
    }
}

/// A memfd of `len` bytes (sparse), sealed so that nobody can grow or
/// shrink it: every one of ours is mapped by another process too, and a
/// peer that shrank one would make our next access to it a SIGBUS.
pub(crate) fn new_memfd(name: &str, len: usize) -> Result<OwnedFd> {
    let cname = std::ffi::CString::new(name).map_err(|_| Error::InvalidArgument("memfd name contains NUL".into()))?;
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // SAFETY: cname is a valid C string; flags are plain constants.
    let raw = unsafe { libc::memfd_create(cname.as_ptr(), flags) };
    if raw < 0 {
        return Err(Error::last_os("memfd_create"));
    }
    // SAFETY: raw is a fresh fd we own.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: fd is valid; len fits off_t on 64-bit Linux.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(Error::last_os("ftruncate of a memfd"));
    }
    // SAFETY: fcntl on a valid fd we own.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL) } != 0 {
        return Err(Error::last_os("sealing a memfd"));
    }
    Ok(fd)
}

/// Check that a descriptor a peer gave us to map cannot shrink under our
/// mapping (a shrunk file turns our access to it into a SIGBUS): it must
/// carry `F_SEAL_SHRINK`, which its owner cannot take back.
pub(crate) fn check_sealed(fd: i32, what: &str) -> Result<()> {
    // SAFETY: fcntl on a descriptor we hold; an invalid one returns -1.
    let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(Error::Protocol(format!("{what}: not a sealable memory file ({})", std::io::Error::last_os_error())));
    }
    if seals & libc::F_SEAL_SHRINK == 0 {
        return Err(Error::Protocol(format!("{what}: the peer's memory file is not sealed against shrinking")));
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The arena and every sender's window are mapped by other processes:
    /// none of them can shrink the file under the receiver's mapping, and a
    /// mapper can check that before it maps.
    #[test]
    fn the_arena_and_its_windows_are_sealed_against_resizing() {
        let a = Arena::new("sealed", 1 << 20).unwrap();
        let w = a.new_window().unwrap();
        for (fd, what) in [(a.fd(), "arena"), (w.fd(), "window")] {
            // SAFETY: ftruncate on a valid fd (expected to fail).
            assert_eq!(unsafe { libc::ftruncate(fd, 4096) }, -1, "the {what} could be shrunk");
            check_sealed(fd, what).unwrap();
        }
        // SAFETY: a fresh unsealed memfd.
        let raw = unsafe { libc::memfd_create(c"plain".as_ptr(), libc::MFD_CLOEXEC) };
        // SAFETY: we own it.
        let plain = unsafe { OwnedFd::from_raw_fd(raw) };
        assert!(check_sealed(plain.as_raw_fd(), "plain").is_err());
    }
}
