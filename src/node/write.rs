//! A tensor write in flight, as the fabric sees it ([`WriteOp`]): the
//! encoded slot header, the payload, and what to do when the write
//! completes. Boxes are recycled (see `completion`), so a steady stream of
//! writes allocates nothing.

use std::sync::Weak;

use super::Inner;
use crate::completion::Recycler;
use crate::constants::HEADER_BYTES;
use crate::error::Result;
use crate::fabric::{ConnId, Segs, WriteOp};
use crate::rendezvous::{Action, Payload, SendDone};

/// What a finished write reports to: the node (`Inner`, below), or the
/// schedule tests' stand-in for it (`stream::sched_tests`), so that the
/// same completion code runs in both.
pub(super) trait WriteHost: Send + Sync {
    /// A tensor's write finished with `r`: run `done`, then free the
    /// link's write budget.
    fn send_written(&self, link: ConnId, done: SendDone, r: Result<()>);
    /// A chunk write of stream `stream` finished with `r`.
    fn chunk_written(&self, link: ConnId, stream: u32, r: Result<()>);
    /// Run `job` later, never on the calling thread (the node: on
    /// `rdev-callbacks`): for a write dropped while its thread unwinds.
    fn later(&self, job: Box<dyn FnOnce() + Send>);
}

impl WriteHost for Inner {
    fn send_written(&self, link: ConnId, done: SendDone, r: Result<()>) {
        if crate::fabric::on_event_thread() {
            // A verbs write completes on the backend's progress thread:
            // TensorFlow's callback goes to rdev-callbacks.
            self.handoff.run(Action::SendDone { done, result: r });
        } else {
            complete_send(done, r);
        }
        let acts = self.locked(|rdv| rdv.write_done(link));
        self.exec(acts);
    }

    fn chunk_written(&self, link: ConnId, stream: u32, r: Result<()>) {
        let acts = self.locked(|rdv| rdv.chunk_written(link, stream, r));
        self.exec(acts);
    }

    fn later(&self, job: Box<dyn FnOnce() + Send>) {
        let done: SendDone = Box::new(move |_: Result<()>| job());
        self.handoff.run(Action::SendDone { done, result: Ok(()) });
    }
}

fn complete_send(done: SendDone, r: Result<()>) {
    let t = crate::trace::start();
    done.complete(r);
    crate::trace::end("send_done", t, 0, 0, None);
}

/// No host: what a write holds once it finished.
fn no_host() -> Weak<dyn WriteHost> {
    Weak::<Inner>::new()
}

/// What the completion of a write leads to.
pub(super) enum Then {
    /// A tensor's write: complete the send, then free the link's budget.
    Send(SendDone),
    /// A chunk of stream `stream`.
    Chunk(u32),
    /// Nothing (the box is waiting in the recycler).
    Nothing,
}

pub(super) struct TensorWrite {
    header: [u8; HEADER_BYTES],
    payload: Option<Box<dyn Payload>>,
    then: Then,
    node: Weak<dyn WriteHost>,
    link: ConnId,
}

static WRITES: Recycler<TensorWrite> = Recycler::new(crate::completion::KEPT);

impl TensorWrite {
    pub(super) fn new(header: [u8; HEADER_BYTES], payload: Box<dyn Payload>, then: Then, node: Weak<dyn WriteHost>, link: ConnId) -> Box<TensorWrite> {
        WRITES.boxed(TensorWrite { header, payload: Some(payload), then, node, link })
    }
}

impl WriteOp for TensorWrite {
    fn segments(&self) -> Segs<'_> {
        let mut s = Segs::new();
        s.push(&self.header[..]);
        if let Some(p) = &self.payload {
            s.push(p.bytes());
        }
        s
    }

    fn complete(mut self: Box<Self>, r: Result<()>) {
        // The box goes back before what the write leads to runs: that may
        // wake the sender, whose next write then finds it free. Recycled
        // after, a thread preempted in between (a busy machine) made the
        // next write allocate a box (tests/alloc.rs saw it under load).
        let mut rest = self.take_rest();
        WRITES.recycle(self);
        rest.finish(r);
    }
}

impl TensorWrite {
    /// What the write leads to, moved out into a write of its own (on the
    /// stack): `self` is left holding nothing.
    fn take_rest(&mut self) -> TensorWrite {
        TensorWrite {
            header: [0; HEADER_BYTES],
            payload: self.payload.take(),
            then: std::mem::replace(&mut self.then, Then::Nothing),
            node: std::mem::replace(&mut self.node, no_host()),
            link: self.link,
        }
    }

    /// The write is over (completed, failed, or dropped unfinished): what
    /// it leads to runs once; afterwards `then` is `Nothing`.
    fn finish(&mut self, r: Result<()>) {
        // Our reference to the tensor goes here, on whichever thread the
        // write completed (a verbs progress thread included): dropping a
        // reference runs no application code.
        if let Some(p) = self.payload.take() {
            p.release();
        }
        let then = std::mem::replace(&mut self.then, Then::Nothing);
        let node = std::mem::replace(&mut self.node, no_host());
        let link = self.link;
        match then {
            Then::Send(done) => match node.upgrade() {
                Some(n) => n.send_written(link, done, r),
                None => complete_send(done, r),
            },
            Then::Chunk(stream) => {
                if let Some(n) = node.upgrade() {
                    n.chunk_written(link, stream, r);
                }
            }
            Then::Nothing => {}
        }
    }
}

/// A write dropped before it completed (the job that held it panicked, a
/// backend dropped it): it fails rather than leave its `done` unrun.
///
/// Dropped while its thread unwinds, it does not complete there (a second
/// panic would abort the process, and the unwinding frame may hold a lock
/// the completion takes): the whole completion goes to `rdev-callbacks`.
impl Drop for TensorWrite {
    fn drop(&mut self) {
        if matches!(self.then, Then::Nothing) {
            return;
        }
        log::error!("a tensor write on connection {} was dropped before it completed; it fails", self.link);
        let why = || crate::error::Error::Internal("a tensor write was dropped before it completed (a panic in the thread writing it)".into());
        if std::thread::panicking() {
            if let Some(n) = self.node.upgrade() {
                let mut rest = self.take_rest();
                n.later(Box::new(move || rest.finish(Err(why()))));
                return;
            }
        }
        self.finish(Err(why()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    struct Count(Arc<AtomicUsize>, Arc<AtomicUsize>);
    impl crate::completion::Complete<Result<()>> for Count {
        fn complete(self: Box<Self>, r: Result<()>) {
            self.0.fetch_add(1, Ordering::SeqCst);
            if r.is_err() {
                self.1.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    /// L4: a job that panics while it holds a write (the write engine's,
    /// the stream pool's) still completes the write's `done`, with an error.
    #[test]
    fn a_write_dropped_by_a_panicking_job_completes_its_done_once_with_an_error() {
        let (runs, errs) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let op = TensorWrite::new([0; HEADER_BYTES], Box::new(vec![1u8; 8]), Then::Send(Box::new(Count(runs.clone(), errs.clone()))), no_host(), 3);
        let r = crate::error::catch_panic("a test write", move || {
            let _held = op;
            panic!("the backend's write panicked");
        });
        assert!(r.is_err());
        assert_eq!((runs.load(Ordering::SeqCst), errs.load(Ordering::SeqCst)), (1, 1));
        // A completed write runs it once, and only then.
        let (runs, errs) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let op = TensorWrite::new([0; HEADER_BYTES], Box::new(vec![1u8; 8]), Then::Send(Box::new(Count(runs.clone(), errs.clone()))), no_host(), 3);
        WriteOp::complete(op, Ok(()));
        assert_eq!((runs.load(Ordering::SeqCst), errs.load(Ordering::SeqCst)), (1, 0));
    }

    /// Review finding: a write dropped while its thread unwinds used to run
    /// TensorFlow's callback and the node's protocol right there, inside
    /// the unwinding (a second panic aborts the process; a lock held by the
    /// panicking frame would deadlock). It goes to `rdev-callbacks`.
    #[test]
    fn a_write_dropped_while_unwinding_completes_on_the_callback_thread() {
        let cfg = crate::config::Config { arena_bytes: 1 << 20, ..crate::config::Config::default() };
        let node = crate::node::Node::new(cfg, "/job:w/replica:0/task:0", "localhost:1").unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        struct Where(std::sync::mpsc::Sender<(Option<String>, bool)>);
        impl crate::completion::Complete<Result<()>> for Where {
            fn complete(self: Box<Self>, r: Result<()>) {
                let _ = self.0.send((std::thread::current().name().map(str::to_string), r.is_err()));
            }
        }
        let op = TensorWrite::new([0; HEADER_BYTES], Box::new(vec![1u8; 8]), Then::Send(Box::new(Where(tx))), { let w: Weak<Inner> = Arc::downgrade(&node.inner); w }, 3);
        let r = crate::error::catch_panic("a test write", move || {
            let _held = op;
            panic!("the backend's write panicked");
        });
        assert!(r.is_err());
        let (thread, failed) = rx.recv_timeout(std::time::Duration::from_secs(5)).expect("done ran");
        assert!(failed, "a dropped write must fail");
        assert_eq!(thread.as_deref(), Some("rdev-callbacks"), "done ran on the unwinding thread");
    }
}
