//! The doorbell ring: how a receiver learns that a one-sided write landed.
//!
//! One ring per sender → receiver connection, in a memfd both map. The
//! sender copies the payload into the receiver's arena, then appends the
//! immediate to the ring (release), the shm equivalent of a
//! write-with-immediate completion. The receiver's progress thread polls
//! every ring (acquire) and blocks on one eventfd when all are idle; a
//! sender rings the eventfd only when the receiver has said it sleeps
//! (a Dekker-style handshake on `tail` and `sleeping`, both SeqCst).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::constants::RING_ENTRIES;
use crate::error::{Error, Result};
use crate::fabric::arena::{map_shared, page_size};

const TAIL_OFF: usize = 0;
const HEAD_OFF: usize = 64;
const SLEEP_OFF: usize = 128;
const ENTRIES_OFF: usize = 4096;

pub fn ring_bytes() -> usize {
    let b = ENTRIES_OFF + RING_ENTRIES * 4;
    b.div_ceil(page_size()) * page_size()
}

/// A mapped ring (either end).
pub struct Ring {
    fd: OwnedFd,
    base: *mut u8,
    len: usize,
}

// SAFETY: all shared state is accessed through atomics in the mapping.
unsafe impl Send for Ring {}
// SAFETY: as above.
unsafe impl Sync for Ring {}

impl Ring {
    /// A new zeroed ring (receiver side).
    pub fn create() -> Result<Ring> {
        let len = ring_bytes();
        // SAFETY: constant C string, plain flags.
        let raw = unsafe { libc::memfd_create(c"rdma_device-ring".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(Error::last_os("memfd_create for a doorbell ring"));
        }
        // SAFETY: fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: valid fd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(Error::last_os("ftruncate of a doorbell ring"));
        }
        Ring::map(fd)
    }

    /// Map a ring received from the receiver (sender side).
    pub fn map(fd: OwnedFd) -> Result<Ring> {
        let len = ring_bytes();
        // SAFETY: fstat on a valid fd into a zeroed stat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 || (st.st_size as usize) < len {
            return Err(Error::Protocol("doorbell ring descriptor is too small".into()));
        }
        let base = map_shared(fd.as_raw_fd(), len)?;
        Ok(Ring { fd, base, len })
    }

    pub fn fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    fn word64(&self, off: usize) -> &AtomicU64 {
        // SAFETY: off is one of our 64-byte aligned constants inside the
        // mapping, which lives as long as self.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }

    fn word32(&self, off: usize) -> &AtomicU32 {
        // SAFETY: as in word64; 4-byte aligned and inside the mapping.
        unsafe { &*(self.base.add(off) as *const AtomicU32) }
    }

    fn entry(&self, i: u64) -> &AtomicU32 {
        self.word32(ENTRIES_OFF + (i as usize % RING_ENTRIES) * 4)
    }

    /// Producer: append `imm`. Returns false when the ring is full (the
    /// caller waits and retries). Returns whether the consumer sleeps, i.e.
    /// must be woken, in the `Ok` value.
    pub fn try_push(&self, imm: u32) -> Option<bool> {
        let tail = self.word64(TAIL_OFF).load(Ordering::Relaxed);
        let head = self.word64(HEAD_OFF).load(Ordering::Acquire);
        if tail.wrapping_sub(head) >= RING_ENTRIES as u64 {
            return None;
        }
        self.entry(tail).store(imm, Ordering::Relaxed);
        // Both words live in memory the peer can write: wrap, never panic.
        self.word64(TAIL_OFF).store(tail.wrapping_add(1), Ordering::SeqCst);
        Some(self.word32(SLEEP_OFF).load(Ordering::SeqCst) != 0)
    }

    /// Consumer: take every published entry.
    pub fn drain(&self, mut f: impl FnMut(u32)) -> usize {
        let head = self.word64(HEAD_OFF).load(Ordering::Relaxed);
        let tail = self.word64(TAIL_OFF).load(Ordering::Acquire);
        if tail == head {
            return 0;
        }
        // A corrupt tail from a misbehaving peer must not make us spin
        // through billions of entries: never read more than one ring's worth.
        let n = tail.wrapping_sub(head).min(RING_ENTRIES as u64);
        for i in 0..n {
            f(self.entry(head.wrapping_add(i)).load(Ordering::Relaxed));
        }
        self.word64(HEAD_OFF).store(head.wrapping_add(n), Ordering::Release);
        n as usize
    }

    pub fn has_entries(&self) -> bool {
        self.word64(TAIL_OFF).load(Ordering::SeqCst) != self.word64(HEAD_OFF).load(Ordering::Relaxed)
    }

    /// Consumer: announce (or retract) that it is about to sleep.
    pub fn set_sleeping(&self, sleeping: bool) {
        self.word32(SLEEP_OFF).store(sleeping as u32, Ordering::SeqCst);
    }
}

/// A word of the ring's shared memory, for the fuzz target that plays a
/// peer scribbling over all of it.
#[cfg(fuzzing)]
pub enum RingWord {
    Tail,
    Head,
    Sleeping,
    Entry(usize),
}

#[cfg(fuzzing)]
impl Ring {
    /// Overwrite one word of the shared ring as a hostile peer could.
    pub fn poke(&self, w: RingWord, v: u64) {
        match w {
            RingWord::Tail => self.word64(TAIL_OFF).store(v, Ordering::SeqCst),
            RingWord::Head => self.word64(HEAD_OFF).store(v, Ordering::SeqCst),
            RingWord::Sleeping => self.word32(SLEEP_OFF).store(v as u32, Ordering::SeqCst),
            RingWord::Entry(i) => self.entry(i as u64).store(v as u32, Ordering::SeqCst),
        }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping we created.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// An eventfd used to wake a sleeping progress thread.
pub struct Doorbell {
    fd: OwnedFd,
}

impl Doorbell {
    pub fn create() -> Result<Doorbell> {
        // SAFETY: plain eventfd(2).
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if raw < 0 {
            return Err(Error::last_os("eventfd"));
        }
        // SAFETY: fresh fd we own.
        Ok(Doorbell { fd: unsafe { OwnedFd::from_raw_fd(raw) } })
    }

    pub fn from_fd(fd: OwnedFd) -> Doorbell {
        Doorbell { fd }
    }

    pub fn fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    pub fn ring(&self) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes from a live u64 to our eventfd. A full
        // counter (EAGAIN) already means "wake up", so errors are ignored.
        unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Block until rung or `timeout_ms` passes, then clear the counter.
    pub fn wait(&self, timeout_ms: i32) {
        let mut pfd = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        let mut v: u64 = 0;
        // SAFETY: nonblocking read of 8 bytes into a live u64.
        unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }
}
