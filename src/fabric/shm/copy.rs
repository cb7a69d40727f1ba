//! Parallel copy for large shm writes.
//!
//! An RDMA NIC moves a large write with its DMA engines while the sender's
//! CPU does something else; the shm backend's "DMA" is a memcpy on the
//! sender's thread. One core rarely saturates memory bandwidth, so writes
//! of at least `PARALLEL_COPY_MIN` bytes are shared with a small pool of
//! copy threads (`rdev-copy-N`, RDMA_DEVICE_SHM_COPY_THREADS - 1 of them).
//!
//! Threads: `copy` runs on the sending thread; helpers run their own loop.
//! The write is cut into chunks that any of them *claims* from an atomic
//! cursor, the sender included, which starts at once. A helper that wakes
//! late (on a busy machine it may not get a CPU for milliseconds) finds
//! nothing left to claim, so the sender never waits for a helper to be
//! scheduled, only for chunks a helper is already copying: a large write is
//! never much slower than one memcpy, and faster when helpers are free.
//! Helpers help with the newest large copy (one board, not a queue per
//! helper): one woken late finds that copy done, or helps with whichever
//! is current. Locks: each job's `done` mutex, held only to signal
//! completion; the board's and the spare jobs' locks, each held for a
//! field update. A job is reused once no helper holds it, so a steady
//! stream of large writes allocates nothing.
//!
//! Why the helpers are not a `crate::pool::Pool`: a pool hands each job
//! to one of its threads from a FIFO queue, while here every helper joins
//! the one copy under way (a broadcast of the newest job, not a queue).
//! Queued instead, a copy would need one entry per helper, entries of
//! copies long done would wait for helpers that woke late (and keep those
//! jobs' `Arc`s, so that no spare is free and each write allocates), and
//! the helpers would be named `rdev-copy-0..` rather than from 1 (the
//! sender is copier 0).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// Below this, handing chunks to other threads costs more than it saves.
pub const PARALLEL_COPY_MIN: usize = 4 << 20;
/// Chunks are at least this large (and 4 KiB multiples).
const MIN_CHUNK: usize = 256 << 10;
/// Chunks per participant: small enough that a helper preempted in the
/// middle of one holds the sender up for one chunk's copy at most.
const CHUNKS_PER_PART: usize = 4;
/// How long the sender spins for in-flight helper chunks before sleeping.
const SPIN: Duration = Duration::from_micros(200);

struct Job {
    src: usize,
    dst: usize,
    len: usize,
    chunk: usize,
    chunks: usize,
    /// Next chunk to claim.
    next: AtomicUsize,
    /// Chunks copied.
    copied: AtomicUsize,
    done: (Mutex<()>, Condvar),
}

impl Job {
    /// Claim and copy chunks until none are left; true if this call copied
    /// the job's last chunk.
    fn work(&self) -> bool {
        let mut last = false;
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.chunks {
                return last;
            }
            let off = i * self.chunk;
            let n = self.chunk.min(self.len - off);
            // SAFETY: the submitter keeps [src, src+len) readable and
            // [dst, dst+len) writable, not overlapping, until `copied`
            // reaches `chunks`, which it waits for before returning; chunk
            // `i` is claimed by exactly one thread (the cursor).
            unsafe { std::ptr::copy_nonoverlapping((self.src + off) as *const u8, (self.dst + off) as *mut u8, n) };
            last = self.copied.fetch_add(1, Ordering::AcqRel) + 1 == self.chunks;
        }
    }

    fn all_copied(&self) -> bool {
        self.copied.load(Ordering::Acquire) == self.chunks
    }
}

/// The job helpers should help with: the newest large copy under way.
#[derive(Default)]
struct Board {
    current: Option<Arc<Job>>,
    /// Bumped for each new job (helpers wait for a change).
    gen: u64,
}

pub struct CopyPool {
    helpers: usize,
    board: Arc<(Mutex<Board>, Condvar)>,
    /// Finished jobs, reused once no helper holds them.
    spare: Mutex<Vec<Arc<Job>>>,
}

/// Spare jobs kept (a helper holds at most one job at a time, and each
/// concurrent sender one).
const SPARE_JOBS: usize = 16;

static POOL: OnceLock<CopyPool> = OnceLock::new();

impl CopyPool {
    /// The process-wide pool with `threads - 1` helpers (the caller is the
    /// last copier). The first caller decides the size.
    pub fn get(threads: usize) -> &'static CopyPool {
        POOL.get_or_init(|| {
            let board: Arc<(Mutex<Board>, Condvar)> = Arc::default();
            let mut helpers = 0;
            for i in 1..threads.max(1) {
                let b = board.clone();
                let spawned = std::thread::Builder::new().name(format!("rdev-copy-{i}")).spawn(move || {
                    let mut seen = 0;
                    loop {
                        let job = {
                            let mut g = b.0.lock();
                            while g.gen == seen {
                                b.1.wait(&mut g);
                            }
                            seen = g.gen;
                            g.current.clone()
                        };
                        // Woken late, the job may be done (or another one
                        // current): then there is nothing left to claim.
                        let Some(j) = job else { continue };
                        // A panic here cannot come from the copy itself; the
                        // sender would still finish every unclaimed chunk.
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            if j.work() {
                                let _g = j.done.0.lock();
                                j.done.1.notify_all();
                            }
                        }));
                        if r.is_err() {
                            log::error!("shm: a copy thread panicked");
                        }
                    }
                });
                match spawned {
                    Ok(_) => helpers += 1,
                    Err(e) => log::warn!("shm: cannot start a copy thread ({e}); copying with fewer"),
                }
            }
            // Enough spare jobs from the start that one is always free for
            // a sender (each helper holds at most one): none is allocated
            // per write, even while helpers run late.
            let mut spare = Vec::with_capacity(SPARE_JOBS);
            for _ in 0..(helpers + 2).min(SPARE_JOBS) {
                spare.push(Arc::new(Job::idle()));
            }
            CopyPool { helpers, board, spare: Mutex::new(spare) }
        })
    }

    /// Copy `len` bytes from `src` to `dst`, shared with the helpers when
    /// large. Returns when every byte is in place.
    ///
    /// # Safety
    /// `src` is readable and `dst` writable for `len` bytes, the ranges do
    /// not overlap, and nothing else writes `dst` meanwhile.
    pub unsafe fn copy(&self, src: *const u8, dst: *mut u8, len: usize) {
        let parts = self.helpers + 1;
        if len < PARALLEL_COPY_MIN || parts == 1 {
            // SAFETY: per the function contract.
            unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
            return;
        }
        let chunk = (len / (parts * CHUNKS_PER_PART)).max(MIN_CHUNK).div_ceil(4096) * 4096;
        let job = self.job(src as usize, dst as usize, len, chunk);
        {
            let mut b = self.board.0.lock();
            b.current = Some(job.clone());
            b.gen = b.gen.wrapping_add(1);
        }
        self.board.1.notify_all();
        if !job.work() {
            job.wait_copied();
        }
        {
            let mut b = self.board.0.lock();
            if b.current.as_ref().is_some_and(|c| Arc::ptr_eq(c, &job)) {
                b.current = None;
            }
        }
        let mut spare = self.spare.lock();
        if spare.len() < SPARE_JOBS {
            spare.push(job);
        }
    }

    /// A job for this copy: a spare one that no helper holds any more, or
    /// a new one.
    fn job(&self, src: usize, dst: usize, len: usize, chunk: usize) -> Arc<Job> {
        let fresh = Job {
            src,
            dst,
            len,
            chunk,
            chunks: len.div_ceil(chunk),
            next: AtomicUsize::new(0),
            copied: AtomicUsize::new(0),
            done: (Mutex::new(()), Condvar::new()),
        };
        let mut spare = self.spare.lock();
        // Unique: no helper holds it (nor can take it: only the board hands
        // jobs out), so none can claim a chunk of the new copy by mistake.
        if let Some(i) = spare.iter_mut().position(|j| Arc::get_mut(j).is_some()) {
            let mut j = spare.swap_remove(i);
            if let Some(m) = Arc::get_mut(&mut j) {
                *m = fresh;
                return j;
            }
        }
        drop(spare);
        Arc::new(fresh)
    }
}

impl Job {
    /// A job with nothing to copy (a spare).
    fn idle() -> Job {
        Job { src: 0, dst: 0, len: 0, chunk: 1, chunks: 0, next: AtomicUsize::new(0), copied: AtomicUsize::new(0), done: (Mutex::new(()), Condvar::new()) }
    }

    /// Wait for chunks that helpers claimed and are copying right now.
    fn wait_copied(&self) {
        let t = Instant::now();
        while !self.all_copied() {
            if t.elapsed() > SPIN {
                let mut g = self.done.0.lock();
                while !self.all_copied() {
                    self.done.1.wait(&mut g);
                }
                break;
            }
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_copies_are_exact_at_odd_sizes() {
        let pool = CopyPool::get(3);
        for len in [PARALLEL_COPY_MIN, PARALLEL_COPY_MIN + 1, (9 << 20) + 4095, 33 << 20] {
            let src: Vec<u8> = (0..len).map(|i| (i * 131 % 251) as u8).collect();
            let mut dst = vec![0u8; len + 1];
            for _ in 0..3 {
                dst.fill(0);
                // SAFETY: distinct vectors, both of at least `len` bytes.
                unsafe { pool.copy(src.as_ptr(), dst.as_mut_ptr(), len) };
                assert!(dst[..len] == src[..], "copy of {len} bytes differs");
                assert_eq!(dst[len], 0, "copy of {len} bytes wrote past its end");
            }
        }
    }
}
