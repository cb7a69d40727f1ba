//! Little-endian fields, written and read in order: the one codec under
//! the rendezvous messages, the slot header and the handshake (`wire`) and
//! the verbs connection's private data (`fabric::verbs::cm`). Reading is
//! total: a field past the end of the input is `Error::Protocol`, never a
//! panic.

use crate::error::{Error, Result};

/// Where a `Writer` puts its bytes.
pub trait Sink {
    fn put(&mut self, b: &[u8]);
}

impl Sink for Vec<u8> {
    fn put(&mut self, b: &[u8]) {
        self.extend_from_slice(b);
    }
}

impl<A: smallvec::Array<Item = u8>> Sink for smallvec::SmallVec<A> {
    fn put(&mut self, b: &[u8]) {
        self.extend_from_slice(b);
    }
}

/// A fixed-size record (`Writer::fixed`): writing past its end is a bug in
/// the encoder, and panics.
pub struct Fixed<const N: usize> {
    b: [u8; N],
    at: usize,
}

impl<const N: usize> Sink for Fixed<N> {
    fn put(&mut self, b: &[u8]) {
        self.b[self.at..self.at + b.len()].copy_from_slice(b);
        self.at += b.len();
    }
}

pub struct Writer<S: Sink>(pub S);

impl<const N: usize> Writer<Fixed<N>> {
    /// A writer of exactly `N` bytes; what is not written stays zero.
    pub fn fixed() -> Self {
        Writer(Fixed { b: [0; N], at: 0 })
    }

    /// Zeros up to byte `at` (a field placed further on).
    pub fn skip_to(&mut self, at: usize) {
        assert!(at >= self.0.at && at <= N, "skip_to({at}) from {} in a {N}-byte record", self.0.at);
        self.0.at = at;
    }

    pub fn into_array(self) -> [u8; N] {
        self.0.b
    }
}

impl<S: Sink> Writer<S> {
    pub fn u8(&mut self, v: u8) {
        self.0.put(&[v]);
    }
    pub fn u32(&mut self, v: u32) {
        self.0.put(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.0.put(&v.to_le_bytes());
    }
    /// Bytes as they are, no length.
    pub fn raw(&mut self, b: &[u8]) {
        self.0.put(b);
    }
    /// Bytes behind a u32 length. Callers bound `b` far below 4 GiB
    /// (messages are at most `MAX_MSG_BYTES`).
    pub fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.0.put(b);
    }
}

pub struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub fn new(b: &'a [u8]) -> Self {
        Reader { b, at: 0 }
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|e| *e <= self.b.len()).ok_or_else(|| {
            Error::Protocol(format!("truncated message ({} bytes, needed {} more at {})", self.b.len(), n, self.at))
        })?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    /// Bytes behind a u32 length of at most `max`.
    pub fn bytes(&mut self, max: usize) -> Result<&'a [u8]> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(Error::Protocol(format!("field of {n} bytes exceeds {max}")));
        }
        self.take(n)
    }
    /// Moves to byte `at` (a field placed further on).
    pub fn skip_to(&mut self, at: usize) -> Result<()> {
        if at < self.at {
            return Err(Error::Internal(format!("skip_to({at}) back from {}", self.at)));
        }
        self.take(at - self.at).map(|_| ())
    }
    pub fn remaining(&self) -> usize {
        self.b.len() - self.at
    }
    /// Every byte was read.
    pub fn end(&self) -> Result<()> {
        if self.at != self.b.len() {
            return Err(Error::Protocol(format!("{} trailing bytes in message", self.b.len() - self.at)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip_and_every_truncation_is_an_error() {
        let mut w = Writer(Vec::new());
        w.u8(7);
        w.u32(0xdead_beef);
        w.u64(u64::MAX - 1);
        w.bytes(b"key");
        w.raw(&[1, 2]);
        let b = w.0;
        type Fields = (u8, u32, u64, Vec<u8>, [u8; 2]);
        let read = |b: &[u8]| -> Result<Fields> {
            let mut r = Reader::new(b);
            let v = (r.u8()?, r.u32()?, r.u64()?, r.bytes(16)?.to_vec(), r.array()?);
            r.end()?;
            Ok(v)
        };
        assert_eq!(read(&b).unwrap(), (7, 0xdead_beef, u64::MAX - 1, b"key".to_vec(), [1, 2]));
        for n in 0..b.len() {
            assert!(matches!(read(&b[..n]), Err(Error::Protocol(_))), "{n} bytes");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(matches!(read(&long), Err(Error::Protocol(_))));
        // A length past its cap, and one past the input.
        assert!(Reader::new(&b[13..]).bytes(2).is_err());
        assert!(Reader::new(&[0xff, 0xff, 0xff, 0x7f]).bytes(usize::MAX).is_err());
    }

    #[test]
    fn a_fixed_record_places_fields_and_zero_fills() {
        let mut w = Writer::<Fixed<16>>::fixed();
        w.u32(1);
        w.skip_to(8);
        w.u64(2);
        let a = w.into_array();
        assert_eq!(a, [1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]);
        let mut r = Reader::new(&a);
        assert_eq!(r.u32().unwrap(), 1);
        r.skip_to(8).unwrap();
        assert_eq!((r.u64().unwrap(), r.remaining()), (2, 0));
    }
}
