//! The doorbell ring as its consumer sees it when the producer (a peer
//! with the ring mapped read-write) scribbles over every word: head, tail,
//! the sleeping flag and the entries. A drain must stay bounded (at most one
//! ring's worth per call) and never panic.
#![no_main]

use rdma_device::fuzzing::{Ring, RingWord, RING_ENTRIES};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Ok(ring) = Ring::create() else { return };
    let mut i = 0;
    let mut take = |n: usize| -> Option<u64> {
        let s = data.get(i..i + n)?;
        i += n;
        let mut b = [0u8; 8];
        b[..n].copy_from_slice(s);
        Some(u64::from_le_bytes(b))
    };
    let mut pushed = 0u64;
    let mut drained = 0u64;
    while let Some(op) = take(1) {
        match op % 6 {
            0 => {
                let Some(imm) = take(4) else { break };
                if ring.try_push(imm as u32).is_some() {
                    pushed += 1;
                }
            }
            1 => {
                let n = ring.drain(|_| {});
                assert!(n <= RING_ENTRIES, "drained {n} entries in one call");
                drained += n as u64;
            }
            2 => {
                let Some(v) = take(8) else { break };
                ring.poke(RingWord::Tail, v);
            }
            3 => {
                let Some(v) = take(8) else { break };
                ring.poke(RingWord::Head, v);
            }
            4 => {
                let Some(v) = take(4) else { break };
                ring.poke(RingWord::Sleeping, v);
            }
            _ => {
                let (Some(at), Some(v)) = (take(2), take(4)) else { break };
                ring.poke(RingWord::Entry(at as usize), v);
            }
        }
        let _ = ring.has_entries();
    }
    // An honest producer after the scribbling: the ring still works.
    let _ = ring.drain(|_| {});
    let _ = (pushed, drained);
    if ring.try_push(7).is_some() {
        let mut got = Vec::new();
        ring.drain(|imm| got.push(imm));
        assert_eq!(got.last(), Some(&7));
    }
});
