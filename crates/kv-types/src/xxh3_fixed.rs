//! XXH3-64 with a seed for the two input sizes of prompt hashing: one 16-token window
//! (64 bytes, the default block size) and one chain link (16 bytes).
//!
//! The general `xxh3_64_with_seed` dispatches on the length and derives the seeded secret
//! words on every call. A prompt hashes hundreds of same-sized inputs with one seed, so
//! [`Xxh3Seeded`] derives the words once and each hash is four (or one) 128-bit multiplies
//! plus the final avalanche. The result is bit-for-bit XXH3 (tested against `xxhash-rust`);
//! other sizes keep using the crate.

/// XXH3's first 64-bit prime.
const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;

/// The first 64 bytes of XXH3's default secret, as little-endian words.
const SECRET: [u64; 8] = [
    0xbe4b_a423_396c_feb8,
    0x1cad_21f7_2c81_017c,
    0xdb97_9083_e96d_d4de,
    0x1f67_b3b7_a4a4_4072,
    0x78e5_c0cc_4ee6_79cb,
    0x2172_ffcc_7dd0_5a82,
    0x8e24_43f7_7446_08b8,
    0x4c26_3a81_e690_35e0,
];

#[inline(always)]
fn fold(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

#[inline(always)]
fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 37;
    h = h.wrapping_mul(0x1656_6791_9E37_79F9);
    h ^ (h >> 32)
}

/// Seeded XXH3-64 for 64-byte and 16-byte inputs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Xxh3Seeded {
    /// Secret words with the seed added (even) or subtracted (odd), as `mix16B` uses them.
    keys: [u64; 8],
    /// The two bit flips of the 9-to-16-byte path.
    flip_lo: u64,
    flip_hi: u64,
}

impl Xxh3Seeded {
    pub(crate) const fn new(seed: u64) -> Self {
        let mut keys = [0u64; 8];
        let mut i = 0;
        while i < 8 {
            keys[i] = if i % 2 == 0 {
                SECRET[i].wrapping_add(seed)
            } else {
                SECRET[i].wrapping_sub(seed)
            };
            i += 1;
        }
        Self {
            keys,
            flip_lo: (SECRET[3] ^ SECRET[4]).wrapping_add(seed),
            flip_hi: (SECRET[5] ^ SECRET[6]).wrapping_sub(seed),
        }
    }

    /// XXH3 of the 64 bytes `LE32(t_0) ‖ … ‖ LE32(t_15)`.
    #[inline]
    pub(crate) fn hash_16_tokens(&self, t: &[u32; 16]) -> u64 {
        // Little-endian word `i` of the byte string is tokens `2i` and `2i + 1`.
        let w = |i: usize| u64::from(t[2 * i]) | (u64::from(t[2 * i + 1]) << 32);
        let k = &self.keys;
        // XXH3 17-to-128 bytes at length 64: input offsets 0, 48 (len − 16), 16 and
        // 32 (len − 32) against secret offsets 0, 16, 32 and 48.
        let acc = 64u64
            .wrapping_mul(PRIME64_1)
            .wrapping_add(fold(w(0) ^ k[0], w(1) ^ k[1]))
            .wrapping_add(fold(w(6) ^ k[2], w(7) ^ k[3]))
            .wrapping_add(fold(w(2) ^ k[4], w(3) ^ k[5]))
            .wrapping_add(fold(w(4) ^ k[6], w(5) ^ k[7]));
        avalanche(acc)
    }

    /// XXH3 of the 16 bytes `LE64(a) ‖ LE64(b)`.
    #[inline]
    pub(crate) fn hash_two_words(&self, a: u64, b: u64) -> u64 {
        let lo = a ^ self.flip_lo;
        let hi = b ^ self.flip_hi;
        let acc = 16u64
            .wrapping_add(lo.swap_bytes())
            .wrapping_add(hi)
            .wrapping_add(fold(lo, hi));
        avalanche(acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use xxhash_rust::xxh3::xxh3_64_with_seed;

    fn bytes_of(tokens: &[u32]) -> Vec<u8> {
        tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
    }

    #[test]
    fn edge_seeds_and_inputs_match_the_crate() {
        for seed in [0, 1, 1337, u64::MAX, 0x8000_0000_0000_0000] {
            let h = Xxh3Seeded::new(seed);
            for fill in [0u32, 1, u32::MAX, 0xdead_beef] {
                let t = [fill; 16];
                assert_eq!(h.hash_16_tokens(&t), xxh3_64_with_seed(&bytes_of(&t), seed));
                let (a, b) = (u64::from(fill), u64::from(fill).rotate_left(17));
                let mut buf = a.to_le_bytes().to_vec();
                buf.extend(b.to_le_bytes());
                assert_eq!(h.hash_two_words(a, b), xxh3_64_with_seed(&buf, seed));
            }
        }
    }

    proptest! {
        #[test]
        fn matches_xxhash_rust(seed in any::<u64>(), t in any::<[u32; 16]>(), a in any::<u64>(), b in any::<u64>()) {
            let h = Xxh3Seeded::new(seed);
            prop_assert_eq!(h.hash_16_tokens(&t), xxh3_64_with_seed(&bytes_of(&t), seed));
            let mut buf = a.to_le_bytes().to_vec();
            buf.extend(b.to_le_bytes());
            prop_assert_eq!(h.hash_two_words(a, b), xxh3_64_with_seed(&buf, seed));
        }
    }
}
