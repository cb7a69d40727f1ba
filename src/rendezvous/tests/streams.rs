//! Streamed tensors through the simulated fabric of `tests`: through
//! stream slots or messages in any order, of any size and rank; the
//! stream limits; streams that end early on either side; forged chunks.

use super::*;

/// A stream's claimed total is the peer's to choose: the state machine
/// never allocates it (the node does, fallibly, on `StreamAlloc`), and a
/// total past the limit is refused with a reason, the link kept.
#[test]
fn stream_total_claimed_by_the_peer_is_not_reserved_up_front() {
    let p = Params { slots_per_edge: 2, max_outstanding_writes: 4, incarnation: 22, rpc: false };
    let mut rx = Rendezvous::new(p, 1 << 20);
    rx.add_rx_link(LINK, "tx", 11);
    let meta = TensorMeta { dtype: 1, flags: 0, dims: vec![].into() };
    let m = Msg::StreamBegin { stream: 1, key: "big".into(), step: 1, meta: meta.clone(), total: crate::constants::MAX_STREAM_TOTAL };
    let acts = rx.on_message(LINK, &m.encode());
    assert!(matches!(acts.as_slice(), [Action::StreamAlloc { stream: 1, total, .. }] if *total == crate::constants::MAX_STREAM_TOTAL), "{acts:?}");
    for (i, total) in [crate::constants::MAX_STREAM_TOTAL + 1, u64::MAX].into_iter().enumerate() {
        let m = Msg::StreamBegin { stream: 2 + i as u32, key: format!("big{i}"), step: 1, meta: meta.clone(), total };
        let acts = rx.on_message(LINK, &m.encode());
        assert!(matches!(acts.as_slice(), [Action::Send { msg: Msg::StreamReady { outcome: wire::STREAM_REFUSED, .. }, .. }]), "{acts:?}");
    }
    // The refused receive fails when it is made.
    let got = Arc::new(Mutex::new(None));
    let g = got.clone();
    let acts = rx.recv("tx", "big0", 1, Box::new(move |r| *g.lock().unwrap() = Some(r)));
    for a in acts {
        if let Action::Deliver { done, result } = a {
            done.complete(result);
        }
    }
    assert!(matches!(got.lock().unwrap().take(), Some(Err(Error::ResourceExhausted(_)))));
    assert_eq!(rx.arena_in_use(), 0);
}

/// Issue 18, N4: the stream limit holds for the node, not per link: a
/// second peer cannot open another limit's worth while the first's
/// streams are open.
#[test]
fn the_stream_limit_counts_every_peer() {
    let p = Params { slots_per_edge: 2, max_outstanding_writes: 4, incarnation: 22, rpc: false };
    let mut rx = Rendezvous::new(p, 1 << 20);
    rx.add_rx_link(LINK, "tx", 11);
    rx.add_rx_link(LINK + 1, "tx2", 12);
    let meta = TensorMeta { dtype: 1, flags: 0, dims: vec![].into() };
    let half = crate::constants::MAX_STREAM_TOTAL / 2;
    let m = Msg::StreamBegin { stream: 1, key: "a".into(), step: 1, meta: meta.clone(), total: half + 1 };
    let acts = rx.on_message(LINK, &m.encode());
    assert!(matches!(acts.as_slice(), [Action::StreamAlloc { .. }]), "{acts:?}");
    let m = Msg::StreamBegin { stream: 1, key: "b".into(), step: 1, meta: meta.clone(), total: half };
    let acts = rx.on_message(LINK + 1, &m.encode());
    assert!(
        matches!(acts.as_slice(), [Action::Send { msg: Msg::StreamReady { outcome: wire::STREAM_REFUSED, .. }, .. }]),
        "another peer's stream went past the node's limit: {acts:?}"
    );
}

/// Issue 18, N4: refused streams for receives never made are remembered
/// (the receive must fail when it comes), but a peer cannot grow that
/// without bound: past `MAX_FAILED_AHEAD_PER_LINK` its link is closed
/// (the node's cap: `caps_tests.rs`).
#[test]
fn refused_streams_waiting_for_receives_are_capped() {
    let p = Params { slots_per_edge: 2, max_outstanding_writes: 4, incarnation: 22, rpc: false };
    let mut rx = Rendezvous::new(p, 1 << 20);
    rx.add_rx_link(LINK, "tx", 11);
    let meta = TensorMeta { dtype: 1, flags: 0, dims: vec![].into() };
    let cap = crate::constants::MAX_FAILED_AHEAD_PER_LINK;
    for i in 0..=cap {
        let total = crate::constants::MAX_STREAM_TOTAL + 1;
        let m = Msg::StreamBegin { stream: 1 + i as u32, key: format!("k{i}"), step: 1_000_000 + i as u64, meta: meta.clone(), total };
        let acts = rx.on_message(LINK, &m.encode());
        let closed = acts.iter().any(|a| matches!(a, Action::Close { .. }));
        assert_eq!(closed, i == cap, "refusal {i}: {acts:?}");
    }
}

/// Sends `data` and records the send's result (which may be an error).
fn send_any(s: &mut Sim, key: &str, step: u64, meta: TensorMeta, data: Vec<u8>) -> Arc<Mutex<Option<Result<()>>>> {
    let res = Arc::new(Mutex::new(None));
    let r2 = res.clone();
    let acts = s.tx.send(LINK, key, step, meta, Box::new(data), Box::new(move |r| *r2.lock().unwrap() = Some(r)));
    s.run_tx(acts);
    res
}

fn take_got(s: &Sim) -> Vec<(u64, Result<Received>)> {
    std::mem::take(&mut *s.got.lock().unwrap())
}

/// Tensors larger than the arena, exactly a chunk multiple, one byte more,
/// and several at once on different edges: every byte arrives, chunks
/// land and are copied in any order, and at most STREAM_SLOTS chunks are
/// ever in flight (the sender's working set is bounded).
#[test]
fn streams_through_slots_in_any_order() {
    use crate::constants::STREAM_SLOTS;
    let arena = 8u64 << 20;
    let chunk = stream_chunk_bytes(arena).unwrap();
    for seed in 1..=12u64 {
        let mut s = Sim::new(arena as usize, 2, seed);
        let sizes = [arena as usize + 12345, chunk as usize * 40, chunk as usize * 40 + 1, 3 * arena as usize];
        let mut sends = Vec::new();
        for (i, len) in sizes.iter().enumerate() {
            let key = format!("big{i}");
            if seed % 2 == 0 {
                s.recv(&key, 1);
            }
            let m = TensorMeta { dtype: 1, flags: 0, dims: vec![*len as i64].into() };
            sends.push(send_any(&mut s, &key, 1, m, pattern(seed + i as u64, *len)));
        }
        s.settle();
        if seed % 2 == 1 {
            for i in 0..sizes.len() {
                s.recv(&format!("big{i}"), 1);
            }
        }
        let got = take_got(&s);
        assert_eq!(got.len(), sizes.len(), "seed {seed}");
        for (_, r) in &got {
            let r = r.as_ref().expect("recv ok");
            let len = r.meta.dims[0] as usize;
            let i = sizes.iter().position(|l| *l == len).unwrap();
            assert!(s.bytes(r) == pattern(seed + i as u64, len), "seed {seed}: tensor {i} corrupted");
            assert!(matches!(r.data, Data::Owned(_)));
        }
        for r in &sends {
            assert!(matches!(*r.lock().unwrap(), Some(Ok(()))), "seed {seed}");
        }
        let want: u64 = sizes.iter().map(|l| (*l as u64).div_ceil(chunk)).sum();
        assert_eq!(s.tx.tally.stream_chunks, want, "seed {seed}");
        assert_eq!(s.tx.tally.inline_tensors, sizes.len() as u64);
        assert!(s.max_chunks_pending <= STREAM_SLOTS, "seed {seed}: {} chunks in flight", s.max_chunks_pending);
        assert!(s.max_chunks_pending >= 2, "seed {seed}: the pipeline never overlapped");
        // The stream slots stay placed for the link (at most 1/8 of the arena).
        assert!(s.rx.arena_in_use() <= arena / 8, "{}", s.rx.arena_in_use());
    }
}

/// With no room for stream slots, chunks go as messages, produced lazily:
/// at most STREAM_MSG_WINDOW unacknowledged.
#[test]
fn streams_through_messages_when_no_slot_fits() {
    let arena = 1u64 << 20; // too small for stream slots
    assert!(stream_chunk_bytes(arena).is_none());
    let mut s = Sim::new(arena as usize, 2, 7);
    let len = 3 << 20;
    s.recv("big", 1);
    let r = send_any(&mut s, "big", 1, TensorMeta { dtype: 1, flags: 0, dims: vec![len as i64].into() }, pattern(3, len));
    s.settle();
    let got = take_got(&s);
    assert!(s.bytes(got[0].1.as_ref().unwrap()) == pattern(3, len));
    assert!(matches!(*r.lock().unwrap(), Some(Ok(()))));
    assert_eq!(s.tx.tally.stream_messages, (len as u64).div_ceil(crate::constants::STREAM_MSG_BYTES as u64));
    assert!(s.max_msgs_pending <= crate::constants::STREAM_MSG_WINDOW as usize, "{}", s.max_msgs_pending);
}

/// Rank above what a header holds: streamed, shape intact; a dead tensor
/// of such rank (no bytes) too.
#[test]
fn high_rank_tensors_are_streamed_with_their_shape() {
    let mut s = Sim::new(8 << 20, 2, 9);
    let dims: Vec<i64> = vec![1; 30];
    s.recv("r", 1);
    send_any(&mut s, "r", 1, TensorMeta { dtype: 1, flags: 0, dims: dims.clone().into() }, vec![5; 4]);
    send_any(&mut s, "d", 1, TensorMeta { dtype: 1, flags: FLAG_DEAD, dims: dims.clone().into() }, vec![]);
    s.recv("d", 1);
    s.settle();
    let got = take_got(&s);
    assert_eq!(got.len(), 2);
    for (_, r) in got {
        let r = r.unwrap();
        assert_eq!(r.meta.dims.as_slice(), &dims[..]);
        assert_eq!(s.bytes(&r), if r.meta.flags == FLAG_DEAD { vec![] } else { vec![5; 4] });
    }
}

/// The receiver's step ends mid-stream: the buffer goes, the sender's send
/// fails, chunks still on their way are dropped and their slots credited,
/// and the link keeps streaming.
#[test]
fn step_end_mid_stream_discards_it_on_both_sides() {
    let arena = 8u64 << 20;
    let mut s = Sim::new(arena as usize, 2, 11);
    let len = 3 * arena as usize;
    let r = send_any(&mut s, "big", 4, TensorMeta { dtype: 1, flags: 0, dims: vec![len as i64].into() }, pattern(1, len));
    // Let a few chunks move, then end the step at the receiver.
    for _ in 0..40 {
        let choices = [!s.to_rx.is_empty(), !s.to_tx.is_empty(), !s.imms.is_empty(), !s.copies.is_empty()];
        if let Some(i) = choices.iter().position(|c| *c) {
            match i {
                0 => { let m = s.to_rx.pop_front().unwrap(); let a = s.rx.on_message(LINK, &m.encode()); s.run_rx(a); }
                1 => { let m = s.to_tx.pop_front().unwrap(); let a = s.tx.on_message(LINK, &m.encode()); s.run_tx(a); }
                2 => { let imm = s.imms.pop_front().unwrap(); let a = s.rx.on_write_imm(LINK, imm, &Mem(s.mem.clone())); s.run_rx(a); }
                _ => s.settle_one_copy(),
            }
        }
    }
    assert!(s.tx.tally.stream_chunks > 0);
    let acts = s.rx.step_done(4);
    s.run_rx(acts);
    s.settle();
    assert!(matches!(*r.lock().unwrap(), Some(Err(Error::Aborted(_)))), "{:?}", r.lock().unwrap());
    assert!(s.rx.describe().matches("stream").count() <= 1, "{}", s.rx.describe());
    // The link still streams.
    s.recv("big", 5);
    let r = send_any(&mut s, "big", 5, TensorMeta { dtype: 1, flags: 0, dims: vec![len as i64].into() }, pattern(2, len));
    s.settle();
    assert!(matches!(*r.lock().unwrap(), Some(Ok(()))));
    let got = take_got(&s);
    assert!(s.bytes(got.last().unwrap().1.as_ref().unwrap()) == pattern(2, len));
}

/// The receiver has no memory for the tensor: the send fails with a
/// reason, the receive too, and the link survives.
#[test]
fn stream_without_memory_fails_the_transfer_not_the_link() {
    let mut s = Sim::new(8 << 20, 2, 13);
    s.alloc_limit = 1 << 20;
    s.recv("big", 1);
    let r = send_any(&mut s, "big", 1, TensorMeta { dtype: 1, flags: 0, dims: vec![].into() }, vec![1; 9 << 20]);
    s.settle();
    assert!(matches!(&*r.lock().unwrap(), Some(Err(Error::ResourceExhausted(m))) if m.contains("no memory")), "{:?}", r.lock().unwrap());
    assert!(matches!(take_got(&s)[0].1, Err(Error::ResourceExhausted(_))));
    s.recv("small", 2);
    send_any(&mut s, "small", 2, TensorMeta::default(), vec![3; 10]);
    s.settle();
    assert!(take_got(&s)[0].1.is_ok());
}

/// Forged chunks close the link, whatever is wrong with them.
#[test]
fn forged_chunks_close_the_link() {
    use crate::rendezvous::wire::ChunkAt;
    let arena = 8u64 << 20;
    let chunk = stream_chunk_bytes(arena).unwrap();
    let len = arena as usize + 10;
    type Forge = fn(&mut SlotHeader, u64);
    let forgeries: [(&str, Forge); 6] = [
        ("misaligned", |h, _| h.chunk = Some(ChunkAt { stream: 1, offset: 7 })),
        ("past the end", |h, c| h.chunk = Some(ChunkAt { stream: 1, offset: (8 << 20) / c * c + c })),
        ("never begun", |h, _| h.chunk = Some(ChunkAt { stream: 9, offset: 0 })),
        ("short", |h, _| h.len = 5),
        ("other step", |h, _| h.step = 99),
        ("not a chunk", |h, _| h.chunk = None),
    ];
    for (what, forge) in forgeries {
        let mut s = Sim::new(arena as usize, 2, 17);
        send_any(&mut s, "big", 1, TensorMeta::default(), vec![1; len]);
        // Deliver messages only: the sender writes its chunks (imms queued).
        while !s.to_rx.is_empty() || !s.to_tx.is_empty() {
            if let Some(m) = s.to_rx.pop_front() { let a = s.rx.on_message(LINK, &m.encode()); s.run_rx(a); }
            if let Some(m) = s.to_tx.pop_front() { let a = s.tx.on_message(LINK, &m.encode()); s.run_tx(a); }
        }
        let imm = s.imms.pop_front().expect("a chunk was written");
        // Find the slot's header in memory and forge it.
        let off = (0..arena as usize / 4096).map(|p| p * 4096).find(|o| {
            SlotHeader::decode(&s.mem.lock().unwrap()[*o..*o + HEADER_BYTES]).is_ok_and(|h| h.slot == imm)
        }).unwrap();
        let mut h = SlotHeader::decode(&s.mem.lock().unwrap()[off..off + HEADER_BYTES]).unwrap();
        forge(&mut h, chunk);
        s.mem.lock().unwrap()[off..off + HEADER_BYTES].copy_from_slice(&h.encode());
        let acts = s.rx.on_write_imm(LINK, imm, &Mem(s.mem.clone()));
        assert!(matches!(&acts[..], [Action::Close { why: Error::Protocol(_), .. }]), "{what}: {acts:?}");
    }
    // A duplicate chunk: the same write twice.
    let mut s = Sim::new(arena as usize, 2, 19);
    send_any(&mut s, "big", 1, TensorMeta::default(), vec![1; len]);
    while !s.to_rx.is_empty() || !s.to_tx.is_empty() {
        if let Some(m) = s.to_rx.pop_front() { let a = s.rx.on_message(LINK, &m.encode()); s.run_rx(a); }
        if let Some(m) = s.to_tx.pop_front() { let a = s.tx.on_message(LINK, &m.encode()); s.run_tx(a); }
    }
    let imm = s.imms.pop_front().unwrap();
    let a = s.rx.on_write_imm(LINK, imm, &Mem(s.mem.clone()));
    s.run_rx(a);
    s.settle_one_copy();
    s.to_tx.clear(); // the credit is lost: the sender never rewrites it
    let acts = s.rx.on_write_imm(LINK, imm, &Mem(s.mem.clone()));
    // The slot is with the sender again, so the header decides: a chunk at
    // an offset already taken.
    assert!(matches!(&acts[..], [Action::Close { why: Error::Protocol(m), .. }] if m.contains("duplicate")), "{acts:?}");
    // A reused stream id.
    let m = Msg::StreamBegin { stream: 1, key: "again".into(), step: 1, meta: TensorMeta::default(), total: 5 };
    assert!(matches!(&s.rx.on_message(LINK, &m.encode())[..], [Action::Close { .. }]));
}


/// A stream that ends early (the receiver discards it, the sender aborts
/// its step, the link is lost, a chunk write fails) completes its send
/// only when no chunk write reads the caller's tensor any more, and
/// exactly once (issue 18, N1: the tensor may be freed at `done`).
#[test]
fn a_failed_stream_completes_only_after_its_last_chunk_write() {
    let arena = 8u64 << 20;
    let chunk = stream_chunk_bytes(arena).unwrap() as usize;
    for how in 0..4 {
        let mut s = Sim::new(arena as usize, 2, 3 + how);
        s.held = Some(Vec::new());
        s.recv("big", 1);
        let len = 3 * arena as usize; // no slot holds it: streamed
        let res = send_any(&mut s, "big", 1, TensorMeta { dtype: 1, flags: 0, dims: vec![len as i64].into() }, pattern(1, len));
        s.settle();
        let held = s.held.take().unwrap();
        assert!(held.len() >= 2, "{how}: chunks in flight: {}", held.len());
        let acts = match how {
            0 => s.tx.on_message(LINK, &Msg::StreamCancel { stream: held[0].0 }.encode()),
            1 => s.tx.abort_step(1, Error::Aborted("test".into()), true),
            2 => s.tx.on_link_lost(LINK, Error::PeerLost("test".into())),
            _ => s.tx.chunk_written(LINK, held[0].0, Err(Error::PeerLost("write failed".into()))),
        };
        s.run_tx(acts.into_iter().filter(|a| !matches!(a, Action::Send { .. })).collect());
        // A chunk write failing is itself back.
        let back = if how == 3 { 1 } else { 0 };
        for (i, (stream, payload)) in held.iter().enumerate().skip(back) {
            assert!(res.lock().unwrap().is_none(), "{how}: done ran with {} chunk write(s) still reading the tensor", held.len() - i);
            assert_eq!(payload.bytes().len(), chunk, "{how}: the range is still readable");
            let acts = s.tx.chunk_written(LINK, *stream, if i % 2 == 0 { Ok(()) } else { Err(Error::PeerLost("late".into())) });
            s.run_tx(acts.into_iter().filter(|a| !matches!(a, Action::Send { .. })).collect());
        }
        assert!(matches!(*res.lock().unwrap(), Some(Err(_))), "{how}: done after the last chunk, with the error");
        assert!(s.tx.tx_ending.is_empty(), "{how}: the tombstone is gone");
    }
}

/// L1: the node goes while a failed stream's chunk writes still read the
/// caller's tensor (a tombstone). Its `done` must still run, exactly once,
/// with an error, and only when the last chunk lets go of the bytes
/// (before, the tombstone was dropped with the protocol state and `done`
/// never ran).
#[test]
fn a_tombstone_left_at_shutdown_completes_when_its_last_chunk_lets_go() {
    let arena = 8u64 << 20;
    let mut s = Sim::new(arena as usize, 2, 7);
    s.held = Some(Vec::new());
    s.recv("big", 1);
    let len = 3 * arena as usize;
    let res = send_any(&mut s, "big", 1, TensorMeta { dtype: 1, flags: 0, dims: vec![len as i64].into() }, pattern(1, len));
    s.settle();
    let held = s.held.take().unwrap();
    assert!(held.len() >= 2, "chunks in flight: {}", held.len());
    let acts = s.tx.on_link_lost(LINK, Error::PeerLost("test".into()));
    s.run_tx(acts.into_iter().filter(|a| !matches!(a, Action::Send { .. })).collect());
    assert!(!s.tx.tx_ending.is_empty(), "a tombstone waits for its chunks");
    drop(s); // the node goes
    for (i, (_, payload)) in held.into_iter().enumerate() {
        assert!(res.lock().unwrap().is_none(), "done ran with chunk {i} still reading the tensor");
        drop(payload);
    }
    assert!(matches!(*res.lock().unwrap(), Some(Err(_))), "the tombstone's done never ran: {:?}", res.lock().unwrap().as_ref().map(|r| r.is_ok()));
}
