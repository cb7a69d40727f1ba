//! Placement of slots in the receive arena: a first-fit allocator over
//! page-aligned offsets with coalescing. It hands out offsets only; the
//! memory itself belongs to the fabric's arena.

use crate::constants::SLOT_ALIGN;

pub struct ArenaAlloc {
    total: u64,
    /// Free ranges (offset, len), sorted by offset, never adjacent.
    free: Vec<(u64, u64)>,
    in_use: u64,
}

impl ArenaAlloc {
    pub fn new(total: u64) -> ArenaAlloc {
        let total = total / SLOT_ALIGN as u64 * SLOT_ALIGN as u64;
        ArenaAlloc { total, free: vec![(0, total)], in_use: 0 }
    }

    /// `len` rounded up to SLOT_ALIGN; None if that overflows (a size a
    /// peer chose can be anything).
    pub fn round(len: u64) -> Option<u64> {
        len.max(1).div_ceil(SLOT_ALIGN as u64).checked_mul(SLOT_ALIGN as u64)
    }

    /// `HEADER_BYTES + payload` rounded up: the bytes a slot for `payload`
    /// reserves. None if that overflows or exceeds the whole arena.
    pub fn slot_bytes(&self, payload: u64) -> Option<u64> {
        payload.checked_add(crate::constants::HEADER_BYTES as u64).and_then(Self::round).filter(|r| *r <= self.total)
    }

    /// Offset of `len` bytes (rounded up to SLOT_ALIGN), or None if no room.
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        let len = Self::round(len)?;
        let i = self.free.iter().position(|&(_, l)| l >= len)?;
        let (off, l) = self.free[i];
        if l == len {
            self.free.remove(i);
        } else {
            self.free[i] = (off + len, l - len);
        }
        self.in_use += len;
        Some(off)
    }

    /// Give back a range returned by `alloc` with the same `len`.
    pub fn free(&mut self, off: u64, len: u64) {
        let Some(len) = Self::round(len) else { return };
        let i = self.free.partition_point(|&(o, _)| o < off);
        self.free.insert(i, (off, len));
        // Coalesce with the next, then the previous neighbour.
        if i + 1 < self.free.len() && self.free[i].0 + self.free[i].1 == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == self.free[i].0 {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
        self.in_use = self.in_use.saturating_sub(len);
    }

    pub fn in_use(&self) -> u64 {
        self.in_use
    }

    pub fn total(&self) -> u64 {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_coalesces() {
        let mut a = ArenaAlloc::new(16 * 4096);
        let x = a.alloc(1).unwrap();
        let y = a.alloc(4097).unwrap();
        let z = a.alloc(4096).unwrap();
        assert_eq!((x, y, z), (0, 4096, 3 * 4096));
        assert_eq!(a.in_use(), 4 * 4096);
        assert!(a.alloc(13 * 4096).is_none());
        a.free(y, 4097);
        a.free(x, 1);
        a.free(z, 4096);
        assert_eq!(a.in_use(), 0);
        assert_eq!(a.alloc(16 * 4096), Some(0));
    }

    #[test]
    fn sizes_near_u64_max_never_wrap() {
        let a = ArenaAlloc::new(16 * 4096);
        for k in [0u64, 1, 255, 256, 4095, 4096, 1 << 20] {
            assert_eq!(a.slot_bytes(u64::MAX - k), None, "k = {k}");
        }
        assert_eq!(ArenaAlloc::round(u64::MAX - 4094), None);
        assert_eq!(ArenaAlloc::round(u64::MAX - 4095), Some(u64::MAX - 4095));
        assert_eq!(a.slot_bytes(16 * 4096 - 256), Some(16 * 4096));
        assert_eq!(a.slot_bytes(16 * 4096 - 255), None);
    }
}
