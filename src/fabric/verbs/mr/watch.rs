//! The mapping watch: tells the registration cache (`cache`) when the
//! pages behind a virtual range it registered may no longer be the pages
//! the process maps there.
//!
//! Why it is needed: a memory region pins the *physical* pages that were
//! mapped at registration time. Those pages stay valid for the NIC however
//! the application frees its buffer; but if the range is unmapped and
//! mapped again (`munmap` + `mmap`, glibc returning a large block and
//! taking a new one at the same address, `mremap`), or its pages are
//! discarded (`madvise(MADV_DONTNEED/MADV_FREE)`, glibc trimming a heap),
//! the next touch maps *different* pages at the same address and a cached
//! region would send the old ones: silent corruption. The registration
//! cache therefore only keeps a region while the kernel guarantees it
//! would have told us about such a change.
//!
//! How: one userfaultfd per process with the non-cooperative events
//! `UFFD_EVENT_UNMAP` (munmap, mmap over, brk shrink, mremap's source),
//! `UFFD_EVENT_REMOVE` (madvise DONTNEED/FREE/REMOVE) and
//! `UFFD_EVENT_REMAP` (mremap), and each cached range registered with it
//! in write-protect mode (`UFFDIO_REGISTER_MODE_WP`). Nothing is ever
//! write-protected, so the registration causes no page faults at all: it
//! only makes the kernel report those events for the range. A thread
//! that unmaps or discards a watched range waits until the event has been
//! read (`userfaultfd_event_wait_completion`), which is what makes the
//! cache safe: see [`Watch::busy`] for the ordering.
//!
//! The reader thread (`rdev-verbs-watch`) never allocates, frees, logs or
//! takes a lock after it starts: a thread that unmaps a watched range
//! waits for it, possibly while holding the allocator's or the cache's
//! lock, so it must depend on nothing. It publishes each event's range
//! into a fixed ring ([`RING`] entries, a sequence lock each); the cache
//! applies them under its own lock before every lookup. A consumer that
//! fell more than [`RING`] events behind is told so and drops everything.
//!
//! Limits, each making a range *uncacheable* (it is then registered per
//! write, as without the cache), never unsafe:
//! - no userfaultfd (kernel without it, seccomp filters such as Docker's
//!   default profile, `vm.unprivileged_userfaultfd=0` on kernels < 5.11
//!   without CAP_SYS_PTRACE; on newer kernels `UFFD_USER_MODE_ONLY` needs
//!   no privilege): the cache is off for the process (logged once);
//! - ranges that are not private anonymous memory (`/proc/self/pagemap`
//!   says "file page or shared anonymous"): a tmpfs/memfd page can be
//!   dropped through its file descriptor (`fallocate(PUNCH_HOLE)`,
//!   `ftruncate`) with no event; TensorFlow's CPU tensors are private
//!   anonymous memory (malloc);
//! - ranges the kernel refuses to watch (file-backed, hugetlb, registered
//!   with another userfaultfd).
//!
//! Costs: a `UFFDIO_REGISTER` (which may split a VMA) per new cache entry,
//! nothing per hit; an application's `munmap`/`madvise` of a watched range
//! waits for one wake-up of the reader thread.
//!
//! Holders: the watch is process-wide, and several holders may watch
//! overlapping ranges at once (the caches of several devices, a newer
//! entry over an older one's pages, a miss between its watch and its
//! insertion). Each holds a [`Watched`]; a page is unwatched
//! (`UFFDIO_UNREGISTER`) only when the last holder whose range covers it
//! lets go. The holders' ranges are one multiset under one lock, taken
//! with the registration and unregistration ioctls, so a release never
//! unwatches what a concurrent `watch` just covered. (Unwatching a range
//! when only its own cache had no other entry over it lost the watch of
//! every other holder: their later unmap went unseen, and the cache sent
//! old pages.)

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

/// Events the ring holds before a slow consumer must drop everything.
pub const RING: usize = 4096;

const UFFD_API: u64 = 0xAA;
// _IOWR(0xAA, 0x3F, struct uffdio_api) etc. (linux/userfaultfd.h).
const UFFDIO_API: libc::c_ulong = 0xC018_AA3F;
const UFFDIO_REGISTER: libc::c_ulong = 0xC020_AA00;
const UFFDIO_UNREGISTER: libc::c_ulong = 0x8010_AA01;
const UFFDIO_WRITEPROTECT: libc::c_ulong = 0xC018_AA06;
const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
const UFFD_FEATURE_EVENT_REMAP: u64 = 1 << 2;
const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
const UFFD_FEATURE_EVENT_UNMAP: u64 = 1 << 6;
const UFFD_USER_MODE_ONLY: libc::c_int = 1;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
const UFFD_EVENT_REMAP: u8 = 0x14;
const UFFD_EVENT_REMOVE: u8 = 0x15;
const UFFD_EVENT_UNMAP: u8 = 0x16;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

/// `struct uffd_msg`: the event, then its arguments (remap: from, to, len;
/// remove/unmap: start, end; pagefault: flags, address).
#[repr(C)]
#[derive(Clone, Copy)]
struct UffdMsg {
    event: u8,
    _r1: u8,
    _r2: u16,
    _r3: u32,
    a: u64,
    b: u64,
    c: u64,
}

const _: () = assert!(std::mem::size_of::<UffdMsg>() == 32);

#[derive(Default)]
struct Slot {
    /// `i + 1` once event `i` is written here; `u64::MAX` while writing.
    seq: AtomicU64,
    start: AtomicU64,
    end: AtomicU64,
}

/// The process's mapping watch (see the module docs).
pub(crate) struct Watch {
    fd: OwnedFd,
    /// Written (an eventfd count) after each batch of published events, so
    /// that the caches drop what was unmapped without waiting for their
    /// next lookup ([`Watch::wait`]).
    news: OwnedFd,
    pagemap: Option<std::fs::File>,
    ring: Box<[Slot]>,
    /// Events published into the ring.
    head: AtomicU64,
    /// Odd while the reader holds events it read but has not published.
    busy: AtomicU64,
    /// The reader failed: nothing may be cached or trusted any more.
    dead: std::sync::atomic::AtomicBool,
    /// The ranges of every live [`Watched`], one entry per holder (see the
    /// module docs). Never taken by the reader thread.
    holders: parking_lot::Mutex<Vec<(u64, u64)>>,
}

/// One holder's watch of `[start, end)`: the range stays watched at least
/// until this is dropped (see the module docs).
pub(crate) struct Watched {
    w: &'static Watch,
    start: u64,
    end: u64,
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.w.release(self.start, self.end);
    }
}

/// What [`Watch::since`] found.
pub(crate) enum Since {
    /// Every event up to the returned position was passed on.
    Upto(u64),
    /// Events were overwritten before they were seen: drop everything.
    Lost(u64),
}

/// Set in a child process after `fork`. The child inherits the
/// userfaultfd and the caches' entries but not the reader thread, so it
/// learns of no change: no cache of the child's trusts an entry or caches
/// a new one (each write registers its memory). And the inherited
/// descriptor still acts on the parent's address space, so the child
/// never registers or unregisters a range through it (dropping an entry
/// in the child would otherwise unwatch the parent's range).
static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn in_forked_child() {
    FORKED.store(true, Ordering::Relaxed);
}

/// Install (once) the `fork` handler that sets [`FORKED`] in the child.
pub(crate) fn guard_fork() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a handler that only stores to an atomic
        // (async-signal-safe, as a child handler must be).
        if unsafe { libc::pthread_atfork(None, None, Some(in_forked_child)) } != 0 {
            log::warn!("verbs: cannot install the fork handler: a forked child must not use the registration cache");
        }
    });
}

/// Whether this process is a `fork` child of the one that made its caches.
pub(crate) fn forked() -> bool {
    FORKED.load(Ordering::Relaxed)
}

static WATCH: OnceLock<std::result::Result<&'static Watch, String>> = OnceLock::new();

impl Watch {
    /// The process's watch, started on first use; `Err` says why there is
    /// none (logged once by the caller).
    pub fn get() -> std::result::Result<&'static Watch, &'static str> {
        WATCH.get_or_init(Watch::start).as_ref().map(|w| *w).map_err(|e| e.as_str())
    }

    fn start() -> std::result::Result<&'static Watch, String> {
        guard_fork();
        if forked() {
            return Err("a forked child: the watch stayed with the parent".into());
        }
        let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        // SAFETY: plain syscall; the fd is owned below.
        let mut fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags | UFFD_USER_MODE_ONLY) } as libc::c_int;
        if fd < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
            // Before Linux 5.11 there is no UFFD_USER_MODE_ONLY.
            // SAFETY: as above.
            fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) } as libc::c_int;
        }
        if fd < 0 {
            return Err(format!("userfaultfd: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: fd is fresh and ours.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let want = UFFD_FEATURE_EVENT_REMAP | UFFD_FEATURE_EVENT_REMOVE | UFFD_FEATURE_EVENT_UNMAP;
        let mut api = UffdioApi { api: UFFD_API, features: want, ioctls: 0 };
        // SAFETY: a valid uffdio_api for this fd.
        if unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api) } != 0 {
            return Err(format!("UFFDIO_API (unmap/remove/remap events): {}", std::io::Error::last_os_error()));
        }
        if api.features & want != want {
            return Err(format!("userfaultfd lacks unmap/remove/remap events (features {:#x})", api.features));
        }
        // SAFETY: plain syscall; the fd is owned below.
        let news = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if news < 0 {
            return Err(format!("eventfd: {}", std::io::Error::last_os_error()));
        }
        let w: &'static Watch = Box::leak(Box::new(Watch {
            fd,
            // SAFETY: news is fresh and ours.
            news: unsafe { OwnedFd::from_raw_fd(news) },
            pagemap: std::fs::File::open("/proc/self/pagemap").ok(),
            ring: (0..RING).map(|_| Slot::default()).collect(),
            head: AtomicU64::new(0),
            busy: AtomicU64::new(0),
            dead: std::sync::atomic::AtomicBool::new(false),
            holders: parking_lot::Mutex::new(Vec::new()),
        }));
        std::thread::Builder::new()
            .name("rdev-verbs-watch".into())
            .spawn(move || {
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.run())).is_err() {
                    // Never expected (nothing in `run` panics), and fatal
                    // for the cache: it must not trust anything any more.
                    // But unmappers wait for this thread, so it goes on
                    // reading (and dropping) events for ever.
                    w.dead.store(true, Ordering::SeqCst);
                    w.busy.store(1, Ordering::SeqCst);
                    w.drain_forever();
                }
            })
            .map_err(|e| format!("spawning rdev-verbs-watch: {e}"))?;
        Ok(w)
    }

    fn drain_forever(&self) -> ! {
        let mut buf = [0u8; 512];
        loop {
            let mut p = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd; a buffer of whole uffd_msg records.
            unsafe {
                libc::poll(&mut p, 1, -1);
                libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len());
            }
        }
    }

    /// The reader (see the module docs: no allocation, no lock, no log).
    fn run(&self) {
        let mut msgs = [UffdMsg { event: 0, _r1: 0, _r2: 0, _r3: 0, a: 0, b: 0, c: 0 }; 16];
        loop {
            let mut p = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd; waits for the next event.
            if unsafe { libc::poll(&mut p, 1, -1) } <= 0 {
                continue;
            }
            // Odd before the first read: whoever unmapped is released by
            // the read, and must find either this mark or the event.
            self.busy.fetch_add(1, Ordering::SeqCst);
            loop {
                let size = std::mem::size_of_val(&msgs);
                // SAFETY: reads whole uffd_msg records into our array.
                let n = unsafe { libc::read(self.fd.as_raw_fd(), msgs.as_mut_ptr().cast(), size) };
                if n <= 0 {
                    break;
                }
                let n = n as usize / std::mem::size_of::<UffdMsg>();
                for m in &msgs[..n] {
                    match m.event {
                        UFFD_EVENT_UNMAP | UFFD_EVENT_REMOVE => self.publish(m.a, m.b),
                        UFFD_EVENT_REMAP => self.publish(m.a, m.a.saturating_add(m.c)),
                        // Nothing is ever write-protected, so no fault
                        // should come; if one does, lift the protection
                        // of that page (and so wake the faulting thread).
                        UFFD_EVENT_PAGEFAULT => self.unprotect(m.b),
                        _ => {}
                    }
                }
            }
            self.busy.fetch_add(1, Ordering::SeqCst);
            let one: u64 = 1;
            // SAFETY: 8 bytes from a valid u64 to our eventfd (never blocks
            // short of 2^64 - 2 unread wake-ups).
            unsafe { libc::write(self.news.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }

    /// Block until events were published since the last call (for the
    /// thread that applies them to the caches; never the reader).
    pub fn wait(&self) {
        let mut n: u64 = 0;
        // SAFETY: reads 8 bytes into a u64 from our blocking eventfd.
        unsafe { libc::read(self.news.as_raw_fd(), (&mut n as *mut u64).cast(), 8) };
    }

    fn publish(&self, start: u64, end: u64) {
        let i = self.head.load(Ordering::Relaxed);
        let s = &self.ring[(i % RING as u64) as usize];
        s.seq.store(u64::MAX, Ordering::Relaxed);
        fence(Ordering::Release);
        s.start.store(start, Ordering::Relaxed);
        s.end.store(end, Ordering::Relaxed);
        s.seq.store(i + 1, Ordering::Release);
        self.head.store(i + 1, Ordering::SeqCst);
    }

    fn unprotect(&self, addr: u64) {
        let page = crate::fabric::arena::page_size() as u64;
        let mut wp = UffdioWriteprotect { range: UffdioRange { start: addr & !(page - 1), len: page }, mode: 0 };
        // SAFETY: a valid uffdio_writeprotect; failure leaves nothing worse.
        unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_WRITEPROTECT, &mut wp) };
    }

    /// True while the reader has taken events it has not yet published.
    /// A thread's `munmap`/`madvise` of a watched range returns only after
    /// the reader read its event, and the reader marks itself busy before
    /// that read and publishes before it clears the mark; so a lookup that
    /// starts after such a call returned sees either `busy` or the event
    /// in the ring. While busy, lookups must not trust the cache.
    pub fn busy(&self) -> bool {
        self.busy.load(Ordering::SeqCst) & 1 == 1
    }

    /// Events published so far (a position for [`Watch::since`]).
    pub fn head(&self) -> u64 {
        self.head.load(Ordering::SeqCst)
    }

    /// Pass each range unmapped, discarded or moved since position `from`
    /// to `f` (`[start, end)`).
    pub fn since(&self, from: u64, mut f: impl FnMut(u64, u64)) -> Since {
        let head = self.head.load(Ordering::SeqCst);
        if head.saturating_sub(from) > RING as u64 {
            return Since::Lost(head);
        }
        for i in from..head {
            let s = &self.ring[(i % RING as u64) as usize];
            let seq = s.seq.load(Ordering::Acquire);
            let (start, end) = (s.start.load(Ordering::Relaxed), s.end.load(Ordering::Relaxed));
            fence(Ordering::Acquire);
            if seq != i + 1 || s.seq.load(Ordering::Relaxed) != seq {
                return Since::Lost(head);
            }
            f(start, end);
        }
        Since::Upto(head)
    }

    /// Report unmapping, discarding or moving of `[start, end)` (page
    /// aligned) from now on, until the returned holder is dropped. `Err`:
    /// the kernel will not (see the module docs), so a registration there
    /// must not be cached.
    pub fn watch(&'static self, start: u64, end: u64) -> std::io::Result<Watched> {
        if self.dead.load(Ordering::SeqCst) {
            return Err(std::io::Error::other("the watch thread failed"));
        }
        if forked() {
            return Err(std::io::Error::other("a forked child: the watch stayed with the parent"));
        }
        if !self.private_anonymous(start) || !self.private_anonymous(end - 1) {
            return Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "not private anonymous memory"));
        }
        let mut holders = self.holders.lock();
        holders.try_reserve(1).map_err(|_| std::io::Error::from(std::io::ErrorKind::OutOfMemory))?;
        let mut r = UffdioRegister { range: UffdioRange { start, len: end - start }, mode: UFFDIO_REGISTER_MODE_WP, ioctls: 0 };
        // SAFETY: a valid uffdio_register; the kernel checks the range.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_REGISTER, &mut r) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        holders.push((start, end));
        Ok(Watched { w: self, start, end })
    }

    /// A holder of `[start, end)` lets go: unwatch the parts of it no other
    /// holder covers (they may be gone already: ignored).
    fn release(&self, start: u64, end: u64) {
        if forked() {
            return;
        }
        let mut holders = self.holders.lock();
        if let Some(i) = holders.iter().position(|r| *r == (start, end)) {
            holders.swap_remove(i);
        }
        let mut cover: Vec<(u64, u64)> = holders.iter().filter(|(a, b)| *a < end && *b > start).map(|(a, b)| ((*a).max(start), (*b).min(end))).collect();
        cover.sort_unstable();
        let mut at = start;
        for (a, b) in cover.into_iter().chain(std::iter::once((end, end))) {
            if a > at {
                let mut r = UffdioRange { start: at, len: a - at };
                // SAFETY: a valid uffdio_range; errors (range gone) are harmless.
                unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_UNREGISTER, &mut r) };
            }
            at = at.max(b);
        }
    }


    /// Whether the page at `addr` is present private anonymous memory
    /// (`/proc/self/pagemap`: bit 63 present, bit 61 "file page or shared
    /// anonymous"; readable without privilege, the frame numbers are not
    /// needed).
    fn private_anonymous(&self, addr: u64) -> bool {
        use std::os::unix::fs::FileExt;
        let Some(pm) = &self.pagemap else { return false };
        let page = crate::fabric::arena::page_size() as u64;
        let mut b = [0u8; 8];
        if pm.read_exact_at(&mut b, addr / page * 8).is_err() {
            return false;
        }
        let e = u64::from_le_bytes(b);
        e & (1 << 63) != 0 && e & (1 << 61) == 0
    }
}

#[cfg(test)]
mod tests;
