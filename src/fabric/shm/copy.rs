//! Parallel copy for large shm writes.
//!
//! An RDMA NIC moves a large write with its DMA engines while the sender's
//! CPU does something else; the shm backend's "DMA" is a memcpy on the
//! sender's thread. One core rarely saturates memory bandwidth (measured
//! here: 64 MiB in ~7 ms on one thread, ~4.2 ms on two), so writes of at
//! least `PARALLEL_COPY_MIN` bytes are split across a small pool of copy
//! threads plus the caller. The pool size comes from
//! RDMA_DEVICE_SHM_COPY_THREADS.

use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, OnceLock};

use parking_lot::{Condvar, Mutex};

/// Below this, handing chunks to other threads costs more than it saves.
pub const PARALLEL_COPY_MIN: usize = 4 << 20;

struct Job {
    src: usize,
    dst: usize,
    len: usize,
    left: Arc<(Mutex<usize>, Condvar)>,
}

pub struct CopyPool {
    workers: Vec<Mutex<Sender<Job>>>,
}

static POOL: OnceLock<CopyPool> = OnceLock::new();

impl CopyPool {
    /// The process-wide pool with `threads - 1` helpers (the caller is the
    /// last copier). The first caller decides the size.
    pub fn get(threads: usize) -> &'static CopyPool {
        POOL.get_or_init(|| {
            let mut workers = Vec::new();
            for i in 1..threads.max(1) {
                let (tx, rx) = channel::<Job>();
                let spawned = std::thread::Builder::new().name(format!("rdev-copy-{i}")).spawn(move || {
                    for j in rx {
                        // SAFETY: the submitter keeps both ranges valid and
                        // disjoint from other chunks until `left` reaches 0,
                        // which it waits for before returning.
                        unsafe { std::ptr::copy_nonoverlapping(j.src as *const u8, j.dst as *mut u8, j.len) };
                        let (m, cv) = &*j.left;
                        let mut l = m.lock();
                        *l -= 1;
                        if *l == 0 {
                            cv.notify_all();
                        }
                    }
                });
                match spawned {
                    Ok(_) => workers.push(Mutex::new(tx)),
                    Err(e) => log::warn!("shm: cannot start a copy thread ({e}); copying with fewer"),
                }
            }
            CopyPool { workers }
        })
    }

    /// Copy `len` bytes from `src` to `dst`, in parallel when large.
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
        // Chunks on 4 KiB boundaries; the caller copies the last one.
        let chunk = len.div_ceil(parts).div_ceil(4096) * 4096;
        let left = Arc::new((Mutex::new(0usize), Condvar::new()));
        let mut off = 0;
        let mut sent = 0;
        for w in &self.workers {
            if off + chunk >= len {
                break;
            }
            *left.0.lock() += 1;
            let job = Job { src: src as usize + off, dst: dst as usize + off, len: chunk, left: left.clone() };
            if w.lock().send(job).is_err() {
                *left.0.lock() -= 1;
                break;
            }
            sent += chunk;
            off += chunk;
        }
        // SAFETY: the remainder [sent, len) is ours; per the contract.
        unsafe { std::ptr::copy_nonoverlapping(src.add(sent), dst.add(sent), len - sent) };
        let (m, cv) = &*left;
        let mut l = m.lock();
        while *l > 0 {
            cv.wait(&mut l);
        }
    }
}
