//! The pickers' random source: small, seedable, owned here so determinism is an API.

/// SplitMix64: one `u64` of state, full period, good enough statistics for tie-breaks and
/// softmax sampling, and trivially reproducible from a seed.
#[derive(Debug, Clone)]
pub struct PickRng {
    state: u64,
}

impl PickRng {
    /// A generator that yields the same sequence for the same seed.
    pub const fn seeded(seed: u64) -> Self {
        Self { state: seed }
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[0, n)` (Lemire's multiply-shift; the bias is below 2⁻⁶⁴·n). `n` must be
    /// > 0; 0 yields 0.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence_and_ranges_hold() {
        let mut a = PickRng::seeded(7);
        let mut b = PickRng::seeded(7);
        for _ in 0..1000 {
            assert_eq!(a.next_u64(), b.next_u64());
            let f = a.next_f64();
            assert!((0.0..1.0).contains(&f));
            assert!(a.below(3) < 3);
            b.next_f64();
            b.below(3);
        }
    }
}
