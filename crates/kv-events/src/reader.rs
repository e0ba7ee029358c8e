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

/// [`UINT_EXTRA_BYTES`] of a marker that is not a fixint, u8, u16 or u32.
const NOT_FAST: u8 = u8::MAX;

/// Bytes after the marker of the unsigned ints below 2^32 (0 for a positive fixint, 1, 2
/// and 4 for u8, u16 and u32), [`NOT_FAST`] for every other marker: one load instead of
/// a chain of compares on the path from one id's position to the next.
const UINT_EXTRA_BYTES: [u8; 256] = {
    let mut t = [NOT_FAST; 256];
    let mut m = 0;
    while m < 0x80 {
        t[m] = 0;
        m += 1;
    }
    t[0xcc] = 1;
    t[0xcd] = 2;
    t[0xce] = 4;
    t
};

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
        // Engine block hashes are 64-bit ints, one per block: their two encodings are read
        // straight from the slice rather than through `rmp`'s generic reader.
        match *self.buf {
            [0xcf, b0, b1, b2, b3, b4, b5, b6, b7, ref rest @ ..] => {
                self.buf = rest;
                return Ok(i128::from(u64::from_be_bytes([
                    b0, b1, b2, b3, b4, b5, b6, b7,
                ])));
            }
            [0xd3, b0, b1, b2, b3, b4, b5, b6, b7, ref rest @ ..] => {
                self.buf = rest;
                return Ok(i128::from(i64::from_be_bytes([
                    b0, b1, b2, b3, b4, b5, b6, b7,
                ])));
            }
            _ => {}
        }
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

    /// Reads `n` ints into `out` (token ids: most of a store's bytes), exactly as `n` calls
    /// of [`Self::read_u32`] would. `Ok(false)` when one of them is an int outside `u32`;
    /// the reader is then left mid-array and `out` holds the ids before it.
    pub(crate) fn read_u32_seq(&mut self, n: usize, out: &mut Vec<u32>) -> Result<bool, WireError> {
        let start = out.len();
        // `n` is at most the bytes left (`read_array_len`), so this is bounded by the input.
        out.resize(start + n, 0);
        let mut filled = 0;
        let res = self.read_u32_into(&mut out[start..], &mut filled);
        out.truncate(start + filled);
        res
    }

    /// Fills `dst` with the next `dst.len()` ints, counting the ids written in `filled`.
    /// `Ok(false)` when one of them is an int outside `u32`.
    fn read_u32_into(&mut self, dst: &mut [u32], filled: &mut usize) -> Result<bool, WireError> {
        // The vector decoder takes the leading ids of the four common forms (all of them in
        // what engines send) where the CPU has AVX-512; the loops below take the rest.
        let (mut pos, taken) = digit_scan::msgpack_uints(self.buf, dst);
        *filled += taken;
        let buf = self.buf;
        let mut slots = dst[taken..].iter_mut();
        // While 8 bytes remain, one load serves every common encoding: token ids mix
        // fixint, u16 and u32 in no predictable order (a 128 k vocabulary is half u16,
        // half u32), so the marker is turned into a length and a shift through a table,
        // not a branch per id that mispredicts every other id. Only an uncommon marker
        // leaves this loop's straight line, for one id.
        while let Some(&word) = buf.get(pos..).and_then(<[u8]>::first_chunk::<8>) {
            let Some(slot) = slots.next() else {
                self.buf = &buf[pos..];
                return Ok(true);
            };
            let extra = UINT_EXTRA_BYTES[usize::from(word[0])];
            if extra != NOT_FAST {
                // The value is the `extra` bytes after the marker (the marker itself for a
                // fixint) at the top of the big-endian word, shifted down and masked to
                // their width.
                let extra = usize::from(extra);
                let x = u64::from_be_bytes(word);
                let mask = u32::MAX >> ((32 - 8 * extra) & 31);
                *slot = (x >> (56 - 8 * extra)) as u32 & mask;
                pos += 1 + extra;
            } else {
                self.buf = &buf[pos..];
                let one = self.read_u32();
                pos = buf.len() - self.buf.len();
                match one? {
                    Some(v) => *slot = v,
                    None => return Ok(false),
                }
            }
            *filled += 1;
        }
        self.buf = &buf[pos..];
        for slot in slots {
            match self.read_u32()? {
                Some(v) => *slot = v,
                None => return Ok(false),
            }
            *filled += 1;
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

    /// What `n` calls of `read_u32` give (the behaviour `read_u32_seq` keeps): the ids
    /// read, the result, and the bytes left after a complete read.
    fn one_by_one(buf: &[u8], n: usize) -> (Vec<u32>, Result<bool, WireError>, Option<usize>) {
        let mut r = Reader::new(buf);
        let mut ids = Vec::new();
        for _ in 0..n {
            match r.read_u32() {
                Ok(Some(v)) => ids.push(v),
                Ok(None) => return (ids, Ok(false), None),
                Err(e) => return (ids, Err(e), None),
            }
        }
        (ids, Ok(true), Some(r.remaining()))
    }

    /// `read_u32_seq` over `buf` agrees with `n` calls of `read_u32`, whatever follows the
    /// ids (so both the word-at-a-time loop and the tail are exercised).
    fn check_seq(buf: &[u8], n: usize) {
        let (want, want_res, want_left) = one_by_one(buf, n);
        let mut r = Reader::new(buf);
        let mut got = vec![7];
        let res = r.read_u32_seq(n, &mut got);
        assert_eq!(res, want_res, "{buf:x?}");
        assert_eq!(got[0], 7, "appends to what `out` held");
        assert_eq!(&got[1..], &want[..], "{buf:x?}");
        if let Some(left) = want_left {
            assert_eq!(r.remaining(), left, "{buf:x?}");
        }
    }

    /// Every encoding an engine may use for a token id, with the boundary values of each
    /// width, and the ones `read_u32` turns away (negative, too large, not an int).
    const ENCODINGS: [&[u8]; 24] = [
        &[0x00],
        &[0x05],
        &[0x7f],
        &[0xcc, 0x00],
        &[0xcc, 0x80],
        &[0xcc, 0xff],
        &[0xcd, 0x01, 0x00],
        &[0xcd, 0x12, 0x34],
        &[0xcd, 0xff, 0xff],
        &[0xce, 0x00, 0x01, 0x00, 0x00],
        &[0xce, 0x00, 0x01, 0xe2, 0x40],
        &[0xce, 0xff, 0xff, 0xff, 0xff],
        // Wider or signed encodings of values that fit: accepted, through `read_int`.
        &[0xcf, 0, 0, 0, 0, 0, 0, 0x01, 0x00],
        &[0xd0, 0x05],
        &[0xd1, 0x7f, 0xff],
        &[0xd2, 0x7f, 0xff, 0xff, 0xff],
        &[0xd3, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff],
        // Ints outside u32: `Ok(false)`.
        &[0xcf, 0, 0, 0, 1, 0, 0, 0, 0],
        &[0xff],
        &[0xe0],
        &[0xd0, 0x80],
        // Not ints: `WrongType`.
        &[0xc0],
        &[0xa1, b'x'],
        &[0xca, 0, 0, 0, 0],
    ];

    #[test]
    fn u32_sequences_read_as_single_ids_do() {
        for first in 0..ENCODINGS.len() {
            for len in 1..=12 {
                let ids: Vec<&[u8]> = (0..len)
                    .map(|k| ENCODINGS[(first + k * 7) % ENCODINGS.len()])
                    .collect();
                let buf: Vec<u8> = ids.concat();
                check_seq(&buf, len);
                // Fewer ids asked than given: the reader stops after them.
                check_seq(&buf, len - 1);
                // One more asked than given: truncated.
                check_seq(&buf, len + 1);
            }
        }
    }

    /// Every marker byte, through the marker table and the single-id fallback, reads as
    /// `read_u32` reads it, with enough bytes after it for the word-at-a-time loop.
    #[test]
    fn every_marker_byte_reads_as_a_single_id_does() {
        for m in 0..=u8::MAX {
            let mut buf = vec![m, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x12];
            buf.extend_from_slice(&[0xcd, 0x12, 0x34].repeat(4));
            for n in 1..=3 {
                check_seq(&buf, n);
            }
            buf[1..9].copy_from_slice(&[0x9a, 0xbc, 0xde, 0xf0, 0x12, 0x34, 0x56, 0x78]);
            for n in 1..=3 {
                check_seq(&buf, n);
            }
        }
    }

    #[test]
    fn u32_sequence_boundaries_and_markers() {
        let values = [
            0u64,
            1,
            127,
            128,
            255,
            256,
            65_535,
            65_536,
            u64::from(u32::MAX),
        ];
        for &v in &values {
            let mut one = Vec::new();
            rmp::encode::write_uint(&mut one, v).expect("vec");
            // Long runs of one marker (the word-at-a-time loop) and a run that ends in
            // the tail, each value read back exactly.
            for run in [1, 7, 8, 9, 40] {
                let buf = one.repeat(run);
                let mut r = Reader::new(&buf);
                let mut got = Vec::new();
                assert_eq!(r.read_u32_seq(run, &mut got), Ok(true), "{v}");
                assert_eq!(got, vec![u32::try_from(v).expect("fits"); run], "{v}");
                assert_eq!(r.remaining(), 0);
            }
        }
        // All markers mixed, with bytes after the ids.
        let mut buf = Vec::new();
        for &v in values.iter().chain(values.iter().rev()) {
            rmp::encode::write_uint(&mut buf, v).expect("vec");
        }
        buf.extend_from_slice(&[0xc0; 9]);
        check_seq(&buf, 2 * values.len());
        let mut r = Reader::new(&buf);
        let mut got = Vec::new();
        assert_eq!(r.read_u32_seq(2 * values.len(), &mut got), Ok(true));
        assert_eq!(r.remaining(), 9);
    }

    #[test]
    fn u32_sequence_rejections_are_those_of_single_ids() {
        let ids = |n: usize| -> Vec<u8> { [0xcd, 0x12, 0x34].repeat(n) };
        for before in [0, 3, 8] {
            let cases: [(&[u8], Result<bool, WireError>); 7] = [
                (&[0xff], Ok(false)),
                (&[0xd0, 0x80], Ok(false)),
                (&[0xcf, 0, 0, 0, 1, 0, 0, 0, 0], Ok(false)),
                (&[0xc0], Err(WireError::WrongType)),
                (&[0xa1, b'x'], Err(WireError::WrongType)),
                (&[0xcd, 0x01], Err(WireError::Truncated)),
                (&[0xce, 0x01, 0x02, 0x03], Err(WireError::Truncated)),
            ];
            for (bad, want) in cases {
                let mut buf = ids(before);
                buf.extend_from_slice(bad);
                buf.extend_from_slice(&ids(3)[..usize::from(want.is_ok()) * 9]);
                let mut r = Reader::new(&buf);
                let mut got = Vec::new();
                assert_eq!(r.read_u32_seq(before + 4, &mut got), want, "{buf:x?}");
                assert_eq!(got, vec![0x1234; before], "{buf:x?}");
                check_seq(&buf, before + 4);
            }
        }
        // The reserved marker is not an int: a type error, as for a single id.
        check_seq(&[0x01, 0xc1, 0, 0, 0, 0, 0, 0, 0], 2);
        let mut r = Reader::new(&[0x01, 0xc1, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            r.read_u32_seq(2, &mut Vec::new()),
            Err(WireError::WrongType)
        );
    }

    proptest::proptest! {
        /// The sequence reader against `n` single reads, over id sequences in every
        /// encoding (a few malformed ones among them) followed by arbitrary bytes.
        #[test]
        fn u32_sequences_match_single_reads(
            ids in proptest::collection::vec(
                (proptest::prelude::any::<u32>(), 0u8..8, proptest::prelude::any::<u8>()),
                0..64,
            ),
            tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..12),
            extra in 0usize..3,
        ) {
            let mut buf = Vec::new();
            for &(v, how, byte) in &ids {
                match how {
                    // The smallest encoding, as engines write it, most of the time.
                    0..=3 => {
                        rmp::encode::write_uint(&mut buf, u64::from(v)).expect("vec");
                    }
                    4 => {
                        rmp::encode::write_uint(&mut buf, u64::from(v % 256)).expect("vec");
                    }
                    5 => {
                        rmp::encode::write_sint(&mut buf, i64::from(v) - (1 << 31)).expect("vec");
                    }
                    6 => rmp::encode::write_u64(&mut buf, u64::from(v) << (v % 33)).expect("vec"),
                    _ => buf.push(byte),
                }
            }
            buf.extend_from_slice(&tail);
            for n in [ids.len(), ids.len() + extra] {
                let (want, want_res, want_left) = one_by_one(&buf, n);
                let mut r = Reader::new(&buf);
                let mut got = Vec::new();
                proptest::prop_assert_eq!(r.read_u32_seq(n, &mut got), want_res);
                proptest::prop_assert_eq!(&got, &want);
                if let Some(left) = want_left {
                    proptest::prop_assert_eq!(r.remaining(), left);
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
        // The 64-bit encodings in full, with bytes after them, and cut short.
        for v in [0, 1, i64::MAX, -1, i64::MIN, 0x0123_4567_89ab_cdef] {
            let mut buf = Vec::new();
            rmp::encode::write_i64(&mut buf, v).expect("vec");
            buf.push(0xc0);
            let mut r = Reader::new(&buf);
            assert_eq!(r.read_int(), Ok(i128::from(v)), "{v}");
            assert_eq!(r.remaining(), 1);
            let mut r = Reader::new(&buf[..8]);
            assert_eq!(r.read_int(), Err(WireError::Truncated), "{v}");
            let mut buf = Vec::new();
            rmp::encode::write_u64(&mut buf, v as u64).expect("vec");
            let mut r = Reader::new(&buf);
            assert_eq!(r.read_int(), Ok(i128::from(v as u64)), "{v}");
            assert_eq!(r.remaining(), 0);
            let mut r = Reader::new(&buf[..5]);
            assert_eq!(r.read_int(), Err(WireError::Truncated), "{v}");
        }
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
