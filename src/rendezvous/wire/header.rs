//! The slot header: what the sender writes at the start of a slot, in the
//! same write as the payload, and what the receiver checks before it
//! trusts the payload.

use super::{Dims, TensorMeta};
use crate::codec::{Fixed, Reader, Writer};
use crate::constants::{HEADER_BYTES, MAGIC, MAX_DIMS, PROTOCOL_VERSION};
use crate::error::{Error, Result};

/// The header the sender writes at the start of a slot, in the same write
/// as the payload.
///
/// Layout (little endian): 0 magic, 4 version (low 16 bits) | ndims << 16
/// | `HDR_CHUNK` (bit 31), 8 edge, 12 slot, 16 gen, 20 flags, 24 dtype,
/// 28 stream (chunks), 32 incarnation, 40 step, 48 len, 56 chunk offset
/// (chunks), 64.. dims. A chunk of a streamed tensor carries no shape
/// (that came in `StreamBegin`); `len` is the chunk's length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotHeader {
    pub edge_id: u32,
    pub slot: u32,
    pub gen: u32,
    pub incarnation: u64,
    pub step: u64,
    pub len: u64,
    pub meta: TensorMeta,
    /// Set on a chunk of a streamed tensor.
    pub chunk: Option<ChunkAt>,
}

/// Where a chunk written into a stream slot belongs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkAt {
    pub stream: u32,
    /// Byte offset of the chunk in the tensor.
    pub offset: u64,
}

/// Header bit: the slot holds a chunk of a streamed tensor.
const HDR_CHUNK: u32 = 1 << 31;

impl SlotHeader {
    /// Encode into exactly `HEADER_BYTES`. Callers ensure
    /// `meta.dims.len() <= MAX_DIMS` (higher ranks go inline).
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut w = Writer::<Fixed<HEADER_BYTES>>::fixed();
        let chunk = self.chunk.unwrap_or(ChunkAt { stream: 0, offset: 0 });
        let is_chunk = if self.chunk.is_some() { HDR_CHUNK } else { 0 };
        w.u32(MAGIC);
        w.u32((PROTOCOL_VERSION & 0xffff) | ((self.meta.dims.len() as u32) << 16) | is_chunk);
        w.u32(self.edge_id);
        w.u32(self.slot);
        w.u32(self.gen);
        w.u32(self.meta.flags);
        w.u32(self.meta.dtype);
        w.u32(chunk.stream);
        w.u64(self.incarnation);
        w.u64(self.step);
        w.u64(self.len);
        w.u64(chunk.offset);
        for d in self.meta.dims.iter().take(MAX_DIMS) {
            w.u64(*d as u64);
        }
        w.into_array()
    }

    pub fn decode(b: &[u8]) -> Result<SlotHeader> {
        if b.len() < HEADER_BYTES {
            return Err(Error::Protocol("slot header truncated".into()));
        }
        let mut r = Reader::new(&b[..HEADER_BYTES]);
        if r.u32()? != MAGIC {
            return Err(Error::Protocol("slot header has a bad magic (torn or foreign write)".into()));
        }
        let vn = r.u32()?;
        if vn & 0xffff != PROTOCOL_VERSION {
            return Err(Error::Protocol(format!("slot header version {} unsupported", vn & 0xffff)));
        }
        let ndims = ((vn & !HDR_CHUNK) >> 16) as usize;
        if ndims > MAX_DIMS {
            return Err(Error::Protocol(format!("slot header claims {ndims} dims (max {MAX_DIMS})")));
        }
        let (edge_id, slot, gen, flags, dtype, stream) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?, r.u32()?, r.u32()?);
        let (incarnation, step, len, offset) = (r.u64()?, r.u64()?, r.u64()?, r.u64()?);
        let mut dims = Dims::with_capacity(ndims);
        for _ in 0..ndims {
            dims.push(r.u64()? as i64);
        }
        Ok(SlotHeader {
            edge_id,
            slot,
            gen,
            incarnation,
            step,
            len,
            meta: TensorMeta { dtype, flags, dims },
            chunk: (vn & HDR_CHUNK != 0).then_some(ChunkAt { stream, offset }),
        })
    }
}
