//! A closable job queue served by the node's own threads (`rdev-callbacks`
//! in handoff.rs, `rdev-write-N` in engine.rs): pushing never blocks and,
//! once the queue has grown to its working size, allocates nothing; a
//! server takes jobs in order and, once the queue is closed, drains it and
//! ends.

use std::collections::VecDeque;

use parking_lot::{Condvar, Mutex};

struct State<T> {
    jobs: VecDeque<T>,
    closed: bool,
}

pub(super) struct JobQueue<T> {
    q: Mutex<State<T>>,
    cv: Condvar,
}

impl<T> JobQueue<T> {
    /// A queue with room for `room` jobs before it first grows.
    pub(super) fn with_room(room: usize) -> JobQueue<T> {
        JobQueue { q: Mutex::new(State { jobs: VecDeque::with_capacity(room), closed: false }), cv: Condvar::new() }
    }

    /// Queue `job` for a server; `Err(job)` only when there is no memory
    /// for it (the caller then runs it itself).
    pub(super) fn push(&self, job: T) -> Result<(), T> {
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
    /// drained (the server then ends).
    pub(super) fn pop(&self) -> Option<T> {
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

    /// No more jobs will come: servers drain what is queued and end.
    pub(super) fn close(&self) {
        self.q.lock().closed = true;
        self.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_come_out_in_order_then_none_once_closed_and_drained() {
        let q = std::sync::Arc::new(JobQueue::with_room(2));
        for i in 0..5 {
            q.push(i).unwrap();
        }
        q.close();
        let got: Vec<i32> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(got, vec![0, 1, 2, 3, 4]);
        // A server waiting on an empty queue ends when it closes.
        let q2 = std::sync::Arc::new(JobQueue::<i32>::with_room(1));
        let s = q2.clone();
        let t = std::thread::spawn(move || s.pop());
        std::thread::sleep(std::time::Duration::from_millis(20));
        q2.close();
        assert_eq!(t.join().unwrap(), None);
    }
}
