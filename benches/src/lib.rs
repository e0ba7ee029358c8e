//! Criterion benchmarks of kv-select's hot paths (`cargo bench -p benches`).
//!
//! The library part only holds deterministic input generators shared by the bench targets,
//! so every bench measures the same inputs run after run.

/// Deterministic pseudo-random token ids (xorshift), `n` of them, from `seed`.
pub fn tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 150_000) as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn tokens_are_deterministic() {
        assert_eq!(super::tokens(8, 3), super::tokens(8, 3));
        assert_ne!(super::tokens(8, 3), super::tokens(8, 4));
    }
}
