//! A bounds-checked, zero-copy msgpack reader over one payload slice.
//!
//! Built on `rmp`'s low-level marker and length decoders rather than on `rmpv` values: the
//! decoder walks the known event schema directly (so recursion depth is fixed by the schema,
//! not by the input), borrows strings from the payload, and skips everything it does not know
//! with an iterative loop that keeps no stack at all. Declared lengths are never trusted: an
//! array or map that claims more elements than there are bytes left is rejected before any
//! iteration, and every capacity reservation is bounded by the bytes remaining.

use rmp::Marker;
use rmp::decode;

/// A low-level failure, given a field name by the decoder (see `decode::DecodeError`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WireError {
    /// The input ended inside a value.
    Truncated,
    /// A reserved marker byte (0xc1).
    Reserved,
    /// A declared length that cannot fit in the bytes left.
    LengthExceedsInput,
    /// A value of another msgpack type than the schema allows.
    WrongType,
    /// A string that is not UTF-8.
    BadUtf8,
}

/// The msgpack family of the next value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Nil,
    Bool,
    Int,
    Float,
    Str,
    Bin,
    Array,
    Map,
    Ext,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    #[cfg(test)]
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len()
    }

    fn peek_marker(&self) -> Result<Marker, WireError> {
        match self.buf.first() {
            Some(&b) => Ok(Marker::from_u8(b)),
            None => Err(WireError::Truncated),
        }
    }

    pub(crate) fn kind(&self) -> Result<Kind, WireError> {
        Ok(match self.peek_marker()? {
            Marker::Null => Kind::Nil,
            Marker::True | Marker::False => Kind::Bool,
            Marker::FixPos(_)
            | Marker::FixNeg(_)
            | Marker::U8
            | Marker::U16
            | Marker::U32
            | Marker::U64
            | Marker::I8
            | Marker::I16
            | Marker::I32
            | Marker::I64 => Kind::Int,
            Marker::F32 | Marker::F64 => Kind::Float,
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => Kind::Str,
            Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => Kind::Bin,
            Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => Kind::Array,
            Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => Kind::Map,
            Marker::FixExt1
            | Marker::FixExt2
            | Marker::FixExt4
            | Marker::FixExt8
            | Marker::FixExt16
            | Marker::Ext8
            | Marker::Ext16
            | Marker::Ext32 => Kind::Ext,
            Marker::Reserved => return Err(WireError::Reserved),
        })
    }

    /// Consumes a nil if one is next; `Ok(true)` when it did.
    pub(crate) fn try_nil(&mut self) -> Result<bool, WireError> {
        if self.peek_marker()? == Marker::Null {
            self.buf = &self.buf[1..];
            Ok(true)
        } else {
            Ok(false)
        }
    }

    /// Any msgpack integer, widened so that the full `i64` and `u64` ranges both fit.
    pub(crate) fn read_int(&mut self) -> Result<i128, WireError> {
        match self.peek_marker()? {
            Marker::FixPos(_) | Marker::U8 | Marker::U16 | Marker::U32 | Marker::U64 => {
                decode::read_int::<u64, _>(&mut self.buf)
                    .map(i128::from)
                    .map_err(|_| WireError::Truncated)
            }
            Marker::FixNeg(_) | Marker::I8 | Marker::I16 | Marker::I32 | Marker::I64 => {
                decode::read_int::<i64, _>(&mut self.buf)
                    .map(i128::from)
                    .map_err(|_| WireError::Truncated)
            }
            _ => Err(WireError::WrongType),
        }
    }

    /// A non-negative int below 2^32 (token ids, sizes) on the hot path: the common
    /// encodings are read straight from the slice; anything else goes through
    /// [`Self::read_int`]. `Ok(None)` means "an int, but not a u32".
    #[inline]
    pub(crate) fn read_u32(&mut self) -> Result<Option<u32>, WireError> {
        let (v, used) = match *self.buf {
            [b, ..] if b < 0x80 => (u32::from(b), 1),
            [0xcc, b, ..] => (u32::from(b), 2),
            [0xcd, b0, b1, ..] => (u32::from(u16::from_be_bytes([b0, b1])), 3),
            [0xce, b0, b1, b2, b3, ..] => (u32::from_be_bytes([b0, b1, b2, b3]), 5),
            _ => return Ok(u32::try_from(self.read_int()?).ok()),
        };
        self.buf = &self.buf[used..];
        Ok(Some(v))
    }

    /// Reads `n` ints into `out` (token ids: most of a store's bytes). `Ok(false)` when one
    /// of them is an int outside `u32`; the reader is then left mid-array.
    pub(crate) fn read_u32_seq(&mut self, n: usize, out: &mut Vec<u32>) -> Result<bool, WireError> {
        out.reserve(n);
        let mut left = n;
        // While 8 bytes remain, one load serves all three common encodings: the marker
        // picks the value out of the big-endian word after it with selects rather than a
        // jump per id (token ids mix fixint, u16 and u32 unpredictably).
        while left > 0 {
            let Some(&[m, b0, b1, b2, b3, ..]) = self.buf.first_chunk::<8>() else {
                break;
            };
            let word = u32::from_be_bytes([b0, b1, b2, b3]);
            let (v, len) = match m {
                0x00..=0x7f => (u32::from(m), 1),
                0xcd => (word >> 16, 3),
                0xce => (word, 5),
                _ => break,
            };
            out.push(v);
            self.buf = &self.buf[len..];
            left -= 1;
        }
        for _ in 0..left {
            // Positive fixints (< 128) dominate real token ids only for tiny vocabularies;
            // u16/u32 encodings dominate otherwise, both handled without a function call.
            let v = match *self.buf {
                [b, ref rest @ ..] if b < 0x80 => {
                    self.buf = rest;
                    u32::from(b)
                }
                [0xcd, b0, b1, ref rest @ ..] => {
                    self.buf = rest;
                    u32::from(u16::from_be_bytes([b0, b1]))
                }
                [0xce, b0, b1, b2, b3, ref rest @ ..] => {
                    self.buf = rest;
                    u32::from_be_bytes([b0, b1, b2, b3])
                }
                _ => match self.read_u32()? {
                    Some(v) => v,
                    None => return Ok(false),
                },
            };
            out.push(v);
        }
        Ok(true)
    }

    /// Any msgpack number (ints are widened to `f64`).
    pub(crate) fn read_number(&mut self) -> Result<f64, WireError> {
        match self.peek_marker()? {
            Marker::F32 => decode::read_f32(&mut self.buf)
                .map(f64::from)
                .map_err(|_| WireError::Truncated),
            Marker::F64 => decode::read_f64(&mut self.buf).map_err(|_| WireError::Truncated),
            // Precision loss is irrelevant: the timestamp is only informative.
            _ => self.read_int().map(|v| v as f64),
        }
    }

    pub(crate) fn read_str(&mut self) -> Result<&'a str, WireError> {
        if self.kind()? != Kind::Str {
            return Err(WireError::WrongType);
        }
        match decode::read_str_from_slice(self.buf) {
            Ok((s, rest)) => {
                self.buf = rest;
                Ok(s)
            }
            Err(decode::DecodeStringError::InvalidUtf8(..)) => Err(WireError::BadUtf8),
            Err(decode::DecodeStringError::BufferSizeTooSmall(_)) => {
                Err(WireError::LengthExceedsInput)
            }
            Err(_) => Err(WireError::Truncated),
        }
    }

    pub(crate) fn read_bin(&mut self) -> Result<&'a [u8], WireError> {
        if self.kind()? != Kind::Bin {
            return Err(WireError::WrongType);
        }
        let len = decode::read_bin_len(&mut self.buf).map_err(|_| WireError::Truncated)?;
        self.take(len as usize)
    }

    /// Reads an array header. The count is guaranteed to be at most the bytes left (every
    /// element needs at least one byte), so it is safe as a capacity hint.
    pub(crate) fn read_array_len(&mut self) -> Result<usize, WireError> {
        if self.kind()? != Kind::Array {
            return Err(WireError::WrongType);
        }
        let len = decode::read_array_len(&mut self.buf).map_err(|_| WireError::Truncated)?;
        self.check_items(u64::from(len))?;
        Ok(len as usize)
    }

    /// Reads a map header; the pair count is bounded like [`Self::read_array_len`].
    pub(crate) fn read_map_len(&mut self) -> Result<usize, WireError> {
        if self.kind()? != Kind::Map {
            return Err(WireError::WrongType);
        }
        let len = decode::read_map_len(&mut self.buf).map_err(|_| WireError::Truncated)?;
        self.check_items(2 * u64::from(len))?;
        Ok(len as usize)
    }

    fn check_items(&self, items: u64) -> Result<(), WireError> {
        if items > self.buf.len() as u64 {
            Err(WireError::LengthExceedsInput)
        } else {
            Ok(())
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if n > self.buf.len() {
            return Err(WireError::LengthExceedsInput);
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    /// Skips one complete value of any shape. Iterative (a counter of values still owed),
    /// so hostile nesting costs no stack, and the counter is checked against the bytes left.
    pub(crate) fn skip(&mut self) -> Result<(), WireError> {
        let mut pending: u64 = 1;
        while pending > 0 {
            pending -= 1;
            let marker = self.peek_marker()?;
            let children: u64 = match marker {
                Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => u64::from(
                    decode::read_array_len(&mut self.buf).map_err(|_| WireError::Truncated)?,
                ),
                Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
                    2 * u64::from(
                        decode::read_map_len(&mut self.buf).map_err(|_| WireError::Truncated)?,
                    )
                }
                Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => {
                    let len =
                        decode::read_str_len(&mut self.buf).map_err(|_| WireError::Truncated)?;
                    self.take(len as usize)?;
                    0
                }
                Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
                    let len =
                        decode::read_bin_len(&mut self.buf).map_err(|_| WireError::Truncated)?;
                    self.take(len as usize)?;
                    0
                }
                Marker::FixExt1
                | Marker::FixExt2
                | Marker::FixExt4
                | Marker::FixExt8
                | Marker::FixExt16
                | Marker::Ext8
                | Marker::Ext16
                | Marker::Ext32 => {
                    let meta =
                        decode::read_ext_meta(&mut self.buf).map_err(|_| WireError::Truncated)?;
                    self.take(meta.size as usize)?;
                    0
                }
                Marker::Reserved => return Err(WireError::Reserved),
                scalar => {
                    let size = match scalar {
                        Marker::U8 | Marker::I8 => 1,
                        Marker::U16 | Marker::I16 => 2,
                        Marker::U32 | Marker::I32 | Marker::F32 => 4,
                        Marker::U64 | Marker::I64 | Marker::F64 => 8,
                        _ => 0,
                    };
                    self.take(1 + size)?;
                    0
                }
            };
            pending += children;
            self.check_items(pending)?;
        }
        Ok(())
    }

    /// Skips one value and returns a reader over exactly its bytes, for fields whose meaning
    /// depends on fields that may come later (map keys are unordered).
    pub(crate) fn take_value(&mut self) -> Result<Reader<'a>, WireError> {
        let start = self.buf;
        self.skip()?;
        let used = start.len() - self.buf.len();
        Ok(Reader::new(&start[..used]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The word-at-a-time path of `read_u32_seq` reads what `read_u32` reads one id at a
    /// time: every encoding an engine may use (fixint, u8, u16, u32, u64, a negative or a
    /// too-large int), at every distance from the end of the buffer.
    #[test]
    fn u32_sequences_read_as_single_ids_do() {
        let encodings: [&[u8]; 9] = [
            &[0x05],
            &[0x7f],
            &[0xcc, 0x80],
            &[0xcd, 0x12, 0x34],
            &[0xce, 0x00, 0x01, 0xe2, 0x40],
            &[0xce, 0xff, 0xff, 0xff, 0xff],
            &[0xcf, 0, 0, 0, 0, 0, 0, 0x01, 0x00],
            &[0xcf, 0, 0, 0, 1, 0, 0, 0, 0],
            &[0xff],
        ];
        for first in 0..encodings.len() {
            for len in 1..=12 {
                let ids: Vec<&[u8]> = (0..len)
                    .map(|k| encodings[(first + k * 7) % encodings.len()])
                    .collect();
                let buf: Vec<u8> = ids.concat();
                let mut one = Reader::new(&buf);
                let mut want = Vec::new();
                let mut all = true;
                for _ in 0..len {
                    match one.read_u32() {
                        Ok(Some(v)) => want.push(v),
                        _ => {
                            all = false;
                            break;
                        }
                    }
                }
                let mut seq = Reader::new(&buf);
                let mut got = Vec::new();
                assert_eq!(seq.read_u32_seq(len, &mut got), Ok(all), "{buf:x?}");
                assert_eq!(got, want, "{buf:x?}");
                if all {
                    assert_eq!(seq.remaining(), 0, "{buf:x?}");
                }
            }
        }
    }

    #[test]
    fn hostile_lengths_are_rejected_before_iteration() {
        // array32 claiming 4 billion elements, then nothing.
        let mut r = Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(r.read_array_len(), Err(WireError::LengthExceedsInput));
        let mut r = Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(r.skip(), Err(WireError::LengthExceedsInput));
        // str32 claiming 4 GiB.
        let mut r = Reader::new(&[0xdb, 0xff, 0xff, 0xff, 0xff, b'a']);
        assert_eq!(r.read_str(), Err(WireError::LengthExceedsInput));
        // map32 of huge size.
        let mut r = Reader::new(&[0xdf, 0x7f, 0xff, 0xff, 0xff, 0x00]);
        assert_eq!(r.read_map_len(), Err(WireError::LengthExceedsInput));
    }

    #[test]
    fn deep_nesting_is_skipped_without_recursion() {
        let mut buf = vec![0x91u8; 1_000_000];
        buf.push(0xc0);
        let mut r = Reader::new(&buf);
        assert_eq!(r.skip(), Ok(()));
        assert_eq!(r.remaining(), 0);
        let mut r = Reader::new(&buf[..buf.len() - 1]);
        assert!(r.skip().is_err());
    }

    #[test]
    fn ints_cover_both_ranges() {
        let mut r = Reader::new(&[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(r.read_int(), Ok(i128::from(u64::MAX)));
        let mut r = Reader::new(&[0xfe]);
        assert_eq!(r.read_int(), Ok(-2));
        let mut r = Reader::new(&[0xa1, b'x']);
        assert_eq!(r.read_int(), Err(WireError::WrongType));
    }

    #[test]
    fn take_value_returns_exact_bytes() {
        let buf = [0x92, 0x01, 0xa1, b'x', 0x05];
        let mut r = Reader::new(&buf);
        let v = r.take_value().expect("value");
        assert_eq!(v.remaining(), 4);
        assert_eq!(r.remaining(), 1);
    }

    #[test]
    fn fast_u32_matches_the_generic_path() {
        for v in [
            0u64,
            1,
            127,
            128,
            255,
            256,
            65535,
            65536,
            u64::from(u32::MAX),
            1 << 32,
        ] {
            let mut buf = Vec::new();
            rmp::encode::write_uint(&mut buf, v).expect("vec");
            let mut r = Reader::new(&buf);
            assert_eq!(r.read_u32(), Ok(u32::try_from(v).ok()), "{v}");
            assert_eq!(r.remaining(), 0);
        }
        let mut r = Reader::new(&[0xff]);
        assert_eq!(r.read_u32(), Ok(None));
        let mut r = Reader::new(&[0xcd, 0x01]);
        assert_eq!(r.read_u32(), Err(WireError::Truncated));
    }
}
