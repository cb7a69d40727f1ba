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
//! Locks: each job's `done` mutex alone, held only to signal completion;
//! a helper's queue lock and the spare-job lock, each held for a push or
//! a pop. Jobs are reused once no helper holds them any more, and the
//! queues keep their capacity, so a steady stream of large writes
//! allocates nothing.

use std::collections::VecDeque;
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

/// One helper's queue of jobs.
#[derive(Default)]
struct Queue {
    jobs: Mutex<VecDeque<Arc<Job>>>,
    ready: Condvar,
}

pub struct CopyPool {
    workers: Vec<Arc<Queue>>,
    /// Finished jobs, reused once no helper holds them.
    spare: Mutex<Vec<Arc<Job>>>,
}

/// Spare jobs kept.
const SPARE_JOBS: usize = 8;

static POOL: OnceLock<CopyPool> = OnceLock::new();

impl CopyPool {
    /// The process-wide pool with `threads - 1` helpers (the caller is the
    /// last copier). The first caller decides the size.
    pub fn get(threads: usize) -> &'static CopyPool {
        POOL.get_or_init(|| {
            let mut workers = Vec::new();
            for i in 1..threads.max(1) {
                let q = Arc::new(Queue::default());
                let mine = q.clone();
                let spawned = std::thread::Builder::new().name(format!("rdev-copy-{i}")).spawn(move || loop {
                    let j = {
                        let mut g = mine.jobs.lock();
                        loop {
                            if let Some(j) = g.pop_front() {
                                break j;
                            }
                            mine.ready.wait(&mut g);
                        }
                    };
                    {
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
                    Ok(_) => workers.push(q),
                    Err(e) => log::warn!("shm: cannot start a copy thread ({e}); copying with fewer"),
                }
            }
            CopyPool { workers, spare: Mutex::new(Vec::with_capacity(SPARE_JOBS)) }
        })
    }

    /// Copy `len` bytes from `src` to `dst`, shared with the helpers when
    /// large. Returns when every byte is in place.
    ///
    /// # Safety
    /// `src` is readable and `dst` writable for `len` bytes, the ranges do
    /// not overlap, and nothing else writes `dst` meanwhile.
    pub unsafe fn copy(&self, src: *const u8, dst: *mut u8, len: usize) {
        let parts = self.workers.len() + 1;
        if len < PARALLEL_COPY_MIN || parts == 1 {
            // SAFETY: per the function contract.
            unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
            return;
        }
        let chunk = (len / (parts * CHUNKS_PER_PART)).max(MIN_CHUNK).div_ceil(4096) * 4096;
        let job = self.job(src as usize, dst as usize, len, chunk);
        for w in &self.workers {
            let mut q = w.jobs.lock();
            // Out of memory for the queue only means one copier fewer.
            if q.try_reserve(1).is_ok() {
                q.push_back(job.clone());
                drop(q);
                w.ready.notify_one();
            }
        }
        if !job.work() {
            job.wait_copied();
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
        while let Some(mut j) = spare.pop() {
            // Unique: every helper that took it has dropped its handle, so
            // none can claim a chunk of the new copy by mistake.
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
