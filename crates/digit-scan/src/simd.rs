//! The x86-64 versions: SSE2 (part of x86-64 itself) for classifying, AVX2 when the CPU has
//! it for converting.
//!
//! Every `unsafe` here is one of two kinds: calling an intrinsic of a feature the CPU is
//! known to have (SSE2 always on x86-64, AVX2 after `is_x86_feature_detected!`), or an
//! unaligned load or store through a pointer derived from a reference to exactly as many
//! bytes as it reads or writes.
#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m128i, __m256i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_min_epu8, _mm_movemask_epi8,
    _mm_set1_epi8, _mm_storeu_si128, _mm_sub_epi8, _mm256_add_epi64, _mm256_castsi256_si128,
    _mm256_loadu_si256, _mm256_madd_epi16, _mm256_maddubs_epi16, _mm256_mul_epu32,
    _mm256_permutevar8x32_epi32, _mm256_set_epi32, _mm256_set1_epi16, _mm256_set1_epi32,
    _mm256_set1_epi64x, _mm256_srli_epi64,
};

use crate::Classes;

#[inline]
pub(crate) fn classify(block: &[u8; 64]) -> Classes {
    let mut commas = 0u64;
    let mut zeros = 0u64;
    let mut digits = 0u64;
    for (k, chunk) in block.as_chunks::<16>().0.iter().enumerate() {
        let (c, z, d) = classify16(chunk);
        commas |= u64::from(c) << (16 * k);
        zeros |= u64::from(z) << (16 * k);
        digits |= u64::from(d) << (16 * k);
    }
    Classes {
        commas,
        zeros,
        others: !(commas | digits),
    }
}

/// (commas, zeros, digits) of 16 bytes.
#[inline(always)]
fn classify16(chunk: &[u8; 16]) -> (u16, u16, u16) {
    // SAFETY: SSE2 is part of x86-64, so every SSE2 intrinsic is available; the load reads
    // the 16 bytes `chunk` refers to (`loadu` has no alignment requirement).
    unsafe {
        let v = _mm_loadu_si128(chunk.as_ptr().cast::<__m128i>());
        // Digits are the bytes whose distance above '0' (wrapping) is at most 9.
        let above_zero = _mm_sub_epi8(v, _mm_set1_epi8(b'0' as i8));
        let digit = _mm_cmpeq_epi8(_mm_min_epu8(above_zero, _mm_set1_epi8(9)), above_zero);
        let comma = _mm_cmpeq_epi8(v, _mm_set1_epi8(b',' as i8));
        let zero = _mm_cmpeq_epi8(v, _mm_set1_epi8(b'0' as i8));
        // `movemask` gives one bit per byte in the low 16 bits.
        (
            _mm_movemask_epi8(comma) as u16,
            _mm_movemask_epi8(zero) as u16,
            _mm_movemask_epi8(digit) as u16,
        )
    }
}

#[inline]
pub(crate) fn words_to_values(words: &[u64], out: &mut Vec<u32>) {
    let (quads, rest) = words.as_chunks::<4>();
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        unsafe { quads_values(quads, out) };
    } else {
        crate::portable::words_to_values(quads.as_flattened(), out);
    }
    crate::portable::words_to_values(rest, out);
}

/// Appends the values of the digit words in `quads`, four at a time: the portable code's
/// three multiply-add steps, each as one instruction over four words.
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
unsafe fn quads_values(quads: &[[u64; 4]], out: &mut Vec<u32>) {
    out.reserve(quads.len() * 4);
    let filled = out.len();
    // Written straight into the reserved space: a bounds and capacity check per four values
    // cost more than the conversion.
    let spare = &mut out.spare_capacity_mut()[..quads.len() * 4];
    for (quad, four) in quads.iter().zip(spare.as_chunks_mut::<4>().0) {
        // SAFETY: the load reads the 32 bytes `quad` refers to; `loadu` has no alignment
        // requirement.
        let v = unsafe { _mm256_loadu_si256(quad.as_ptr().cast::<__m256i>()) };
        // Byte pairs (a, b) → 10a + b in 16 bits: `maddubs` multiplies unsigned bytes by
        // signed ones and adds neighbours; the weights are 10 (even bytes) and 1 (odd).
        let pairs = _mm256_maddubs_epi16(v, _mm256_set1_epi16(0x010a));
        // 16-bit pairs (a, b) → 100a + b in 32 bits.
        let fours = _mm256_madd_epi16(pairs, _mm256_set1_epi32(0x0001_0064));
        // 32-bit halves (a, b) of each word → 10,000a + b in 64 bits.
        let high = _mm256_mul_epu32(fours, _mm256_set1_epi64x(10_000));
        let values = _mm256_add_epi64(high, _mm256_srli_epi64(fours, 32));
        // The low 32 bits of each 64-bit lane, gathered into the low 128 bits.
        let packed = _mm256_permutevar8x32_epi32(values, _mm256_set_epi32(0, 0, 0, 0, 6, 4, 2, 0));
        // SAFETY: the store writes the 16 bytes of `four`, four reserved `u32` slots;
        // `storeu` has no alignment requirement.
        unsafe {
            _mm_storeu_si128(
                four.as_mut_ptr().cast::<__m128i>(),
                _mm256_castsi256_si128(packed),
            );
        }
    }
    // SAFETY: the loop above initialized the `quads.len() * 4` slots after `filled` (the
    // zip runs over exactly that many), and `reserve` made room for them.
    unsafe { out.set_len(filled + quads.len() * 4) };
}
