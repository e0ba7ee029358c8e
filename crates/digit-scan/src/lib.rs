//! Token-id lists parsed 64 bytes at a time: the compact part of select-server's
//! `token_ids` arrays (JSON), and the token ids of KV events (msgpack).
//!
//! A `/select` body carries a prompt as a JSON array of a few thousand token ids, and
//! parsing it was over a third of the server's CPU per request (docs/hot-path.md). Most of
//! that array is a compact list, `12,345,6789,…`, and the steps of parsing it are
//! data-parallel: finding the commas (and anything that is not a digit) in 64 bytes at once,
//! placing each id's digits, and turning the digits of several ids into numbers at once.
//! [`compact_ids`] does that with AVX-512 when the CPU has it (simd.rs) and otherwise with
//! SSE2 masks and AVX2 conversion (list.rs), with portable code on other architectures; the
//! rest of the array's grammar (whitespace, the end, long or odd numbers) stays with the
//! caller's one-id-at-a-time loop, where this hands over. [`msgpack_uints`] does the same
//! for the msgpack ints of a `BlockStored` event's token ids, with AVX-512 (msgpack.rs) or
//! SSSE3, SSE4.1 and AVX (msgpack_sse.rs).
//!
//! It is the workspace's only crate with `unsafe`: calling an intrinsic is `unsafe` in Rust
//! even for a baseline feature, and safe wrappers exist only for features enabled at compile
//! time, which would rule out detecting AVX2 or AVX-512 at run time. The unsafe code is
//! confined to simd.rs, msgpack.rs and msgpack_sse.rs, where every block says why it is
//! sound; the tests compare every vector path with the portable one or a one-id-at-a-time
//! model.

mod list;
#[cfg(target_arch = "x86_64")]
mod msgpack;
#[cfg(target_arch = "x86_64")]
mod msgpack_sse;
mod portable;
#[cfg(target_arch = "x86_64")]
mod simd;

/// Decodes the msgpack unsigned ints at the start of `bytes` into `out`, in order, while
/// they are positive fixints, u8s, u16s or u32s (`0x00..=0x7f`, `0xcc`, `0xcd`, `0xce`), lie
/// whole within `bytes`, and `out` has room; returns the bytes and the ids it took. It takes
/// every such leading id when the CPU has AVX-512 (F, BW, VBMI; msgpack.rs) or else SSSE3,
/// SSE4.1 and AVX (msgpack_sse.rs), and none otherwise: the caller's one-id-at-a-time loop
/// goes on from where this stops, and is the one that decodes any other marker (a signed
/// int, a u64) or reports a truncated array.
/// The slots of `out` past the ids taken may have been written.
pub fn msgpack_uints(bytes: &[u8], out: &mut [u32]) -> (usize, usize) {
    #[cfg(target_arch = "x86_64")]
    if let Some(taken) =
        msgpack::msgpack_uints(bytes, out).or_else(|| msgpack_sse::msgpack_uints(bytes, out))
    {
        return taken;
    }
    let _ = (bytes, out);
    (0, 0)
}

/// Takes the ids of a compact decimal list from `body[start]` (an id's first byte, or
/// whatever stands there) on, while whole 64-byte blocks of it remain, and appends their
/// values to `out`; returns the index of the first id it did not take, where the caller's
/// one-id-at-a-time loop continues.
///
/// What it takes follows JSON's grammar for an array of non-negative integers without
/// whitespace: a block is taken only if it holds nothing but digits and commas, no comma
/// starts an id (`,,`, or a comma first) and no `0` starts an id of two or more digits, and
/// only ids of 1 to 7 digits are taken (longer ones are the caller's). So every byte taken
/// was checked against the same `digits,digits,…,` rule the caller's loop applies, and
/// whatever this stops at, that loop parses or rejects from the returned index on. Where it
/// stops within a run of valid ids (the id before a long one, or that block's first id) is
/// up to the implementation.
pub fn compact_ids(body: &[u8], start: usize, out: &mut Vec<u32>) -> usize {
    #[cfg(target_arch = "x86_64")]
    if let Some(resume) = simd::compact_ids(body, start, out) {
        return resume;
    }
    list::compact_ids(body, start, out)
}

/// Whether a block of digits and commas (masks of its `commas` and `zeros`) holds no empty
/// id and no leading zero. `after_comma` (bit 0) says whether the block's first byte starts
/// an id; `next` is the byte after the block, which says whether a `0` in its last byte is
/// an id's first digit of several.
#[inline(always)]
pub(crate) fn ids_well_formed(
    commas: u64,
    zeros: u64,
    after_comma: u64,
    next: Option<&u8>,
) -> bool {
    let starts = (commas << 1) | after_comma;
    let next_is_digit = next.is_some_and(u8::is_ascii_digit);
    let digit_follows = (!commas >> 1) | (u64::from(next_is_digit) << 63);
    commas & starts == 0 && zeros & starts & digit_follows == 0
}

/// What each byte of a 64-byte block is: bit `i` of a mask describes byte `i`.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub(crate) struct Classes {
    /// `,`
    pub(crate) commas: u64,
    /// `0`, which JSON forbids as the first digit of a longer number.
    pub(crate) zeros: u64,
    /// Neither an ASCII digit nor a comma.
    pub(crate) others: u64,
}

/// Classifies the 64 bytes of `block`.
#[inline]
pub(crate) fn classify(block: &[u8; 64]) -> Classes {
    #[cfg(target_arch = "x86_64")]
    {
        simd::classify(block)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        portable::classify(block)
    }
}

/// Appends the value of each digit word of `words` (see [`word_value`]) to `out`, in order.
#[inline]
pub(crate) fn words_to_values(words: &[u64], out: &mut Vec<u32>) {
    #[cfg(target_arch = "x86_64")]
    {
        simd::words_to_values(words, out);
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        portable::words_to_values(words, out);
    }
}

/// The value of one digit word.
///
/// A digit word holds a number of up to 8 decimal digits as the values 0..=9 (the ASCII
/// digit minus `'0'`), one per byte of the little-endian `u64`: the last digit in byte 7,
/// the others below it, and zero in the bytes below the first digit. The 8 bytes that end
/// at a number's last digit, XORed with `0x30` in every byte and masked to the number's
/// length, are its digit word. Other words give unspecified values (but never a panic).
#[inline]
pub fn word_value(word: u64) -> u32 {
    portable::word_value(word)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The digit word of `n` (< 10^8) as [`word_value`] describes it.
    fn word_of(n: u32) -> u64 {
        let text = n.to_string();
        let mut bytes = [0u8; 8];
        for (slot, d) in bytes[8 - text.len()..].iter_mut().zip(text.bytes()) {
            *slot = d - b'0';
        }
        u64::from_le_bytes(bytes)
    }

    #[test]
    fn every_length_converts() {
        let numbers: Vec<u32> = (0..8)
            .flat_map(|len| {
                [
                    10u32.pow(len),
                    10u32.pow(len) * 2 - 1,
                    10u32.pow(len + 1) - 1,
                ]
            })
            .chain([0, 7, 128_000, 12_345_678])
            .collect();
        let words: Vec<u64> = numbers.iter().map(|&n| word_of(n)).collect();
        // Every count, so the vector path's remainder is exercised too.
        for count in 0..=words.len() {
            let mut out = vec![42];
            words_to_values(&words[..count], &mut out);
            assert_eq!(out[0], 42);
            assert_eq!(out[1..], numbers[..count], "{count} words");
        }
        for &n in &numbers {
            assert_eq!(word_value(word_of(n)), n);
        }
    }

    /// The complete ids of a compact list from `start` on, one at a time: their values, and
    /// where each starts plus where the first incomplete or invalid one starts.
    fn model(body: &[u8], start: usize) -> (Vec<u32>, Vec<usize>) {
        let (mut values, mut starts) = (Vec::new(), vec![start]);
        let mut at = start;
        loop {
            let digits = body[at.min(body.len())..]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .count();
            let text = &body[at..at + digits];
            let valid = (1..=10).contains(&digits) && !(digits > 1 && text[0] == b'0');
            let value = std::str::from_utf8(text)
                .ok()
                .and_then(|t| t.parse::<u32>().ok());
            match (valid, value, body.get(at + digits)) {
                (true, Some(value), Some(b',')) => {
                    values.push(value);
                    at += digits + 1;
                    starts.push(at);
                }
                _ => return (values, starts),
            }
        }
    }

    /// What a scan took is a prefix of the model's ids, and it resumes where the next starts.
    fn check_scan(
        name: &str,
        scan: fn(&[u8], usize, &mut Vec<u32>) -> usize,
        body: &[u8],
        start: usize,
    ) -> Result<usize, TestCaseError> {
        let (values, starts) = model(body, start);
        let mut out = vec![7];
        let resume = scan(body, start, &mut out);
        let taken = out.len() - 1;
        prop_assert_eq!(out[0], 7, "{}: the output's existing values stay", name);
        prop_assert!(
            taken <= values.len(),
            "{}: took {} of {}",
            name,
            taken,
            values.len()
        );
        prop_assert_eq!(&out[1..], &values[..taken], "{}", name);
        prop_assert_eq!(resume, starts[taken], "{}: resumes at the next id", name);
        Ok(taken)
    }

    /// Both scans (the AVX-512 one where the CPU has it) against the model; on a list of
    /// short valid ids both take the same.
    fn check_both_scans(body: &[u8], start: usize, clean: bool) -> Result<(), TestCaseError> {
        let by_words = check_scan("list.rs", list::compact_ids, body, start)?;
        #[cfg(target_arch = "x86_64")]
        {
            let avx512 = |body: &[u8], start, out: &mut Vec<u32>| {
                simd::compact_ids(body, start, out).unwrap_or(start)
            };
            if simd::compact_ids(b"", 0, &mut Vec::new()).is_some() {
                let by_blocks = check_scan("AVX-512", avx512, body, start)?;
                if clean {
                    prop_assert_eq!(by_blocks, by_words);
                }
            }
        }
        Ok(())
    }

    /// A compact list of `ids` after a short prefix, the index of its first id, and the body.
    fn list_body(ids: &[u32], tail: &str) -> (Vec<u8>, usize) {
        let list = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let body = format!(r#"{{"token_ids":[{list}{tail}"#).into_bytes();
        (body, 14)
    }

    #[test]
    fn the_scans_take_whole_blocks_of_a_clean_list() {
        let ids: Vec<u32> = (0..2_000u32).map(|k| k * 7_919 % 9_999_999).collect();
        let (body, start) = list_body(&ids, "]}");
        let mut out = Vec::new();
        let resume = compact_ids(&body, start, &mut out);
        // All but the last block's worth; the caller's loop does the rest.
        assert!(out.len() > ids.len() - 20, "{} of {}", out.len(), ids.len());
        assert_eq!(out, ids[..out.len()]);
        assert!(check_both_scans(&body, start, true).is_ok());
        assert!(resume < body.len());
    }

    #[test]
    fn the_scans_stop_at_every_kind_of_damage_at_every_byte() {
        let ids: Vec<u32> = (0..300u32).map(|k| k * 7_919 % 1_500_000).collect();
        let (clean, start) = list_body(&ids, "]}");
        for at in start..clean.len() {
            for byte in *b"0,] x-9\0" {
                let mut body = clean.clone();
                body[at] = byte;
                if let Err(e) = check_both_scans(&body, start, false) {
                    panic!("byte {byte:?} at {at}: {e}");
                }
            }
        }
    }

    proptest! {
        #[test]
        fn the_scans_agree_with_the_model_on_lists(
            ids in prop::collection::vec(
                prop_oneof![0u32..10, 0u32..1_000, 0u32..200_000, 0u32..10_000_000, any::<u32>()],
                0..600,
            ),
            offset in 8usize..80,
        ) {
            let list = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
            let body = format!("{}{list},", " ".repeat(offset)).into_bytes();
            let short = ids.iter().all(|&id| id < 10_000_000);
            check_both_scans(&body, offset, short)?;
        }

        #[test]
        fn the_scans_agree_with_the_model_on_arbitrary_bytes(
            body in prop::collection::vec(
                prop_oneof![
                    12 => prop::sample::select(b"123456789".to_vec()),
                    3 => Just(b','),
                    1 => Just(b'0'),
                    1 => any::<u8>(),
                ],
                0..1_500,
            ),
            start in 0usize..40,
        ) {
            check_both_scans(&body, start.min(body.len()), false)?;
        }

        #[test]
        fn classify_agrees_with_the_portable_code(
            bytes in prop::collection::vec(
                prop_oneof![
                    4 => prop::sample::select(b"0123456789,".to_vec()),
                    1 => any::<u8>(),
                ],
                64,
            )
        ) {
            let block: [u8; 64] = bytes.try_into().map_err(|_| TestCaseError::fail("64"))?;
            prop_assert_eq!(classify(&block), portable::classify(&block));
        }

        #[test]
        fn conversion_agrees_with_the_portable_code(
            numbers in prop::collection::vec(0u32..100_000_000, 0..40),
        ) {
            let words: Vec<u64> = numbers.iter().map(|&n| word_of(n)).collect();
            let (mut fast, mut slow) = (Vec::new(), Vec::new());
            words_to_values(&words, &mut fast);
            portable::words_to_values(&words, &mut slow);
            prop_assert_eq!(&slow, &numbers);
            prop_assert_eq!(fast, slow);
        }
    }
}
