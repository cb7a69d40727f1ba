//! Schedule exploration of the call channel (`cargo test --features shuttle
//! --lib sched`): the real `Rpc` code of both ends, joined by an in-memory
//! link that keeps each direction's order (as shm's socket and a verbs QP
//! do), run by the shuttle crate under many thread interleavings: a caller
//! sending a call of several parts, the callee serving it, and a third
//! thread that loses the link, passes the deadline or cancels, at any
//! point. After each run, the invariants:
//! - `call` returned `Err` and `done` never ran, or `Ok` and it ran once;
//! - the server was handed only whole bodies, each call at most once, and
//!   holds no half-received call once the link is quiet;
//! - every served call was answered or cancelled.
//!
//! Each test fails on the channel as it was before the fixes it names
//! (H1: `Err` returned after another thread had queued `done`; M1: a call's
//! tail after a cancel served as a call of its own).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering as StdOrdering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use shuttle::sync::atomic::AtomicBool;
use shuttle::thread;

use super::*;
use crate::sync::Mutex;

const LINK: ConnId = 7;

/// One end of the link.
struct End {
    name: &'static str,
    rpc: Rpc,
    /// Messages this end sent, in order, not yet delivered.
    to_peer: Mutex<VecDeque<Vec<u8>>>,
    lost: Arc<AtomicBool>,
    /// This end has processed the link's loss.
    saw_loss: AtomicBool,
    threads: Arc<Mutex<Vec<thread::JoinHandle<()>>>>,
}

impl End {
    fn new(name: &'static str, lost: Arc<AtomicBool>, threads: Arc<Mutex<Vec<thread::JoinHandle<()>>>>) -> Arc<End> {
        Arc::new(End { name, rpc: Rpc::default(), to_peer: Mutex::new(VecDeque::new()), lost, saw_loss: AtomicBool::new(false), threads })
    }

    /// The transport reports the link gone (what `on_disconnect` does).
    fn on_loss(&self) {
        if !self.saw_loss.swap(true, shuttle::sync::atomic::Ordering::SeqCst) {
            self.rpc.link_lost(self, LINK, &Error::PeerLost("link lost".into()));
        }
    }
}

impl Wire for End {
    fn task(&self) -> &str {
        self.name
    }
    fn call_link(&self, _peer: &str) -> Option<ConnId> {
        (!self.lost.load(shuttle::sync::atomic::Ordering::SeqCst)).then_some(LINK)
    }
    fn send(&self, _link: ConnId, msg: &Msg) -> Result<()> {
        let mut q = self.to_peer.lock();
        // Checked under the queue's lock: nothing is queued after the loss.
        if self.lost.load(shuttle::sync::atomic::Ordering::SeqCst) {
            return Err(Error::PeerLost("connection closed".into()));
        }
        q.push_back(msg.encode().to_vec());
        Ok(())
    }
    fn fail_link(&self, _link: ConnId, _why: Error) {
        let _q = self.to_peer.lock();
        self.lost.store(true, shuttle::sync::atomic::Ordering::SeqCst);
        drop(_q);
        self.on_loss();
    }
    fn later(&self, f: Box<dyn FnOnce() + Send>) {
        let h = thread::spawn(f);
        self.threads.lock().push(h);
    }
    fn backlog(&self, _link: ConnId) -> usize {
        0
    }
    fn start_pacing(&self) {
        // The schedules' bodies are a few parts: nothing is ever paced.
        unreachable!("a body of more than DIRECT_PARTS parts in a schedule test")
    }
}

/// Answers every call at once with its body reversed (or, holding, never:
/// a call that waits until it is cancelled); records what it got.
#[derive(Default)]
struct Echo {
    end: Mutex<Option<std::sync::Weak<End>>>,
    got: Mutex<Vec<(u64, Vec<u8>)>>,
    cancelled: Mutex<Vec<u64>>,
    hold: bool,
}

impl Server for Echo {
    fn call(&self, handle: u64, _method: u32, mut body: Vec<u8>) {
        self.got.lock().push((handle, body.clone()));
        if self.hold {
            return;
        }
        body.reverse();
        let end = self.end.lock().as_ref().and_then(|w| w.upgrade());
        if let Some(e) = end {
            e.rpc.reply(&*e, handle, 0, &body);
        }
    }
    fn cancel(&self, handle: u64) {
        self.cancelled.lock().push(handle);
    }
}

fn body(parts: usize) -> Vec<u8> {
    (0..parts * CALL_PART_BYTES - 10).map(|i| (i * 7 + i / 251) as u8).collect()
}

/// Deliver what each end sent to the other, in order; a loss reaches the
/// other end after the messages sent before it.
fn pump(a: &Arc<End>, b: &Arc<End>) -> bool {
    // Read first: nothing is queued once the link is lost, so queues found
    // empty after this are empty for good (as a transport reports a loss
    // after the messages it read).
    let lost = a.lost.load(shuttle::sync::atomic::Ordering::SeqCst);
    let mut moved = false;
    for (from, to) in [(a, b), (b, a)] {
        let next = from.to_peer.lock().pop_front();
        if let Some(m) = next {
            if let Err(e) = to.rpc.on_msg(&**to, LINK, &m) {
                panic!("{}: a message from {} failed the link: {e}", to.name, from.name);
            }
            moved = true;
        }
    }
    if !moved && lost {
        a.on_loss();
        b.on_loss();
    }
    moved
}

#[derive(Clone, Copy)]
enum Chaos {
    LoseLink,
    Deadline,
    /// The deadline passes, then the link is lost.
    DeadlineThenLoss,
    Cancel,
}

/// One run: a call of `parts` parts from a to b, `chaos` at any point; the
/// server answers at once, or (`hold`) only ever learns of a cancel.
fn run(chaos: Chaos, parts: usize, hold: bool) {
    let lost = Arc::new(AtomicBool::new(false));
    let threads = Arc::new(Mutex::new(Vec::new()));
    let a = End::new("a", lost.clone(), threads.clone());
    let b = End::new("b", lost.clone(), threads.clone());
    let echo = Arc::new(Echo { hold, ..Echo::default() });
    *echo.end.lock() = Some(Arc::downgrade(&b));
    b.rpc.serve(Some(echo.clone()));

    let runs = Arc::new(AtomicUsize::new(0));
    let code = Arc::new(std::sync::Mutex::new(None));
    let want = body(parts);
    let id_cell = Arc::new(std::sync::Mutex::new(None));
    let caller = {
        let (a, runs, code, want, id_cell) = (a.clone(), runs.clone(), code.clone(), want.clone(), id_cell.clone());
        thread::spawn(move || {
            let timeout = matches!(chaos, Chaos::Deadline | Chaos::DeadlineThenLoss).then_some(Duration::ZERO);
            let done: CallDone = Box::new(move |c, reply| {
                runs.fetch_add(1, StdOrdering::SeqCst);
                if c == 0 {
                    let mut r = reply;
                    r.reverse();
                    assert!(r == want, "a reply that is not the call's body reversed");
                }
                *code.lock().unwrap() = Some(c);
            });
            let r = a.rpc.call(&*a, "b", 1, &body(parts), timeout, false, done);
            *id_cell.lock().unwrap() = Some(r.is_ok());
            r.unwrap_or_default()
        })
    };
    let chaos_thread = {
        let a = a.clone();
        thread::spawn(move || match chaos {
            Chaos::LoseLink => a.fail_link(LINK, Error::PeerLost("the peer crashed".into())),
            Chaos::Deadline => a.rpc.expire(&*a, Instant::now() + Duration::from_secs(1)),
            Chaos::DeadlineThenLoss => {
                a.rpc.expire(&*a, Instant::now() + Duration::from_secs(1));
                a.fail_link(LINK, Error::PeerLost("the peer crashed".into()));
            }
            Chaos::Cancel => {
                // The shim's cancel callback cancels whatever ids exist.
                for id in 1..=4 {
                    a.rpc.cancel(&*a, id);
                }
            }
        })
    };
    // The link delivers while the others run.
    let link = {
        let (a, b) = (a.clone(), b.clone());
        thread::spawn(move || {
            for _ in 0..4 * parts + 4 {
                pump(&a, &b);
                thread::yield_now();
            }
        })
    };
    let id = caller.join().unwrap();
    chaos_thread.join().unwrap();
    link.join().unwrap();
    if hold && id != 0 {
        // The caller gives up in the end (a step abort): a no-op when the
        // call was taken already, whose taker must have told the callee.
        a.rpc.cancel(&*a, id);
    }
    // Quiesce: deliver everything and run every callback.
    loop {
        let pending: Vec<_> = std::mem::take(&mut *threads.lock());
        let moved = pump(&a, &b);
        if pending.is_empty() && !moved {
            break;
        }
        for h in pending {
            h.join().unwrap();
        }
    }
    let started = id_cell.lock().unwrap().expect("call returned");
    let n = runs.load(StdOrdering::SeqCst);
    if started {
        assert_eq!(n, 1, "call returned Ok: its done must run exactly once (ran {n} times)");
    } else {
        assert_eq!(n, 0, "call returned Err (the caller goes over gRPC and frees done's state), yet done ran {n} times");
    }
    // Only whole bodies were served, each call once.
    let got = echo.got.lock();
    for (_, b) in got.iter() {
        assert!(*b == want, "the server was handed a body of {} bytes, not the call's {} (a truncated call served)", b.len(), want.len());
    }
    assert!(got.len() <= 1, "one call served {} times", got.len());
    // Nothing half-received is held once the link is quiet.
    let s = b.rpc.served.lock();
    let unstarted = s.calls.values().filter(|c| !c.started).count();
    assert_eq!(unstarted, 0, "the callee holds {unstarted} half-received calls after the link went quiet");
    // Each served call was answered (so left `calls`) or cancelled: a
    // served call still open once the link is quiet waits for nothing.
    let cancelled = echo.cancelled.lock();
    for h in s.calls.keys() {
        assert!(cancelled.contains(h), "served call {h} neither answered nor cancelled once the link went quiet");
    }
    if hold {
        let n = runs.load(StdOrdering::SeqCst);
        let served = got.len();
        // Held: the caller's done can only have run with an error (or not
        // at all); whatever was served must have been cancelled.
        assert!(served <= cancelled.len() || n == 0, "a held call served and its caller gave up, but the server was never told");
    }
}

const ITERATIONS: usize = 3000;

/// `run` under random and PCT schedules.
fn explore(chaos: Chaos, parts: usize, hold: bool) {
    shuttle::check_random(move || run(chaos, parts, hold), ITERATIONS);
    shuttle::check_pct(move || run(chaos, parts, hold), ITERATIONS, 3);
}

#[test]
fn sched_call_while_link_is_lost() {
    explore(Chaos::LoseLink, 3, false);
}

#[test]
fn sched_call_past_its_deadline_while_parts_go_out() {
    explore(Chaos::Deadline, 3, false);
}

/// A one-part call whose deadline passes before its part goes out: the
/// callee, which ignored the cancel that overtook the part, must still
/// learn of it (a held call would otherwise run forever).
#[test]
fn sched_one_part_call_past_its_deadline_is_cancelled_at_the_callee() {
    explore(Chaos::Deadline, 1, true);
    shuttle::check_random(|| run(Chaos::Cancel, 1, true), ITERATIONS);
}

#[test]
fn sched_call_past_its_deadline_on_a_link_then_lost() {
    explore(Chaos::DeadlineThenLoss, 3, false);
}

#[test]
fn sched_call_cancelled_while_parts_go_out() {
    explore(Chaos::Cancel, 3, false);
}
