//! Completions without a heap allocation per tensor.
//!
//! [`Complete`] is a one-shot callback: every boxed `FnOnce(T)` is one, so
//! Rust callers pass closures as before, while the hot path passes objects
//! of its own types that put their box back into a [`Recycler`] when they
//! complete. A steady stream of tensors then reuses the same few boxes
//! instead of allocating and freeing one per tensor and completion
//! (`tests/alloc.rs` counts).

use parking_lot::Mutex;

/// A callback that runs once with the outcome `T`.
pub trait Complete<T>: Send {
    fn complete(self: Box<Self>, v: T);

    /// True when completing only hands the outcome to a waiting thread
    /// (never blocks, never calls back into the library or an
    /// application): a backend's event thread may then run it itself
    /// instead of handing it to `rdev-callbacks`, which saves a thread
    /// wake-up per completion. False for callbacks (the default).
    fn runs_anywhere(&self) -> bool {
        false
    }

    /// True when a *successful* completion may run on a backend's event
    /// thread: the application promised that its callback returns promptly
    /// and calls only the library's non-blocking functions (`rdev_recv_inline`).
    /// A failed one still goes to `rdev-callbacks` (its handling may start
    /// a fallback). False by default.
    fn event_thread_ok(&self) -> bool {
        false
    }
}

impl<T, F: FnOnce(T) + Send> Complete<T> for F {
    fn complete(self: Box<Self>, v: T) {
        (*self)(v)
    }
}

/// How many free boxes of one type the transport's recyclers keep: more
/// than the tensors in flight at once in any job measured, and a bound on
/// the memory they hold.
pub const KEPT: usize = 4096;

/// A free list of boxes of one type. `boxed` reuses a box when one is
/// free; `recycle` keeps a box (up to `cap`) for the next `boxed`. Objects
/// recycle themselves once their contents are moved out, so a kept box
/// holds nothing alive. Two uncontended lock operations per object.
pub struct Recycler<T> {
    free: Mutex<Vec<Box<T>>>,
    cap: usize,
}

impl<T> Recycler<T> {
    pub const fn new(cap: usize) -> Recycler<T> {
        Recycler { free: parking_lot::const_mutex(Vec::new()), cap }
    }

    /// `v` in a box, reused when one is free.
    pub fn boxed(&self, v: T) -> Box<T> {
        let reused = self.free.lock().pop();
        match reused {
            Some(mut b) => {
                *b = v;
                b
            }
            None => Box::new(v),
        }
    }

    /// Keep `b` for a later `boxed` (dropped when `cap` boxes are kept).
    pub fn recycle(&self, b: Box<T>) {
        let mut f = self.free.lock();
        if f.len() < self.cap && f.try_reserve(1).is_ok() {
            f.push(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boxes_are_reused() {
        static R: Recycler<Option<u64>> = Recycler::new(2);
        let a = R.boxed(Some(1));
        let pa = &*a as *const Option<u64>;
        R.recycle(a);
        let b = R.boxed(Some(2));
        assert_eq!(&*b as *const Option<u64>, pa);
        assert_eq!(*b, Some(2));
    }

    #[test]
    fn closures_complete() {
        let (tx, rx) = std::sync::mpsc::channel();
        let c: Box<dyn Complete<u32>> = Box::new(move |v| tx.send(v).unwrap());
        c.complete(7);
        assert_eq!(rx.recv().unwrap(), 7);
    }
}
