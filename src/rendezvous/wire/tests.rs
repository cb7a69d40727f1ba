//! Unit tests of the wire format: every message, the handshake and the
//! slot header round-trip; truncated or garbage input is an error, never
//! a panic.

use super::*;
use crate::constants::HEADER_BYTES;

fn samples() -> Vec<Msg> {
    vec![
        Msg::Announce { key: "a;b;c".into(), step: 7, need: 1 << 20, returned: vec![(1, 2), (3, 4)] },
        Msg::Publish { key: "k".into(), edge_id: 9, slots: vec![SlotDesc { id: 1, gen: 2, offset: 4096, capacity: 100, key: 0xdead_beef }] },
        Msg::Credit { edge_id: 1, slot: 2, gen: 3 },
        Msg::ReturnSlot { slot: 5, gen: 6 },
        Msg::NoSpace { key: "k".into(), need: 99 },
        Msg::Revoke { edge_id: 3 },
        Msg::More { edge_id: 3, need: 4 },
        Msg::NoMore { edge_id: 5 },
        Msg::Abort { step: 9, code: 3, reason: "why".into() },
        Msg::Request { key: "k".into(), step: 12 },
        Msg::Ready,
        Msg::Ping,
        Msg::PlaceFor { req: 1, receiver: "r".into(), key: "k".into(), bytes: 9 },
        Msg::PlaceDone { req: 1, outcome: 2, error: "e".into() },
        Msg::Grow { edge_id: 1, slot: SlotDesc { id: 2, gen: 3, offset: 4096, capacity: 5, key: 7 } },
        Msg::StreamBegin { stream: 3, key: "k".into(), step: 1, meta: TensorMeta { dtype: 1, flags: 2, dims: vec![2; 30].into() }, total: 6 << 30 },
        Msg::StreamReady { stream: 3, outcome: STREAM_REFUSED, error: "no memory".into() },
        Msg::StreamData { stream: 3, offset: 1 << 33, bytes: vec![1, 2, 3] },
        Msg::StreamAck { stream: 3 },
        Msg::StreamCancel { stream: 4 },
        Msg::Call { id: 1 << 40, method: 1, part: 3, more: true, body: vec![7; 1000] },
        Msg::Reply { id: 3, code: 14, part: 0, more: false, body: b"unavailable".to_vec() },
        Msg::CallCancel { id: 9 },
    ]
}

#[test]
fn messages_round_trip() {
    for m in samples() {
        assert_eq!(Msg::decode(&m.encode()).unwrap(), m);
    }
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    for m in samples() {
        let b = m.encode();
        for n in 0..b.len() {
            assert!(matches!(Msg::decode(&b[..n]), Err(Error::Protocol(_))), "{m:?} cut at {n}");
        }
        let mut longer = b.clone();
        longer.push(0);
        assert!(Msg::decode(&longer).is_err());
    }
}

#[test]
fn garbage_is_rejected() {
    let mut x: u64 = 0x9e3779b97f4a7c15;
    for _ in 0..20000 {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        let len = (x % 64) as usize;
        let mut b: Vec<u8> = (0..len).map(|i| (x >> (i % 8 * 8)) as u8).collect();
        if !b.is_empty() { b[0] = (x % 8) as u8 }
        let _ = Msg::decode(&b); // must not panic
        let _ = Hello::decode(&b);
    }
    // A count that claims more elements than the message holds.
    let mut b = vec![T_PUBLISH]; b.extend_from_slice(&1u32.to_le_bytes()); b.push(b'k');
    b.extend_from_slice(&1u32.to_le_bytes()); b.extend_from_slice(&u32::MAX.to_le_bytes());
    assert!(Msg::decode(&b).is_err());
}

#[test]
fn header_round_trip_and_checks() {
    let h = SlotHeader { edge_id: 1, slot: 2, gen: 3, incarnation: 4, step: 5, len: 6,
        meta: TensorMeta { dtype: 7, flags: FLAG_DEAD, dims: vec![1, -1, 3].into() }, chunk: None };
    let b = h.encode();
    assert_eq!(b.len(), HEADER_BYTES);
    assert_eq!(SlotHeader::decode(&b).unwrap(), h);
    let mut bad = b; bad[0] ^= 1;
    assert!(SlotHeader::decode(&bad).is_err());
    let mut bad = b; bad[6] = 200;
    assert!(SlotHeader::decode(&bad).is_err());
    // A chunk header: stream and offset (past 4 GiB) round-trip, and
    // the chunk bit does not leak into the rank.
    let c = SlotHeader { edge_id: 1, slot: 2, gen: 3, incarnation: 4, step: 5, len: 16 << 20,
        meta: TensorMeta { dtype: 7, flags: 0, dims: vec![].into() }, chunk: Some(ChunkAt { stream: u32::MAX, offset: (5 << 30) + 4096 }) };
    assert_eq!(SlotHeader::decode(&c.encode()).unwrap(), c);
    let mut plain = c.clone(); plain.chunk = None;
    assert_eq!(SlotHeader::decode(&plain.encode()).unwrap().chunk, None);
}

#[test]
fn hello_checks_version() {
    let h = Hello { task: "/job:w/task:0".into(), incarnation: 42, target: "x".into(), rpc: true, proof: vec![9; 32] };
    assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
    let mut b = h.encode(); b[4] = 99;
    let e = Hello::decode(&b).unwrap_err();
    assert!(e.message().contains("version"));
}
