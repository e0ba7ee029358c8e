//! Byte classification and digit conversion for select-server's `token_ids` parser.
//!
//! A `/select` body carries a prompt as a JSON array of a few thousand token ids, and
//! parsing it was over a third of the server's CPU per request (docs/hot-path.md). Two
//! steps of that parse are data-parallel and gain from vector instructions: finding the
//! commas (and anything that is not a digit) in 64 bytes at once, and turning the digits of
//! several ids into numbers at once. This crate does those two steps, with SSE2 (baseline on
//! x86-64) and AVX2 (when the CPU has it) where available and portable code elsewhere; the
//! grammar, validation and bookkeeping stay in safe code in select-server.
//!
//! It is the workspace's only crate with `unsafe`: calling an intrinsic is `unsafe` in Rust
//! even for a baseline feature, and safe wrappers exist only for features enabled at compile
//! time, which would rule out detecting AVX2 at run time. The unsafe code is confined to
//! simd.rs, where every block says why it is sound; the tests compare every vector path
//! with the portable one.

mod portable;
#[cfg(target_arch = "x86_64")]
mod simd;

/// What each byte of a 64-byte block is: bit `i` of a mask describes byte `i`.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Classes {
    /// `,`
    pub commas: u64,
    /// `0`, which JSON forbids as the first digit of a longer number.
    pub zeros: u64,
    /// Neither an ASCII digit nor a comma.
    pub others: u64,
}

/// Classifies the 64 bytes of `block`.
#[inline]
pub fn classify(block: &[u8; 64]) -> Classes {
    #[cfg(target_arch = "x86_64")]
    {
        simd::classify(block)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        portable::classify(block)
    }
}

/// Appends the value of each digit word of `words` to `out`, in order.
///
/// A digit word holds a number of up to 8 decimal digits as the values 0..=9 (the ASCII
/// digit minus `'0'`), one per byte of the little-endian `u64`: the last digit in byte 7,
/// the others below it, and zero in the bytes below the first digit. The 8 bytes that end
/// at a number's last digit, XORed with `0x30` in every byte and masked to the number's
/// length, are its digit word. Other words give unspecified values (but never a panic).
#[inline]
pub fn words_to_values(words: &[u64], out: &mut Vec<u32>) {
    #[cfg(target_arch = "x86_64")]
    {
        simd::words_to_values(words, out);
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        portable::words_to_values(words, out);
    }
}

/// The value of one digit word (see [`words_to_values`]).
#[inline]
pub fn word_value(word: u64) -> u32 {
    portable::word_value(word)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The digit word of `n` (< 10^8) as [`words_to_values`] describes it.
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

    proptest! {
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
