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

    pub fn round(len: u64) -> u64 {
        len.max(1).div_ceil(SLOT_ALIGN as u64) * SLOT_ALIGN as u64
    }

    /// Offset of `len` bytes (rounded up to SLOT_ALIGN), or None if no room.
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        let len = Self::round(len);
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
        let len = Self::round(len);
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
}
