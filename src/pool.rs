//! Threads we own that serve a queue of jobs: the one implementation behind
//! every worker pool of the crate (the thread list is docs/threads.md).
//! Two shapes:
//! - [`Pool`], owned by its user (a node's write engine `rdev-write-N`,
//!   its callback thread `rdev-callbacks`): dropping it closes its queue;
//!   its threads then run what is queued and end. Nobody joins them (the
//!   owner may be dropped on one of them).
//! - [`ProcessPool`], a `static` started on first use and kept for the
//!   process's life (the node's `rdev-connect-N`, `rdev-place-N` and
//!   `rdev-stream-N`; the verbs backend's `rdev-verbs-setup`,
//!   `rdev-verbs-copy` and `rdev-verbs-dereg`).
//!
//! Not here: the shm backend's copy helpers (`rdev-copy-N`,
//! fabric/shm/copy.rs), which all work on the one copy under way instead
//! of taking jobs from a queue (that module says why).
//!
//! What both guarantee:
//! - a fixed number of threads, named `name` when there is one and
//!   `name-0`, `name-1`, … when there are more;
//! - queueing never blocks: the queue is unbounded (each user bounds what
//!   it queues, and every job bounds its own waits, so a queue drains) and
//!   keeps its capacity, so a steady state allocates nothing;
//! - jobs are taken in the order they were queued; with one thread they
//!   also run in that order (`rdev-callbacks` keeps the order of the events
//!   that produced its callbacks);
//! - every job runs inside `catch_unwind`: a panic is logged with its
//!   message and the thread takes the next job;
//! - a thread that cannot start is logged and the pool runs with the
//!   others; with none, or without memory to queue a job, nothing is
//!   queued: [`Pool::push`] hands the job back to its caller, and
//!   [`ProcessPool::schedule`] runs it on the calling thread (still inside
//!   `catch_unwind`).
//!
//! No deadlines and no counters live here: the jobs bound their waits, and
//! their users count what they hand over.

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};

use parking_lot::{Condvar, Mutex};

/// A job for a [`ProcessPool`].
pub type Job = Box<dyn FnOnce() + Send>;

struct State<T> {
    jobs: VecDeque<T>,
    closed: bool,
}

/// The queue in front of a pool's threads: FIFO, closable.
struct Queue<T> {
    q: Mutex<State<T>>,
    cv: Condvar,
}

impl<T> Queue<T> {
    fn with_room(room: usize) -> Queue<T> {
        Queue { q: Mutex::new(State { jobs: VecDeque::with_capacity(room), closed: false }), cv: Condvar::new() }
    }

    /// `Err(job)` only when there is no memory for it.
    fn push(&self, job: T) -> Result<(), T> {
        let mut q = self.q.lock();
        if q.jobs.try_reserve(1).is_err() {
            return Err(job);
        }
        q.jobs.push_back(job);
        drop(q);
        self.cv.notify_one();
        Ok(())
    }

    /// The next job, waiting for one; `None` once the queue is closed and
    /// drained.
    fn pop(&self) -> Option<T> {
        let mut q = self.q.lock();
        loop {
            if let Some(j) = q.jobs.pop_front() {
                return Some(j);
            }
            if q.closed {
                return None;
            }
            self.cv.wait(&mut q);
        }
    }

    fn close(&self) {
        self.q.lock().closed = true;
        self.cv.notify_all();
    }
}

/// Threads that serve jobs of type `T` with one function (see the module
/// docs); dropping it closes the queue.
pub struct Pool<T> {
    queue: Arc<Queue<T>>,
    name: &'static str,
    /// Threads that started.
    threads: usize,
}

impl<T: Send + 'static> Pool<T> {
    /// Start `threads` threads that run `serve` on each job queued, with
    /// room for `room` jobs before the queue first grows.
    pub fn start(name: &'static str, threads: usize, room: usize, serve: impl Fn(T) + Send + Sync + 'static) -> Pool<T> {
        let queue = Arc::new(Queue::with_room(room));
        let serve = Arc::new(serve);
        let mut started = 0;
        for i in 0..threads {
            let thread = if threads == 1 { name.to_string() } else { format!("{name}-{i}") };
            let (q, serve) = (queue.clone(), serve.clone());
            let spawned = std::thread::Builder::new().name(thread.clone()).spawn(move || {
                while let Some(job) = q.pop() {
                    run_caught(name, || serve(job));
                }
            });
            match spawned {
                Ok(_) => started += 1,
                Err(e) => log::error!("cannot start the {thread} thread ({e})"),
            }
        }
        Pool { queue, name, threads: started }
    }

    /// The threads that started (0: every job comes back from `push`).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Queue `job` for the pool's threads; never blocks. `Err(job)` when
    /// the pool has no thread, or no memory for its queue (logged): the
    /// caller decides where it runs then.
    pub fn push(&self, job: T) -> Result<(), T> {
        if self.threads == 0 {
            return Err(job);
        }
        self.queue.push(job).inspect_err(|_| {
            log::error!("{}: out of memory for its queue; a job goes back to its caller", self.name);
        })
    }
}

impl<T> Drop for Pool<T> {
    /// No more jobs will come: the threads run what is queued and end.
    fn drop(&mut self) {
        self.queue.close();
    }
}

/// A pool of threads for the process's life, started on its first job
/// (see the module docs).
pub struct ProcessPool {
    name: &'static str,
    threads: usize,
    pool: OnceLock<Pool<Job>>,
}

impl ProcessPool {
    pub const fn new(name: &'static str, threads: usize) -> ProcessPool {
        ProcessPool { name, threads, pool: OnceLock::new() }
    }

    /// Queue `job`; never blocks. Without a thread (none could start) or
    /// memory to queue it, it runs here, on the caller's thread.
    pub fn schedule(&self, job: impl FnOnce() + Send + 'static) {
        let pool = self.pool.get_or_init(|| {
            let pool = Pool::start(self.name, self.threads, 0, |job: Job| job());
            if pool.threads() == 0 {
                log::error!("{} has no thread: its jobs run on the caller's thread", self.name);
            }
            pool
        });
        if let Err(job) = pool.push(Box::new(job)) {
            run_caught(self.name, job);
        }
    }
}

/// Run `job` as a pool's thread runs it: a panic is caught and logged
/// (naming the pool `name`), and the caller goes on. Waiters on what the
/// job would have done fail by their own deadlines, or by the `Drop` of
/// what the job held.
pub fn run_caught(name: &str, job: impl FnOnce()) {
    let _ = crate::error::catch_panic(name, job);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;
    use std::time::Duration;

    #[test]
    fn one_thread_runs_jobs_in_order_and_drains_its_queue_when_dropped() {
        let (tx, rx) = channel();
        let (gate_tx, gate_rx) = channel::<()>();
        let gate = Mutex::new(gate_rx);
        let pool = Pool::start("rdev-test-order", 1, 2, move |i: i32| {
            if i == 0 {
                // Hold the thread until every job is queued and the pool dropped.
                let _ = gate.lock().recv();
            }
            let _ = tx.send((i, std::thread::current().name().map(str::to_string)));
        });
        assert_eq!(pool.threads(), 1);
        for i in 0..5 {
            pool.push(i).unwrap();
        }
        drop(pool);
        gate_tx.send(()).unwrap();
        let got: Vec<_> = rx.iter().collect(); // ends when the thread ends
        assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
        assert!(got.iter().all(|g| g.1.as_deref() == Some("rdev-test-order")));
    }

    #[test]
    fn threads_are_numbered_when_more_than_one() {
        let (tx, rx) = channel();
        let pool = Pool::start("rdev-test-names", 3, 0, move |_: ()| {
            let _ = tx.send(std::thread::current().name().map(str::to_string));
            std::thread::sleep(Duration::from_millis(50));
        });
        assert_eq!(pool.threads(), 3);
        for _ in 0..3 {
            pool.push(()).unwrap();
        }
        let mut names: Vec<_> = (0..3).map(|_| rx.recv().unwrap().unwrap()).collect();
        names.sort();
        assert_eq!(names, vec!["rdev-test-names-0", "rdev-test-names-1", "rdev-test-names-2"]);
    }

    #[test]
    fn a_panicking_job_is_caught_and_the_thread_takes_the_next() {
        let (tx, rx) = channel();
        let pool = Pool::start("rdev-test-panic", 1, 0, move |i: i32| {
            if i == 0 {
                panic!("job 0 panics");
            }
            let _ = tx.send(i);
        });
        pool.push(0).unwrap();
        pool.push(1).unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(1));
    }

    #[test]
    fn a_pool_without_threads_hands_jobs_back() {
        let pool = Pool::start("rdev-test-none", 0, 0, |_: i32| unreachable!());
        assert_eq!(pool.threads(), 0);
        assert_eq!(pool.push(7), Err(7));
    }

    #[test]
    fn a_process_pool_starts_on_first_use_and_names_its_threads() {
        static POOL: ProcessPool = ProcessPool::new("rdev-test-process", 1);
        let (tx, rx) = channel();
        for i in 0..3 {
            let tx = tx.clone();
            POOL.schedule(move || {
                let _ = tx.send((i, std::thread::current().name().map(str::to_string)));
            });
        }
        POOL.schedule(|| panic!("caught"));
        let tx2 = tx.clone();
        POOL.schedule(move || {
            let _ = tx2.send((3, std::thread::current().name().map(str::to_string)));
        });
        let got: Vec<_> = (0..4).map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap()).collect();
        assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        assert!(got.iter().all(|g| g.1.as_deref() == Some("rdev-test-process")));
    }
}
