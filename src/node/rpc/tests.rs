//! Unit tests of the call channel (rpc.rs): caps, pacing, parts in order,
//! panics that lose no call.

use super::*;

fn part(s: &mut Served, link: ConnId, id: u64, part: u32, more: bool, len: usize) -> Result<Option<Whole>> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1000);
    s.take_part(|| NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed), link, id, 1, part, more, vec![part as u8; len])
}

/// M3: calls still arriving are capped per link and node-wide (a link
/// that goes past fails; finished and dropped calls give their room
/// back), and one that stops arriving is found by the keepalive.
#[test]
fn calls_still_arriving_are_capped_per_link_and_per_node_and_expire() {
    const P: usize = CALL_PART_BYTES;
    let mut s = Served { caps: (2 * P, 3 * P), ..Served::default() };
    assert!(part(&mut s, 1, 1, 0, true, P).unwrap().is_none());
    assert!(part(&mut s, 1, 2, 0, true, P).unwrap().is_none());
    assert!(matches!(part(&mut s, 1, 3, 0, true, P), Err(Error::ResourceExhausted(_))), "past the link's cap");
    assert!(part(&mut s, 2, 1, 0, true, P).unwrap().is_none());
    assert!(matches!(part(&mut s, 2, 2, 0, true, P), Err(Error::ResourceExhausted(_))), "past the node's cap");
    // A call dropped (cancelled) gives its room back.
    let h = s.by_key[&(1, 2)];
    s.remove(h);
    assert_eq!((s.links[&1].partial, s.partial), (P, 2 * P));
    // Call 1 of link 1 made whole (its last part grows its buffer to
    // 2P, which fits both caps): its bytes leave the budget.
    let w = part(&mut s, 1, 1, 1, false, 5).unwrap().expect("whole");
    assert_eq!(w.body.len(), P + 5);
    assert_eq!((s.links[&1].partial, s.partial), (0, P));
    // Only link 2's call is still arriving: it stalls.
    let later = Instant::now() + Duration::from_secs(1);
    assert_eq!(s.stalled_links(later), vec![2]);
    assert!(s.stalled_links(Instant::now() - Duration::from_secs(1)).is_empty());
}

/// A `Wire` over nothing: sends are recorded (or panic, for the test
/// that needs it), `later` runs at once on the test thread.
#[derive(Default)]
struct Loopback {
    sent: Mutex<Vec<Msg>>,
    panic_on_send: bool,
    /// Refuse sends of a call's part of this index (and later ones).
    fail_part: Option<u32>,
    panic_on_fail_link: bool,
    failed: Mutex<Vec<ConnId>>,
    /// What `backlog` answers, and how often pacing was asked for.
    backlog: std::sync::atomic::AtomicUsize,
    pacing: std::sync::atomic::AtomicUsize,
}

impl Wire for Loopback {
    fn task(&self) -> &str {
        "/job:test/task:0"
    }
    fn call_link(&self, _peer: &str) -> Option<ConnId> {
        Some(1)
    }
    fn send(&self, _link: ConnId, msg: &Msg) -> Result<()> {
        if self.panic_on_send && matches!(msg, Msg::Call { .. }) {
            panic!("a send that panics");
        }
        if let (Some(k), Msg::Call { part, .. }) = (self.fail_part, msg) {
            if *part >= k {
                return Err(Error::PeerLost("closed".into()));
            }
        }
        self.sent.lock().push(msg.clone());
        Ok(())
    }
    fn fail_link(&self, link: ConnId, _why: Error) {
        self.failed.lock().push(link);
        if self.panic_on_fail_link {
            panic!("failing the link panics");
        }
    }
    fn later(&self, f: Box<dyn FnOnce() + Send>) {
        f()
    }
    fn backlog(&self, _link: ConnId) -> usize {
        self.backlog.load(std::sync::atomic::Ordering::SeqCst)
    }
    fn start_pacing(&self) {
        self.pacing.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The bodies of the `Call` parts sent, in order, checking their
/// indices run 0, 1, 2, ... and only the last says no more.
fn call_parts(sent: &[Msg]) -> (Vec<u8>, bool) {
    let mut body = Vec::new();
    let mut last = false;
    for (i, m) in sent.iter().filter(|m| matches!(m, Msg::Call { .. })).enumerate() {
        let Msg::Call { part, more, body: b, .. } = m else { unreachable!() };
        assert_eq!(*part as usize, i, "parts out of order");
        assert!(!last, "a part after the last");
        last = !more;
        body.extend_from_slice(b);
    }
    (body, last)
}

/// A body of more than `DIRECT_PARTS` parts: its first parts leave on
/// the caller's thread, the rest from the pacing thread and only while
/// the link's backlog is under `PACE_BACKLOG` (verbs fails a send past
/// its queue's cap: a 1.2 GB call took every entry and failed its link).
#[test]
fn a_large_body_sends_its_first_parts_then_paces_the_rest_by_the_links_backlog() {
    use std::sync::atomic::Ordering::SeqCst;
    let w = Loopback::default();
    let rpc = Rpc::default();
    let body: Vec<u8> = (0..(DIRECT_PARTS + 10) * CALL_PART_BYTES + 5).map(|i| (i % 251) as u8).collect();
    let (got, done) = recorder();
    rpc.call(&w, "/job:ps/task:0", 1, &body, None, false, done).unwrap();
    assert_eq!(w.sent.lock().len(), DIRECT_PARTS, "the parts sent before pacing");
    assert_eq!(w.pacing.load(SeqCst), 1);
    // A full link: nothing more goes.
    w.backlog.store(PACE_BACKLOG, SeqCst);
    assert_eq!(rpc.pace(&w), Pace::Stalled);
    assert_eq!(w.sent.lock().len(), DIRECT_PARTS);
    // Room: the rest, in order, whole.
    w.backlog.store(0, SeqCst);
    assert_eq!(rpc.pace(&w), Pace::Progress);
    let (sent, last) = call_parts(&w.sent.lock());
    assert!(last && sent == body, "the parts do not make the body");
    assert_eq!(rpc.pace(&w), Pace::Idle);
    assert!(got.lock().is_empty() && w.failed.lock().is_empty());
}

/// A paced call taken meanwhile (here cancelled) sends no more parts,
/// and the callee is told to drop what it holds.
#[test]
fn a_paced_call_cancelled_midway_stops_and_tells_the_callee() {
    let w = Loopback::default();
    let rpc = Rpc::default();
    let body = vec![7u8; (DIRECT_PARTS + 3) * CALL_PART_BYTES];
    let (got, done) = recorder();
    let id = rpc.call(&w, "/job:ps/task:0", 1, &body, None, false, done).unwrap();
    rpc.cancel(&w, id);
    assert_eq!(got.lock()[0].0, CODE_CANCELLED);
    w.sent.lock().clear();
    assert_eq!(rpc.pace(&w), Pace::Idle);
    let sent = w.sent.lock();
    assert!(matches!(sent[..], [Msg::CallCancel { id: i }] if i == id), "{:?}", sent.iter().map(|m| m.name()).collect::<Vec<_>>());
}

type Outcomes = Arc<Mutex<Vec<(u32, Vec<u8>)>>>;

fn recorder() -> (Outcomes, CallDone) {
    let got: Outcomes = Arc::default();
    let g = got.clone();
    (got, Box::new(move |code, body| g.lock().push((code, body))))
}

/// Review finding: a panic after the call was registered (here in the
/// send of its first part) used to unwind out of `call` while `done`
/// stayed in `out`; the C ABI turned the panic into an error, the shim
/// freed the call's state and went to gRPC, and a later `fail_all` ran
/// `done` on freed memory. Now the call ends there: `Ok`, and `done`
/// runs once with an error.
#[test]
fn a_panic_while_a_call_starts_still_runs_its_done_exactly_once() {
    let w = Loopback { panic_on_send: true, ..Loopback::default() };
    let rpc = Rpc::default();
    let (got, done) = recorder();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rpc.call(&w, "/job:peer/task:0", 1, b"body", None, false, done)));
    let r = r.expect("the panic unwound out of Rpc::call with its done still registered");
    assert!(r.is_ok(), "{r:?}");
    assert!(rpc.out.lock().is_empty(), "the call is still registered");
    rpc.fail_all(&w);
    let got = got.lock();
    assert_eq!(got.len(), 1, "done ran {} times", got.len());
    assert_eq!(got[0].0, CODE_INTERNAL);
}

/// Review finding: a send failing in the middle of a call took the
/// call out of `out` and then failed the link; a panic there dropped
/// `done` unrun while `call` returned `Ok` (TF would wait for ever).
/// A failing first part still returns `Err` with `done` unrun; a later
/// one runs `done` once, panic or not.
#[test]
fn a_panic_while_failing_the_link_loses_no_call() {
    for (fail_part, want_err) in [(0u32, true), (1, false)] {
        let w = Loopback { fail_part: Some(fail_part), panic_on_fail_link: true, ..Loopback::default() };
        let rpc = Rpc::default();
        let (got, done) = recorder();
        let body = vec![1u8; 2 * CALL_PART_BYTES];
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rpc.call(&w, "/job:peer/task:0", 1, &body, None, false, done)));
        let r = r.expect("a panic unwound out of Rpc::call");
        assert_eq!(r.is_err(), want_err, "part {fail_part}: {r:?}");
        let runs = got.lock().len();
        assert_eq!(runs, usize::from(!want_err), "part {fail_part} failed: done ran {runs} times");
        assert!(rpc.out.lock().is_empty());
    }
}

/// Review finding: every part but a call's (or reply's) last is
/// `CALL_PART_BYTES` long, as `call` and `reply` cut them. A peer's
/// empty or short non-last parts used to be taken, each resetting the
/// stall clock, so a call could be held open for ever within the caps.
#[test]
fn short_parts_before_the_last_fail_the_link() {
    let w = Loopback::default();
    let rpc = Rpc::default();
    let call = |part: u32, more: bool, len: usize| Msg::Call { id: 3, method: 1, part, more, body: vec![7; len] }.encode().to_vec();
    assert!(rpc.on_msg(&w, 1, &call(0, true, 0)).is_err(), "an empty part with more to come was taken");
    let rpc = Rpc::default();
    assert!(rpc.on_msg(&w, 1, &call(0, true, CALL_PART_BYTES - 1)).is_err(), "a short part with more to come was taken");
    let rpc = Rpc::default();
    rpc.on_msg(&w, 1, &call(0, true, CALL_PART_BYTES)).unwrap();
    rpc.on_msg(&w, 1, &call(1, false, 5)).unwrap();
    // Replies alike.
    let rpc = Rpc::default();
    let (_got, done) = recorder();
    let id = rpc.call(&w, "/job:peer/task:0", 1, b"q", None, false, done).unwrap();
    let reply = Msg::Reply { id, code: 0, part: 0, more: true, body: vec![1; 10] }.encode().to_vec();
    assert!(rpc.on_msg(&w, 1, &reply).is_err(), "a short reply part with more to come was taken");
}

/// Review finding: the caps counted the bytes received, while the
/// buffers holding them grow by doubling, so twice the cap could be
/// allocated. Now what a call holds is its buffer's capacity.
#[test]
fn calls_still_arriving_are_charged_what_their_buffers_hold() {
    let mut s = Served { caps: (usize::MAX, usize::MAX), ..Served::default() };
    for i in 0..5u32 {
        s.take_part(|| 77, 1, 1, 1, i, true, vec![0; CALL_PART_BYTES]).unwrap();
        let held = s.calls[&77].body.capacity();
        assert_eq!((s.links[&1].partial, s.partial), (held, held), "after part {i}: charged less than the buffer holds");
    }
    let w = s.take_part(|| 77, 1, 1, 1, 5, false, vec![0; 3]).unwrap().expect("whole");
    assert_eq!(w.body.len(), 5 * CALL_PART_BYTES + 3);
    assert_eq!((s.links[&1].partial, s.partial), (0, 0));
    // A cap below the doubled buffer refuses the part that would need it.
    let mut s = Served { caps: (3 * CALL_PART_BYTES, usize::MAX), ..Served::default() };
    for i in 0..2u32 {
        s.take_part(|| 78, 1, 1, 1, i, true, vec![0; CALL_PART_BYTES]).unwrap();
    }
    let r = s.take_part(|| 78, 1, 1, 1, 2, true, vec![0; CALL_PART_BYTES]);
    assert!(matches!(r, Err(Error::ResourceExhausted(_))), "a buffer grown to 4 parts under a cap of 3: ok={}", r.is_ok());
}

/// Review finding: a reply's status code is the peer's; one TensorFlow
/// does not know reaches the caller as UNKNOWN, not cast blindly.
#[test]
fn a_reply_code_tensorflow_does_not_know_becomes_unknown() {
    let w = Loopback::default();
    for (sent, seen) in [(0u32, 0u32), (5, 5), (16, 16), (17, 2), (u32::MAX, 2)] {
        let rpc = Rpc::default();
        let (got, done) = recorder();
        let id = rpc.call(&w, "/job:peer/task:0", 1, b"q", None, false, done).unwrap();
        rpc.on_msg(&w, 1, &Msg::Reply { id, code: sent, part: 0, more: false, body: b"r".to_vec() }.encode()).unwrap();
        assert_eq!(got.lock()[0].0, seen, "code {sent}");
    }
}

/// M1: parts must come in order from 0; the tail of a call dropped
/// meanwhile is dropped, a part of a call never begun fails the link.
#[test]
fn parts_come_in_order_and_tails_of_dropped_calls_are_never_served() {
    let mut s = Served::default();
    assert!(part(&mut s, 1, 5, 0, true, CALL_PART_BYTES).unwrap().is_none());
    assert!(part(&mut s, 1, 5, 2, true, CALL_PART_BYTES).is_err(), "a part skipped");
    let mut s = Served::default();
    assert!(part(&mut s, 1, 5, 0, true, CALL_PART_BYTES).unwrap().is_none());
    let h = s.by_key[&(1, 5)];
    s.remove(h); // cancelled
    assert!(part(&mut s, 1, 5, 1, true, CALL_PART_BYTES).unwrap().is_none(), "the tail is dropped");
    assert!(part(&mut s, 1, 5, 2, false, 3).unwrap().is_none(), "and never served");
    assert!(s.calls.is_empty());
    assert!(part(&mut s, 1, 9, 1, false, 3).is_err(), "a part of a call never begun");
}
