//! The protocol state machine fed by a hostile peer: one receiver link and
//! one sender link on a single `Rendezvous`, driven by arbitrary control
//! messages (raw bytes and well-formed ones with arbitrary fields), slot
//! headers written into the arena followed by write immediates, releases,
//! receives, sends, step ends, aborts and lost links, in any order; and
//! streamed tensors: stream messages, chunk headers, chunk writes and
//! copies completing in any order, stream buffers that cannot be allocated.
//! Nothing may panic, the arena accounting must stay within the arena,
//! every copy the protocol asks for must lie inside the arena and its
//! destination buffer, and no write or message reads a sent tensor after
//! its send completed (the caller may free it then: chunk writes complete
//! late, after cancels, aborts and lost links, and read their bytes when
//! they do).
#![no_main]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rdma_device::constants::HEADER_BYTES;
use rdma_device::error::Error;
use rdma_device::rendezvous::{stream_chunk_bytes, Payload, STREAM_KEY, Action, Actions, ChunkAt, ChunkSrc, Data, Msg, Params, Rendezvous, SlotDesc, SlotHeader, SlotMemory, TensorMeta};

/// Large enough for stream slots (1/8 of it, in 4 chunks of 128 KiB).
const ARENA: usize = 4 << 20;
const RX: u64 = 1;
const TX: u64 = 2;
const INCARNATION: u64 = 11;

struct Mem(Vec<u8>);
impl SlotMemory for Mem {
    fn header(&self, offset: u64) -> [u8; HEADER_BYTES] {
        let o = offset as usize;
        // The protocol only asks for headers of slots it placed itself.
        assert!(o.checked_add(HEADER_BYTES).is_some_and(|e| e <= self.0.len()), "header read outside the arena at {offset}");
        self.0[o..o + HEADER_BYTES].try_into().expect("header length")
    }
}

struct In<'a>(&'a [u8]);
impl In<'_> {
    fn n(&mut self, k: usize) -> Option<u64> {
        if self.0.len() < k {
            return None;
        }
        let (h, t) = self.0.split_at(k);
        self.0 = t;
        let mut b = [0u8; 8];
        b[..k].copy_from_slice(h);
        Some(u64::from_le_bytes(b))
    }
    fn u8(&mut self) -> Option<u8> { self.n(1).map(|v| v as u8) }
    fn u32(&mut self) -> Option<u32> { self.n(4).map(|v| v as u32) }
    fn u64(&mut self) -> Option<u64> { self.n(8) }
    /// A size that is small, near a power of two, or near u64::MAX.
    fn size(&mut self) -> Option<u64> {
        let k = self.u8()?;
        let v = self.u32()? as u64;
        Some(match k % 4 {
            0 => v % 4096,
            1 => 1u64 << (v % 64),
            2 => u64::MAX - (v % 4096),
            _ => v,
        })
    }
    /// One of a few keys, or the reserved key of the stream slots.
    fn key(&mut self) -> Option<String> {
        let k = self.u8()? % 5;
        Some(if k == 4 { STREAM_KEY.to_string() } else { format!("k{k}") })
    }
    fn bytes(&mut self, max: usize) -> Option<&[u8]> {
        let n = (self.n(2)? as usize).min(max).min(self.0.len());
        let (h, t) = self.0.split_at(n);
        self.0 = t;
        Some(h)
    }
}

fn message(i: &mut In) -> Option<Msg> {
    Some(match i.u8()? % 13 {
        0 => Msg::Announce { key: i.key()?, step: i.u64()? % 8, need: i.size()?, returned: vec![(i.u32()? % 8, i.u32()? % 4)] },
        1 => Msg::Publish {
            key: i.key()?,
            edge_id: i.u32()? % 8,
            slots: vec![SlotDesc { id: i.u32()? % 8, gen: i.u32()? % 4, offset: i.size()?, capacity: i.size()?, key: i.u32()? }],
        },
        2 => Msg::Credit { edge_id: i.u32()? % 8, slot: i.u32()? % 8, gen: i.u32()? % 4 },
        3 => Msg::ReturnSlot { slot: i.u32()? % 8, gen: i.u32()? % 4 },
        4 => Msg::NoSpace { key: i.key()?, need: i.size()? },
        5 => Msg::Revoke { edge_id: i.u32()? % 8 },
        6 => Msg::More { edge_id: i.u32()? % 8, need: i.size()? },
        7 => Msg::Grow { edge_id: i.u32()? % 8, slot: SlotDesc { id: i.u32()? % 8, gen: i.u32()? % 4, offset: i.size()?, capacity: i.size()?, key: i.u32()? } },
        8 => Msg::StreamBegin {
            stream: i.u32()? % 8,
            key: i.key()?,
            step: i.u64()? % 8,
            meta: TensorMeta { dtype: 1, flags: 0, dims: vec![1; (i.u8()? % 32) as usize].into() },
            total: i.size()?,
        },
        9 => Msg::StreamReady { stream: i.u32()? % 8, outcome: i.u32()? % 4, error: String::new() },
        10 => {
            let stream = i.u32()? % 8;
            let offset = i.size()?;
            Msg::StreamData { stream, offset, bytes: i.bytes(4096)?.to_vec() }
        }
        11 => Msg::StreamAck { stream: i.u32()? % 8 },
        _ => Msg::StreamCancel { stream: i.u32()? % 8 },
    })
}

struct World {
    r: Rendezvous,
    mem: Mem,
    /// Slots delivered to us and not yet released.
    held: VecDeque<(u64, u32, u32)>,
    /// Writes we were asked to make (as a sender) and have not completed.
    writes: VecDeque<Write>,
    /// Chunk copies the receiver asked for, not yet done.
    copies: VecDeque<Action>,
}

enum Write {
    Tensor(rdma_device::rendezvous::SendDone),
    /// A chunk write of a stream: it reads its bytes when it completes.
    Chunk(u32, Box<dyn Payload>),
}

/// A sent tensor whose send's completion "frees" it: reading it after that
/// is the use-after-free the protocol must never cause.
struct Live {
    bytes: Vec<u8>,
    freed: Arc<AtomicBool>,
}

impl Payload for Live {
    fn bytes(&self) -> &[u8] {
        assert!(!self.freed.load(Ordering::SeqCst), "a sent tensor was read after its send completed");
        &self.bytes
    }
}

/// Largest stream buffer the harness allocates (bigger ones "fail").
const ALLOC_LIMIT: u64 = 1 << 20;

impl World {
    /// Carry out a chunk copy the protocol asked for; it must lie inside
    /// the arena and inside its destination.
    fn copy(&mut self, c: Action) -> Actions {
        let Action::CopyChunk { link, stream, src, len, dst, at } = c else { unreachable!() };
        let (slot, res) = match src {
            ChunkSrc::Slot { slot, gen, offset } => {
                let end = offset.checked_add(len).expect("chunk end overflows");
                assert!(end <= ARENA as u64, "chunk copy from outside the arena");
                (Some((slot, gen)), dst.write_at(at, &self.mem.0[offset as usize..end as usize]))
            }
            ChunkSrc::Bytes(b) => {
                assert_eq!(b.len() as u64, len);
                (None, dst.write_at(at, &b))
            }
        };
        assert!(res.is_ok(), "chunk copy outside its destination: {res:?}");
        drop(dst);
        self.r.chunk_copied(link, stream, slot, len, res)
    }

    fn run(&mut self, acts: Actions) {
        let mut q: VecDeque<Action> = acts.into_iter().collect();
        while let Some(a) = q.pop_front() {
            match a {
                Action::Write { done, .. } => self.writes.push_back(Write::Tensor(done)),
                Action::WriteChunk { stream, payload, .. } => {
                    assert!(!payload.bytes().is_empty(), "empty chunk write");
                    self.writes.push_back(Write::Chunk(stream, payload));
                }
                Action::SendChunk { link, stream, payload, .. } => {
                    assert!(!payload.bytes().is_empty(), "empty stream message");
                    drop(payload);
                    q.extend(self.r.chunk_sent(link, stream));
                }
                Action::StreamAlloc { link, stream, total } => {
                    let buf = (total <= ALLOC_LIMIT).then(|| vec![0u8; total as usize]);
                    q.extend(self.r.stream_alloc_done(link, stream, buf));
                }
                c @ Action::CopyChunk { .. } => self.copies.push_back(c),
                Action::SendDone { done, result } => done.complete(result),
                Action::Deliver { done, result } => {
                    if let Ok(r) = &result {
                        if let Data::Slot { link, slot, gen, offset, len } = r.data {
                            let end = offset.checked_add(len).expect("slot end overflows");
                            assert!(end <= ARENA as u64, "delivered slot ends past the arena");
                            self.held.push_back((link, slot, gen));
                        }
                    }
                    done.complete(result);
                }
                Action::Release { link, slot, gen } => q.extend(self.r.release(link, slot, gen)),
                Action::Close { link, why } => q.extend(self.r.on_link_lost(link, why)),
                Action::Send { .. } | Action::PlaceFor { .. } | Action::PlaceDone { .. } => {}
            }
            assert!(self.r.arena_in_use() <= ARENA as u64, "arena accounting exceeds the arena");
        }
    }
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    // The first byte's low bit picks the mode: push (the default) or rpc.
    let rpc = data.first().is_some_and(|b| b & 1 == 1);
    let params = Params { slots_per_edge: 2, max_outstanding_writes: 4, incarnation: 22, rpc };
    let mut w = World {
        r: Rendezvous::new(params, ARENA as u64),
        mem: Mem(vec![0; ARENA]),
        held: VecDeque::new(),
        writes: VecDeque::new(),
        copies: VecDeque::new(),
    };
    w.r.add_rx_link(RX, "tx", INCARNATION);
    w.r.add_tx_link(TX, "rx");
    let mut i = In(data);
    let mut ops = 0;
    while let Some(op) = i.u8() {
        ops += 1;
        if ops > 256 {
            break;
        }
        let link = if op & 0x80 != 0 { TX } else { RX };
        let acts = match op % 13 {
            0 => match i.bytes(4096) {
                Some(b) => w.r.on_message(link, &b.to_vec()),
                None => break,
            },
            1 => match message(&mut i) {
                Some(m) => w.r.on_message(link, &m.encode()),
                None => break,
            },
            2 | 3 => {
                // A slot header written into the arena, then its immediate.
                let (Some(off), Some(imm), Some(gen), Some(edge), Some(step), Some(len), Some(inc)) =
                    (i.u32(), i.u32(), i.u32(), i.u32(), i.u64(), i.size(), i.u8())
                else { break };
                // Chunk headers (every other one) aim at chunk boundaries of
                // the stream slots' size, sometimes a little off.
                let cg = stream_chunk_bytes(ARENA as u64).unwrap_or(65536);
                let chunk = (op & 0x40 != 0).then(|| ChunkAt {
                    stream: ((step >> 8) % 8) as u32,
                    offset: (step >> 16) % 64 * cg + if inc & 0x10 != 0 { (step >> 24) % 7 } else { 0 },
                });
                let h = SlotHeader {
                    edge_id: edge % 8,
                    slot: imm % 8,
                    gen: gen % 4,
                    incarnation: if inc & 1 == 0 { INCARNATION } else { inc as u64 },
                    step: step % 8,
                    len: if chunk.is_some() && inc & 0x20 != 0 { cg } else { len },
                    meta: TensorMeta { dtype: 1, flags: (inc >> 1) as u32 & 3, dims: vec![len as i64].into() },
                    chunk,
                };
                let at = (off as usize % (ARENA / 4096)) * 4096;
                w.mem.0[at..at + HEADER_BYTES].copy_from_slice(&h.encode());
                w.r.on_write_imm(link, imm % 8, &w.mem)
            }
            4 => match i.u32() {
                Some(imm) => w.r.on_write_imm(link, imm % 8, &w.mem),
                None => break,
            },
            5 => match w.held.pop_front() {
                Some((l, s, g)) => w.r.release(l, s, g),
                None => Actions::new(),
            },
            6 => match (i.key(), i.u64()) {
                (Some(k), Some(step)) => w.r.recv("tx", &k, step % 8, Box::new(|_| {})),
                _ => break,
            },
            7 => match (i.key(), i.u64(), i.bytes(8192)) {
                (Some(k), Some(step), Some(b)) => {
                    // Sometimes larger than the receiver's arena: streamed.
                    let mut bytes = b.to_vec();
                    if op & 0x40 != 0 && !bytes.is_empty() {
                        bytes = bytes.repeat((ARENA + 4096) / bytes.len() + 1);
                    }
                    let meta = TensorMeta { dtype: 1, flags: 0, dims: vec![bytes.len() as i64].into() };
                    let freed = Arc::new(AtomicBool::new(false));
                    let f2 = freed.clone();
                    w.r.send(TX, &k, step % 8, meta, Box::new(Live { bytes, freed }), Box::new(move |_| f2.store(true, Ordering::SeqCst)))
                }
                _ => break,
            },
            8 => match w.writes.pop_front() {
                Some(Write::Tensor(done)) => {
                    done.complete(Ok(()));
                    w.r.write_done(TX)
                }
                Some(Write::Chunk(stream, payload)) => {
                    // The write reads its bytes until it completes.
                    assert!(!payload.bytes().is_empty());
                    drop(payload);
                    let res = if op & 0x40 != 0 { Err(Error::PeerLost("fuzz".into())) } else { Ok(()) };
                    w.r.chunk_written(TX, stream, res)
                }
                None => Actions::new(),
            },
            9 => match i.u64() {
                Some(s) => w.r.step_done(s % 8),
                None => break,
            },
            10 => match i.u64() {
                Some(s) => w.r.abort_step(s % 8, Error::Aborted("fuzz".into()), op & 0x40 != 0),
                None => break,
            },
            12 => match i.u8() {
                Some(k) if !w.copies.is_empty() => {
                    let c = w.copies.remove(k as usize % w.copies.len()).expect("in range");
                    w.copy(c)
                }
                Some(_) => Actions::new(),
                None => break,
            },
            _ => {
                let mut a = w.r.on_link_lost(link, Error::PeerLost("fuzz".into()));
                if link == RX {
                    w.r.add_rx_link(RX, "tx", INCARNATION);
                } else {
                    a.extend(w.r.abort_all(Error::Aborted("fuzz".into())));
                    w.r.add_tx_link(TX, "rx");
                }
                a
            }
        };
        w.run(acts);
    }
    // Copies finish; everything still held goes back; the arena must then
    // be consistent.
    while let Some(c) = w.copies.pop_front() {
        let a = w.copy(c);
        w.run(a);
    }
    while let Some((l, s, g)) = w.held.pop_front() {
        let a = w.r.release(l, s, g);
        w.run(a);
    }
    // Chunk writes still out complete (each reading its bytes first).
    while let Some(wr) = w.writes.pop_front() {
        let a = match wr {
            Write::Tensor(done) => {
                done.complete(Ok(()));
                w.r.write_done(TX)
            }
            Write::Chunk(stream, payload) => {
                assert!(!payload.bytes().is_empty());
                drop(payload);
                w.r.chunk_written(TX, stream, Ok(()))
            }
        };
        w.run(a);
    }
    assert!(w.r.arena_in_use() <= ARENA as u64);
});
