//! The locks and atomics of the code that runs under schedule exploration
//! (`--features shuttle`; see `node::rpc::sched_tests` and
//! `node::stream::sched_tests`). In a normal build
//! these are `parking_lot`'s locks and std's atomics, unchanged. With the
//! `shuttle` feature they are the shuttle crate's, which its scheduler
//! controls, so a test can run the real code under many thread
//! interleavings (random and PCT schedules, replayable from a seed).
//!
//! Only code that is explored imports from here; the rest keeps
//! `parking_lot`. A build with `shuttle` is for those tests only: its locks
//! must not be used outside a shuttle run.

#[cfg(not(feature = "shuttle"))]
pub use parking_lot::{Mutex, MutexGuard, RwLock};
#[cfg(not(feature = "shuttle"))]
pub use std::sync::atomic::{AtomicU64, Ordering};

#[cfg(feature = "shuttle")]
pub use explored::{Mutex, MutexGuard, RwLock};
#[cfg(feature = "shuttle")]
pub use shuttle::sync::atomic::{AtomicU64, Ordering};

#[cfg(feature = "shuttle")]
mod explored {
    //! parking_lot's API (no poisoning) over shuttle's locks.

    pub type MutexGuard<'a, T> = shuttle::sync::MutexGuard<'a, T>;

    #[derive(Default)]
    pub struct Mutex<T>(shuttle::sync::Mutex<T>);

    impl<T> Mutex<T> {
        pub fn new(v: T) -> Self {
            Mutex(shuttle::sync::Mutex::new(v))
        }
        pub fn lock(&self) -> MutexGuard<'_, T> {
            self.0.lock().unwrap_or_else(|p| p.into_inner())
        }
        pub fn get_mut(&mut self) -> &mut T {
            self.0.get_mut().unwrap_or_else(|p| p.into_inner())
        }
        pub fn into_inner(self) -> T {
            self.0.into_inner().unwrap_or_else(|p| p.into_inner())
        }
    }

    #[derive(Default)]
    pub struct RwLock<T>(shuttle::sync::RwLock<T>);

    impl<T> RwLock<T> {
        pub fn new(v: T) -> Self {
            RwLock(shuttle::sync::RwLock::new(v))
        }
        pub fn read(&self) -> shuttle::sync::RwLockReadGuard<'_, T> {
            self.0.read().unwrap_or_else(|p| p.into_inner())
        }
        pub fn write(&self) -> shuttle::sync::RwLockWriteGuard<'_, T> {
            self.0.write().unwrap_or_else(|p| p.into_inner())
        }
    }
}
