//! The plain-Rust versions: the only ones on other architectures, and the model the vector
//! versions are tested against.

// On x86-64 only the tests use it, as the model of simd.rs.
#[cfg(any(test, not(target_arch = "x86_64")))]
pub(crate) fn classify(block: &[u8; 64]) -> crate::Classes {
    let mut c = crate::Classes::default();
    for (i, &b) in block.iter().enumerate() {
        let bit = 1u64 << i;
        match b {
            b',' => c.commas |= bit,
            b'0' => c.zeros |= bit,
            b'1'..=b'9' => {}
            _ => c.others |= bit,
        }
    }
    c
}

pub(crate) fn words_to_values(words: &[u64], out: &mut Vec<u32>) {
    out.extend(words.iter().map(|&w| word_value(w)));
}

/// Three multiply-add steps fold neighbouring digits, pairs and quads, without a branch per
/// digit; in the lanes' arithmetic each step's sums stay below the lane mask.
#[inline(always)]
pub(crate) fn word_value(word: u64) -> u32 {
    let mut v = word;
    v = (v.wrapping_mul(10).wrapping_add(v >> 8)) & 0x00ff_00ff_00ff_00ff;
    v = (v.wrapping_mul(100).wrapping_add(v >> 16)) & 0x0000_ffff_0000_ffff;
    v = v.wrapping_mul(10_000).wrapping_add(v >> 32);
    v as u32
}
