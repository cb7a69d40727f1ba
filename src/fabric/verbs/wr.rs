//! Work-request ids: tagged integers, never pointers.
//!
//! Layout of the 64-bit `wr_id`: `kind` (8 bits) | `gen` (24 bits) |
//! `index` (32 bits). The connection itself is found through the
//! completion's QP number; `gen` then proves the completion belongs to the
//! current owner of `index` (an op slot's generation, or the connection's
//! own tag for its message buffers), so a late completion of a torn-down
//! connection or a recycled slot is ignored instead of misattributed.

/// What a work request was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WrKind {
    /// A posted receive buffer (`index` = buffer).
    Recv = 1,
    /// A control-message fragment (`index` = send buffer).
    Send = 2,
    /// A non-final piece of a write (`index` = staging chunk or [`NO_CHUNK`]).
    Piece = 3,
    /// The final WRITE_WITH_IMM of a write (`index` = op slot).
    WriteLast = 4,
    /// An RDMA READ (`index` = op slot).
    Read = 5,
    /// A memory window's bind (`index` = the connection's bind number).
    Bind = 6,
}

/// `index` of a [`WrKind::Piece`] that used no staging chunk.
pub(crate) const NO_CHUNK: u32 = u32::MAX;

const GEN_MASK: u32 = 0x00ff_ffff;

/// Reduce a generation to the 24 bits the tag carries.
pub(crate) fn gen24(g: u64) -> u32 {
    (g as u32) & GEN_MASK
}

pub(crate) fn encode(kind: WrKind, gen: u32, index: u32) -> u64 {
    ((kind as u64) << 56) | (u64::from(gen & GEN_MASK) << 32) | u64::from(index)
}

pub(crate) fn decode(wr_id: u64) -> Option<(WrKind, u32, u32)> {
    let kind = match (wr_id >> 56) as u8 {
        1 => WrKind::Recv,
        2 => WrKind::Send,
        3 => WrKind::Piece,
        4 => WrKind::WriteLast,
        5 => WrKind::Read,
        6 => WrKind::Bind,
        _ => return None,
    };
    Some((kind, ((wr_id >> 32) as u32) & GEN_MASK, wr_id as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        for kind in [WrKind::Recv, WrKind::Send, WrKind::Piece, WrKind::WriteLast, WrKind::Read, WrKind::Bind] {
            for (gen, idx) in [(0, 0), (GEN_MASK, u32::MAX), (12345, 7)] {
                assert_eq!(decode(encode(kind, gen, idx)), Some((kind, gen, idx)));
            }
        }
        assert_eq!(decode(0), None);
        assert_eq!(gen24(0x1_0000_0005), 5);
    }
}
