//! What a peer can make a receiver keep (issue 18, N4): every table a
//! sender's messages grow has a cap per link and per node, and entries of
//! one step are found without looking at the others.

use super::*;
use crate::constants::{MAX_EDGES_PER_LINK, MAX_FAILED_AHEAD, MAX_FAILED_AHEAD_PER_LINK, MAX_STREAM_TOTAL};

const LINK: LinkId = 1;

fn params() -> Params {
    Params { slots_per_edge: 1, max_outstanding_writes: 4, incarnation: 22, rpc: false }
}

fn meta() -> TensorMeta {
    TensorMeta { dtype: 1, flags: 0, dims: vec![].into() }
}

/// A stream of more than the node accepts: refused, its receive failed.
fn refused_stream(rx: &mut Rendezvous, link: LinkId, stream: u32, key: &str, step: u64) -> Actions {
    let m = Msg::StreamBegin { stream, key: key.into(), step, meta: meta(), total: MAX_STREAM_TOTAL + 1 };
    rx.on_message(link, &m.encode())
}

fn closed(acts: &Actions) -> bool {
    acts.iter().any(|a| matches!(a, Action::Close { .. }))
}

fn recv_result(rx: &mut Rendezvous, peer: &str, key: &str, step: u64) -> Option<Result<Received>> {
    let got = Arc::new(std::sync::Mutex::new(None));
    let g = got.clone();
    let acts = rx.recv(peer, key, step, Box::new(move |r: Result<Received>| *g.lock().unwrap() = Some(r)));
    for a in acts {
        if let Action::Deliver { done, result } = a {
            done.complete(result);
        }
    }
    let r = got.lock().unwrap().take();
    r
}

/// One peer at its cap of refused streams waiting for receives closes
/// only its own link: the others' refusals are still kept, up to the
/// node's cap, past which the link that adds one fails too.
#[test]
fn one_peers_refusals_do_not_use_up_the_nodes_room() {
    let mut rx = Rendezvous::new(params(), 1 << 20);
    let links = MAX_FAILED_AHEAD / MAX_FAILED_AHEAD_PER_LINK + 1;
    for l in 0..links as u64 {
        rx.add_rx_link(10 + l, &format!("tx{l}"), 11);
    }
    for i in 0..=MAX_FAILED_AHEAD_PER_LINK {
        let acts = refused_stream(&mut rx, 10, 1 + i as u32, &format!("a{i}"), 1000 + i as u64);
        assert_eq!(closed(&acts), i == MAX_FAILED_AHEAD_PER_LINK, "link 10, refusal {i}");
    }
    // The others fill the node's room: the one that would pass it fails.
    let mut kept = MAX_FAILED_AHEAD_PER_LINK;
    for l in 1..links as u64 {
        for i in 0..MAX_FAILED_AHEAD_PER_LINK {
            let acts = refused_stream(&mut rx, 10 + l, 1 + i as u32, &format!("b{l}.{i}"), 1000 + i as u64);
            assert_eq!(closed(&acts), kept >= MAX_FAILED_AHEAD, "link {}, refusal {i} with {kept} kept", 10 + l);
            if !closed(&acts) {
                kept += 1;
            }
        }
    }
    assert_eq!(kept, MAX_FAILED_AHEAD);
    // A refusal kept is the receive's error when it is made, once.
    match recv_result(&mut rx, "tx1", "b1.0", 1000) {
        Some(Err(Error::ResourceExhausted(m))) => assert!(m.contains("b1.0 in step 1000 from tx1"), "{m}"),
        other => panic!("{:?}", other.map(|r| r.map(|r| r.meta))),
    }
    // Taken: room for one more on that link.
    let acts = refused_stream(&mut rx, 11, MAX_FAILED_AHEAD_PER_LINK as u32 + 1, "again", 7);
    assert!(!closed(&acts), "{acts:?}");
}

/// Ending a step drops that step's refusals and fails its waiters, and
/// leaves every other step's entries as they were.
#[test]
fn ending_a_step_touches_only_its_entries() {
    let mut rx = Rendezvous::new(params(), 1 << 20);
    rx.add_rx_link(LINK, "tx", 11);
    for step in 1..=3u64 {
        refused_stream(&mut rx, LINK, step as u32, "k", step);
    }
    let waited = Arc::new(std::sync::Mutex::new(None));
    let w = waited.clone();
    let acts = rx.recv("tx", "w", 2, Box::new(move |r: Result<Received>| *w.lock().unwrap() = Some(r.is_ok())));
    assert!(acts.is_empty());
    for a in rx.step_done(2) {
        if let Action::Deliver { done, result } = a {
            done.complete(result);
        }
    }
    assert_eq!(*waited.lock().unwrap(), Some(false), "the step's waiter failed");
    assert_eq!(rx.table.failed(), 2, "steps 1 and 3 keep their refusals");
    assert!(!rx.table.has_step(2));
    assert!(matches!(recv_result(&mut rx, "tx", "k", 2), Some(Err(Error::Aborted(_)))), "step 2 is over");
    for step in [1, 3] {
        assert!(matches!(recv_result(&mut rx, "tx", "k", step), Some(Err(Error::ResourceExhausted(_)))), "step {step}");
    }
    assert_eq!(rx.table.failed(), 0);
    assert!(!rx.table.waits_on("tx"));
}

/// Announces of sizes no arena can hold are refused without leaving an
/// edge (or a name) behind; edges of sizes that fit are capped per link.
#[test]
fn announces_cannot_grow_the_receivers_edges_without_bound() {
    let mut rx = Rendezvous::new(params(), 1 << 40);
    rx.add_rx_link(LINK, "tx", 11);
    for i in 0..10_000u32 {
        let m = Msg::Announce { key: format!("huge{i}"), step: 1, need: u64::MAX / 2, returned: vec![] };
        let acts = rx.on_message(LINK, &m.encode());
        assert!(matches!(acts.as_slice(), [Action::Send { msg: Msg::NoSpace { .. }, .. }]), "{acts:?}");
    }
    assert_eq!(rx.rx_edges, 0, "refused announces keep no edge");
    for i in 0..=MAX_EDGES_PER_LINK {
        let m = Msg::Announce { key: format!("k{i}"), step: 1, need: 8, returned: vec![] };
        let acts = rx.on_message(LINK, &m.encode());
        match (i == MAX_EDGES_PER_LINK, acts.as_slice()) {
            (false, [Action::Send { msg: Msg::Publish { .. }, .. }]) => {}
            (true, [Action::Close { why: Error::ResourceExhausted(m), .. }]) => assert!(m.contains("at most"), "{m}"),
            (_, a) => panic!("announce {i}: {a:?}"),
        }
    }
    assert_eq!(rx.rx_edges, MAX_EDGES_PER_LINK);
    let acts = rx.on_link_lost(LINK, Error::PeerLost("gone".into()));
    drop(acts);
    assert_eq!(rx.rx_edges, 0, "a lost link's edges leave the node's count");
}

/// Streamed tensors that arrive before their receives are kept only up to
/// a cap per link (here, empty streams for steps that never run: each
/// would otherwise be one more entry for as long as the process lives),
/// and a kept one is still delivered.
#[test]
fn streamed_arrivals_waiting_for_receives_are_capped() {
    use crate::constants::MAX_STREAMED_AHEAD_PER_LINK as CAP;
    let mut rx = Rendezvous::new(params(), 1 << 20);
    rx.add_rx_link(LINK, "tx", 11);
    for i in 0..=CAP {
        let m = Msg::StreamBegin { stream: 1 + i as u32, key: format!("e{i}"), step: 1_000_000 + i as u64, meta: meta(), total: 0 };
        let acts = rx.on_message(LINK, &m.encode());
        assert_eq!(closed(&acts), i == CAP, "empty stream {i}: {acts:?}");
    }
    assert_eq!(rx.table.owned(), CAP);
    match recv_result(&mut rx, "tx", "e7", 1_000_007) {
        Some(Ok(r)) => assert_eq!(r.data, Data::Owned(Vec::new())),
        other => panic!("{:?}", other.map(|r| r.map(|r| r.meta))),
    }
    assert_eq!(rx.table.owned(), CAP - 1);
}

/// The bytes of a streamed tensor that arrived and waits for its receive
/// count against the node's stream limit, as an open stream's do, until
/// the receive takes it.
#[test]
fn arrived_stream_bytes_count_against_the_node_limit() {
    let mut rx = Rendezvous::new(params(), 1 << 20);
    rx.add_rx_link(LINK, "tx", 11);
    let n = 1000u64;
    let m = Msg::StreamBegin { stream: 1, key: "s".into(), step: 5, meta: meta(), total: n };
    let acts = rx.on_message(LINK, &m.encode());
    assert!(matches!(acts.as_slice(), [Action::StreamAlloc { total, .. }] if *total == n), "{acts:?}");
    let acts = rx.stream_alloc_done(LINK, 1, Some(vec![0; n as usize]));
    assert!(matches!(acts.last(), Some(Action::Send { msg: Msg::StreamReady { outcome: wire::STREAM_MESSAGES, .. }, .. })), "{acts:?}");
    let acts = rx.on_message(LINK, &Msg::StreamData { stream: 1, offset: 0, bytes: vec![7; n as usize] }.encode());
    let Some(Action::CopyChunk { src: ChunkSrc::Bytes(b), dst, at, len, .. }) = acts.into_iter().next() else { panic!("no copy") };
    dst.write_at(at, &b).unwrap();
    drop(dst);
    let _ = rx.chunk_copied(LINK, 1, None, len, Ok(()));
    assert_eq!(rx.table.owned_bytes(), n, "the arrival waits for its receive");
    // Past the limit with the arrival counted: refused; within it: taken.
    for (stream, total, refused) in [(2, MAX_STREAM_TOTAL - n + 1, true), (3, MAX_STREAM_TOTAL - n, false)] {
        let m = Msg::StreamBegin { stream, key: format!("big{stream}"), step: 6, meta: meta(), total };
        let acts = rx.on_message(LINK, &m.encode());
        let was_refused = acts.iter().any(|a| matches!(a, Action::Send { msg: Msg::StreamReady { outcome: wire::STREAM_REFUSED, .. }, .. }));
        assert_eq!(was_refused, refused, "{total} bytes: {acts:?}");
    }
    match recv_result(&mut rx, "tx", "s", 5) {
        Some(Ok(r)) => assert_eq!(r.data, Data::Owned(vec![7; n as usize])),
        other => panic!("{:?}", other.map(|r| r.map(|r| r.meta))),
    }
    assert_eq!(rx.table.owned_bytes(), 0);
}

/// A sender numbers its streams in order, but its threads send the
/// begins as they go, so a later stream's begin may arrive first (the soak
/// with a small arena saw 4 before 3, and the link closed). An id skipped
/// that way is begun later, once; an id begun already, or a jump that
/// leaves more than `MAX_STREAMS_OVERTAKEN` ids to come, closes the link.
#[test]
fn stream_begins_overtaken_by_later_ones_are_taken_once() {
    use super::stream::MAX_STREAMS_OVERTAKEN as MAX;
    let mut rx = Rendezvous::new(params(), 1 << 20);
    rx.add_rx_link(LINK, "tx", 11);
    let begin = |rx: &mut Rendezvous, stream: u32| {
        let m = Msg::StreamBegin { stream, key: format!("s{stream}"), step: 5, meta: meta(), total: 8 };
        rx.on_message(LINK, &m.encode())
    };
    let opened = |acts: &Actions, s: u32| matches!(&acts[..], [Action::StreamAlloc { stream, .. }] if *stream == s);
    // 3 overtook 1 and 2: both are still begun, in either order.
    for s in [3, 2, 1] {
        let acts = begin(&mut rx, s);
        assert!(opened(&acts, s), "stream {s}: {acts:?}");
    }
    // Each id once only.
    for s in [1, 2, 3] {
        assert!(closed(&begin(&mut rx, s)), "stream {s} begun twice");
    }
    // A jump that leaves MAX ids to come is taken; one more is not.
    let far = 3 + MAX as u32 + 1;
    assert!(opened(&begin(&mut rx, far), far));
    assert!(closed(&begin(&mut rx, far + 2)), "a jump past the cap");
    // Skipped ids that come make room again, one each.
    assert!(opened(&begin(&mut rx, 4), 4));
    assert!(opened(&begin(&mut rx, far + 2), far + 2)); // far + 1 to come: MAX again
    assert!(opened(&begin(&mut rx, far + 1), far + 1)); // MAX - 1
    assert!(opened(&begin(&mut rx, far + 4), far + 4)); // far + 3 to come: MAX
    assert!(closed(&begin(&mut rx, far + 6)), "past the cap again");
}

/// M6: a sender's `StreamCancel` can overtake its `StreamBegin` (its
/// threads send begins as they go). The begin that comes after it must
/// allocate nothing (before, it allocated `total` bytes and held them
/// until the step ended) and fail its receive; a cancel of an id begun
/// already and ended is ignored; more early cancels than the cap close
/// the link.
#[test]
fn a_stream_cancel_that_overtakes_its_begin_leaves_nothing_allocated() {
    use super::stream::MAX_STREAMS_OVERTAKEN as MAX;
    let mut rx = Rendezvous::new(params(), 1 << 20);
    rx.add_rx_link(LINK, "tx", 11);
    let begin = |rx: &mut Rendezvous, stream: u32, step: u64| {
        let m = Msg::StreamBegin { stream, key: format!("s{stream}"), step, meta: meta(), total: 1 << 20 };
        rx.on_message(LINK, &m.encode())
    };
    let cancel = |rx: &mut Rendezvous, stream: u32| rx.on_message(LINK, &Msg::StreamCancel { stream }.encode());
    assert!(cancel(&mut rx, 1).is_empty());
    let acts = begin(&mut rx, 1, 5);
    assert!(!acts.iter().any(|a| matches!(a, Action::StreamAlloc { .. })), "a cancelled stream allocated its buffer: {acts:?}");
    assert!(!closed(&acts), "{acts:?}");
    assert_eq!(rx.rx[&LINK].streams.len(), 0, "a cancelled stream is held open");
    match recv_result(&mut rx, "tx", "s1", 5) {
        Some(Err(e)) => assert!(e.message().contains("gave up"), "{e}"),
        other => panic!("the receive of a cancelled stream: {other:?}"),
    }
    // An id skipped by a later begin, cancelled before its own begin.
    assert!(matches!(&begin(&mut rx, 3, 6)[..], [Action::StreamAlloc { .. }]));
    assert!(cancel(&mut rx, 2).is_empty());
    assert!(!begin(&mut rx, 2, 6).iter().any(|a| matches!(a, Action::StreamAlloc { .. })));
    // A cancel of a stream that ended: nothing kept.
    assert!(cancel(&mut rx, 1).is_empty());
    assert!(rx.rx[&LINK].cancelled_unbegun.is_empty());
    // At most MAX early cancels are kept.
    for s in 0..MAX as u32 {
        assert!(!closed(&cancel(&mut rx, 100 + s)));
    }
    assert!(closed(&cancel(&mut rx, 100 + MAX as u32)), "early cancels past the cap");
}

/// Chunks sent as `StreamData` messages may reach the receiver in any
/// order (the sender's pumps run on whichever thread holds the protocol
/// lock and send after it; the simulation found two racing): each is
/// taken once, the tensor arrives whole; a duplicate or a misaligned one
/// closes the link.
#[test]
fn stream_data_messages_are_taken_in_any_order_each_once() {
    use crate::constants::STREAM_MSG_BYTES;
    let piece = STREAM_MSG_BYTES;
    let total = 2 * piece + 100;
    let data: Vec<u8> = (0..total).map(|i| (i * 13 + i / 7) as u8).collect();
    // No arena: no stream slots, so the stream goes by messages.
    let mut rx = Rendezvous::new(params(), 0);
    rx.add_rx_link(LINK, "tx", 11);
    let m = Msg::StreamBegin { stream: 1, key: "big".into(), step: 3, meta: TensorMeta { dtype: 1, flags: 0, dims: vec![total as i64].into() }, total: total as u64 };
    assert!(matches!(&rx.on_message(LINK, &m.encode())[..], [Action::StreamAlloc { .. }]));
    let acts = rx.stream_alloc_done(LINK, 1, Some(vec![0; total]));
    assert!(acts.iter().any(|a| matches!(a, Action::Send { msg: Msg::StreamReady { outcome: wire::STREAM_MESSAGES, .. }, .. })), "{acts:?}");
    let chunk = |i: usize| Msg::StreamData { stream: 1, offset: (i * piece) as u64, bytes: data[i * piece..((i + 1) * piece).min(total)].to_vec() };
    for i in [2, 0, 1] {
        let acts = rx.on_message(LINK, &chunk(i).encode());
        assert!(!closed(&acts), "chunk {i}: {acts:?}");
        for a in acts {
            if let Action::CopyChunk { link, stream, src: ChunkSrc::Bytes(b), len, dst, at } = a {
                let res = dst.write_at(at, &b);
                drop(dst);
                rx.chunk_copied(link, stream, None, len, res);
            }
        }
    }
    match recv_result(&mut rx, "tx", "big", 3) {
        Some(Ok(r)) => assert!(r.data == Data::Owned(data.clone()), "the tensor arrived altered"),
        other => panic!("the streamed tensor: {other:?}"),
    }
    // A second stream: a duplicate chunk, and a misaligned one, close the link.
    let m = Msg::StreamBegin { stream: 2, key: "big2".into(), step: 3, meta: TensorMeta { dtype: 1, flags: 0, dims: vec![total as i64].into() }, total: total as u64 };
    rx.on_message(LINK, &m.encode());
    rx.stream_alloc_done(LINK, 2, Some(vec![0; total]));
    let c0 = Msg::StreamData { stream: 2, offset: 0, bytes: data[..piece].to_vec() };
    assert!(!closed(&rx.on_message(LINK, &c0.encode())));
    assert!(closed(&rx.on_message(LINK, &c0.encode())), "a duplicate chunk");
    let mut rx2 = Rendezvous::new(params(), 0);
    rx2.add_rx_link(LINK, "tx", 11);
    rx2.on_message(LINK, &Msg::StreamBegin { stream: 1, key: "k".into(), step: 3, meta: meta(), total: total as u64 }.encode());
    rx2.stream_alloc_done(LINK, 1, Some(vec![0; total]));
    let odd = Msg::StreamData { stream: 1, offset: 5, bytes: vec![0; 10] };
    assert!(closed(&rx2.on_message(LINK, &odd.encode())), "a misaligned chunk");
}

/// L2: stream ids wrap past u32::MAX back to 1 (0 is never used); a link
/// that streamed 2^32 tensors goes on rather than closing as "reused".
#[test]
fn stream_ids_that_wrap_past_u32_max_go_on() {
    use super::stream::after;
    assert!(after(1, u32::MAX) && after(2, u32::MAX - 1) && !after(u32::MAX, 1) && !after(5, 5));
    let mut rx = Rendezvous::new(params(), 1 << 20);
    rx.add_rx_link(LINK, "tx", 11);
    rx.rx.get_mut(&LINK).unwrap().last_stream = u32::MAX - 2;
    let begin = |rx: &mut Rendezvous, stream: u32| {
        let m = Msg::StreamBegin { stream, key: format!("s{stream}"), step: 5, meta: meta(), total: 8 };
        rx.on_message(LINK, &m.encode())
    };
    let opened = |acts: &Actions, s: u32| matches!(&acts[..], [Action::StreamAlloc { stream, .. }] if *stream == s);
    // MAX - 1, then 1 overtakes MAX (0 is skipped by the sender, not owed).
    assert!(opened(&begin(&mut rx, u32::MAX - 1), u32::MAX - 1));
    assert!(opened(&begin(&mut rx, 1), 1));
    assert_eq!(rx.rx[&LINK].unbegun.len(), 1, "only u32::MAX is still to come");
    assert!(opened(&begin(&mut rx, u32::MAX), u32::MAX));
    assert!(opened(&begin(&mut rx, 2), 2));
    assert!(closed(&begin(&mut rx, 1)), "1 begun twice");
    assert!(closed(&begin(&mut rx, 0)), "id 0");
    // A far jump is still refused, without walking the ids.
    assert!(closed(&begin(&mut rx, 2 + (1 << 30))), "a jump past the cap");
}

/// L3: one task may hold at most `MAX_RX_LINKS_PER_PEER` incoming links
/// (each link's caps are a quarter of the node's), and all tasks together
/// `MAX_RX_LINKS`; a link that ends gives its place back.
#[test]
fn incoming_links_are_capped_per_peer_and_per_node() {
    use crate::constants::{MAX_RX_LINKS, MAX_RX_LINKS_PER_PEER};
    let mut rx = Rendezvous::new(params(), 1 << 20);
    for l in 0..MAX_RX_LINKS_PER_PEER as LinkId {
        rx.admit_rx_link("p").unwrap();
        rx.add_rx_link(l + 1, "p", 7);
    }
    let e = rx.admit_rx_link("p").unwrap_err();
    assert!(matches!(e, Error::ResourceExhausted(_)) && e.to_string().contains("at most 2"), "{e}");
    rx.admit_rx_link("q").expect("another task is not held back by p's links");
    assert!(rx.admit_rx_link("p").is_err(), "the cap counts every life of a task (a hello claims its own incarnation)");
    let _ = rx.on_link_lost(1, Error::PeerLost("gone".into()));
    rx.admit_rx_link("p").expect("an ended link gives its place back");
    let mut rx = Rendezvous::new(params(), 1 << 20);
    for l in 0..MAX_RX_LINKS as LinkId {
        rx.add_rx_link(l + 1, &format!("t{l}"), 7);
    }
    let e = rx.admit_rx_link("new").unwrap_err();
    assert!(e.to_string().contains(&format!("at most {MAX_RX_LINKS}")), "{e}");
}
