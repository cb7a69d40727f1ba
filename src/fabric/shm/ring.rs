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
use crate::fabric::arena::{check_sealed, map_shared, new_memfd, page_size};

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
        // Sealed: the sender maps it too, and must not be able to shrink
        // it under the receiver's progress thread.
        let fd = new_memfd("rdma_device-ring", ring_bytes()).map_err(|e| e.context("a doorbell ring"))?;
        Ring::map(fd)
    }

    /// Map a ring received from the receiver (sender side).
    pub fn map(fd: OwnedFd) -> Result<Ring> {
        let len = ring_bytes();
        check_sealed(fd.as_raw_fd(), "doorbell ring")?;
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
/// peer scribbling over all of it (and tests).
#[cfg(any(test, fuzzing))]
#[cfg_attr(not(fuzzing), allow(dead_code))]
pub enum RingWord {
    Tail,
    Head,
    Sleeping,
    Entry(usize),
}

#[cfg(any(test, fuzzing))]
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

#[cfg(test)]
mod tests {
    use super::*;

    fn errno() -> i32 {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    /// The sender holds the ring's descriptor: it cannot shrink (or grow)
    /// the file under the receiver's mapping, so it cannot make the
    /// receiver's next access to it a SIGBUS.
    #[test]
    fn a_ring_cannot_be_resized_by_whoever_holds_it() {
        let r = Ring::create().unwrap();
        // SAFETY: ftruncate on a valid fd (expected to fail).
        assert_eq!(unsafe { libc::ftruncate(r.fd(), 0) }, -1, "a ring could be shrunk");
        assert_eq!(errno(), libc::EPERM);
        // SAFETY: as above.
        assert_eq!(unsafe { libc::ftruncate(r.fd(), (ring_bytes() * 2) as libc::off_t) }, -1, "a ring could be grown");
        // The ring still works.
        assert_eq!(r.try_push(7), Some(false));
        let mut got = vec![];
        r.drain(|i| got.push(i));
        assert_eq!(got, vec![7]);
    }

    /// A sender refuses a ring whose receiver could shrink it under the
    /// sender's own mapping.
    #[test]
    fn an_unsealed_ring_is_refused() {
        // SAFETY: constant C string, plain flags.
        let raw = unsafe { libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: valid fd.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), ring_bytes() as libc::off_t) }, 0);
        let e = Ring::map(fd).err().expect("an unsealed ring was mapped");
        assert!(e.to_string().contains("not sealed") || e.to_string().contains("sealable"), "{e}");
    }
}
