//! The x86-64 versions: the whole compact-list scan with AVX-512 when the CPU has it;
//! otherwise SSE2 (part of x86-64 itself) for classifying and AVX2, when the CPU has it, for
//! converting.
//!
//! Every `unsafe` here is one of three kinds: calling an intrinsic of a feature the CPU is
//! known to have (SSE2 always on x86-64, AVX2 and AVX-512 after `is_x86_feature_detected!`),
//! an unaligned load or store through a pointer derived from a reference to at least as many
//! bytes as it reads or writes, or setting a `Vec`'s length over slots just written.
#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m128i, __m256i, __m512i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_min_epu8, _mm_movemask_epi8,
    _mm_set1_epi8, _mm_storeu_si128, _mm_sub_epi8, _mm256_add_epi64, _mm256_castsi256_si128,
    _mm256_loadu_si256, _mm256_madd_epi16, _mm256_maddubs_epi16, _mm256_mul_epu32,
    _mm256_permutevar8x32_epi32, _mm256_set_epi32, _mm256_set1_epi16, _mm256_set1_epi32,
    _mm256_set1_epi64x, _mm256_srli_epi64, _mm256_storeu_si256, _mm512_add_epi8, _mm512_add_epi64,
    _mm512_cmpeq_epi8_mask, _mm512_cmpge_epu8_mask, _mm512_cmple_epu8_mask, _mm512_cvtepi64_epi32,
    _mm512_loadu_si512, _mm512_madd_epi16, _mm512_maddubs_epi16, _mm512_mask_cmpgt_epu8_mask,
    _mm512_mask_permutexvar_epi8, _mm512_maskz_compress_epi8, _mm512_maskz_sub_epi8,
    _mm512_mul_epu32, _mm512_permutex2var_epi8, _mm512_permutex2var_epi32, _mm512_permutexvar_epi8,
    _mm512_set_epi64, _mm512_set1_epi8, _mm512_set1_epi16, _mm512_set1_epi32, _mm512_set1_epi64,
    _mm512_srli_epi64, _mm512_storeu_si512, _mm512_sub_epi8,
};

use crate::Classes;
use crate::ids_well_formed;

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

/// [`crate::compact_ids`] with AVX-512 (F, BW, VBMI and VBMI2), or `None` when the CPU lacks
/// it.
#[inline]
pub(crate) fn compact_ids(body: &[u8], start: usize, out: &mut Vec<u32>) -> Option<usize> {
    let avx512 = std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vbmi")
        && std::arch::is_x86_feature_detected!("avx512vbmi2");
    // SAFETY: the CPU has the four features (checked just above).
    avx512.then(|| unsafe { compact_ids_avx512(body, start, out) })
}

/// Byte `i` is `i + add` (wrapping).
pub(crate) const fn lanes(add: u8) -> [u8; 64] {
    let mut lanes = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        lanes[i] = (i as u8).wrapping_add(add);
        i += 1;
    }
    lanes
}

/// Byte `i` is `i / width + add`: the `width` bytes of lane `k` pick element `k + add`.
pub(crate) const fn spread(width: usize, add: u8) -> [u8; 64] {
    let mut lanes = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        lanes[i] = (i / width) as u8 + add;
        i += 1;
    }
    lanes
}

/// A window position per block byte: byte `i` of a block is byte `i + 8` of its window.
static WINDOW_POSITIONS: [u8; 64] = lanes(8);
/// Each byte takes its predecessor's element (byte 0 is overwritten).
static PREVIOUS: [u8; 64] = lanes(u8::MAX);
/// The ids of a group of eight: elements 0–7 and 8–15, one per 64-bit lane.
static FIRST_EIGHT: [u8; 64] = spread(8, 0);
static SECOND_EIGHT: [u8; 64] = spread(8, 8);
/// Byte `b` of each 64-bit lane: `b − 8`, so an id's comma position plus this is the position
/// of byte `b` of the 8 bytes that end at the comma.
static BEFORE_COMMA: [u8; 64] = {
    let mut lanes = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        lanes[i] = ((i % 8) as u8).wrapping_sub(8);
        i += 1;
    }
    lanes
};
/// The 32-bit indices 0, 2, …, 30 (little-endian): the even 32-bit elements of two vectors,
/// the low halves of their 64-bit lanes.
static EVEN_HALVES: [u8; 64] = {
    let mut lanes = [0u8; 64];
    let mut k = 0;
    while k < 16 {
        lanes[4 * k] = 2 * k as u8;
        k += 1;
    }
    lanes
};

/// A 64-byte constant as a vector.
#[inline(always)]
pub(crate) fn constant(table: &'static [u8; 64]) -> __m512i {
    // SAFETY: the load reads the 64 bytes of `table`; `loadu` has no alignment requirement,
    // and `_mm512_loadu_si512` needs AVX-512F, which every caller (inlined into
    // `compact_ids_avx512` or msgpack.rs's `msgpack_uints_avx512`) has.
    unsafe { _mm512_loadu_si512(table.as_ptr().cast()) }
}

/// The whole scan per block: classify 64 bytes with three compares, gather every id's comma
/// position with one compress, and for eight ids at a time gather the 8 bytes ending at each
/// comma with one two-table byte permute, zero the bytes before the id's start and convert
/// as `quads_values` does. No loop runs per id, so the block's id count costs no mispredicted
/// exit. A block whose ids include one of 8 or more digits is left to the caller.
///
/// # Safety
/// The CPU must have AVX-512F, BW, VBMI and VBMI2.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vbmi2")]
unsafe fn compact_ids_avx512(body: &[u8], start: usize, out: &mut Vec<u32>) -> usize {
    let window_positions = constant(&WINDOW_POSITIONS);
    let previous = constant(&PREVIOUS);
    let first_eight = constant(&FIRST_EIGHT);
    let second_eight = constant(&SECOND_EIGHT);
    let before_comma = constant(&BEFORE_COMMA);
    let even_halves = constant(&EVEN_HALVES);
    let mut base = start;
    // Where the first id not yet taken starts, relative to the block (wrapping: it may have
    // begun up to 7 bytes before it).
    let mut from = 0usize;
    // Bit 0: whether the block's first byte starts an id.
    let mut after_comma = 1u64;
    // The window reaches 8 bytes before the block: an id's digit word ends at its comma.
    while let Some(window) = base
        .checked_sub(8)
        .and_then(|from| body.get(from..))
        .and_then(|rest| rest.first_chunk::<72>())
    {
        let (Some(head), Some(block), Some(tail)) = (
            window.first_chunk::<64>(),
            window.last_chunk::<64>(),
            window.last_chunk::<8>(),
        ) else {
            break;
        };
        // SAFETY: each load reads the 64 bytes of `head` or `block`; `loadu` has no
        // alignment requirement.
        let (head, bytes) = unsafe {
            (
                _mm512_loadu_si512(head.as_ptr().cast()),
                _mm512_loadu_si512(block.as_ptr().cast()),
            )
        };
        // Window bytes 64..72 (the block's last 8) as the second table of the byte permute.
        let tail = _mm512_set_epi64(0, 0, 0, 0, 0, 0, 0, i64::from_le_bytes(*tail));
        let commas = _mm512_cmpeq_epi8_mask(bytes, _mm512_set1_epi8(b',' as i8));
        let zeros = _mm512_cmpeq_epi8_mask(bytes, _mm512_set1_epi8(b'0' as i8));
        // Digits are the bytes whose distance above '0' (wrapping) is at most 9.
        let above_zero = _mm512_sub_epi8(bytes, _mm512_set1_epi8(b'0' as i8));
        let digits = _mm512_cmple_epu8_mask(above_zero, _mm512_set1_epi8(9));
        // Anything else, or a block without a comma (an id of 64 or more digits, and `from`
        // below must stay within a block's reach): the caller's loop takes it from here.
        if commas | digits != u64::MAX
            || commas == 0
            || !ids_well_formed(commas, zeros, after_comma, body.get(base + 64))
        {
            break;
        }
        let count = commas.count_ones() as usize;
        // Element j: the window position of the block's j-th comma (0 past the last).
        let ends = _mm512_maskz_compress_epi8(commas, window_positions);
        // Element j: where the j-th id starts, the position after the comma before it.
        let first = _mm512_set1_epi8(from.wrapping_add(8) as u8 as i8);
        let after_ends = _mm512_add_epi8(ends, _mm512_set1_epi8(1));
        let starts = _mm512_mask_permutexvar_epi8(first, !1, previous, after_ends);
        // An id that began 8 or more bytes before its comma (including one that began before
        // the window: its start wraps high) is longer than a digit word holds.
        let lengths = _mm512_sub_epi8(ends, starts);
        let taken = 1u64
            .checked_shl(count as u32)
            .map_or(u64::MAX, |bit| bit - 1);
        if _mm512_mask_cmpgt_epu8_mask(taken, lengths, _mm512_set1_epi8(7)) != 0 {
            break;
        }
        if out.capacity() - out.len() < 64 {
            out.reserve((body.len() - base) / 2 + 64);
        }
        let filled = out.len();
        // A block of digits and commas with no empty id has at most 32 ids, so 64 slots hold
        // every store below (16 values, then 8 at a time up to 32).
        let Some(slots) = out.spare_capacity_mut().first_chunk_mut::<64>() else {
            break;
        };
        let low = group_values(first_eight, ends, starts, head, tail, before_comma);
        let high = group_values(second_eight, ends, starts, head, tail, before_comma);
        // SAFETY: the store writes 64 bytes, the first 16 of the 64 slots `slots` refers to;
        // `storeu` has no alignment requirement.
        unsafe {
            _mm512_storeu_si512(
                slots.as_mut_ptr().cast(),
                _mm512_permutex2var_epi32(low, even_halves, high),
            );
        }
        let mut group = 16;
        while group < count {
            let pick = _mm512_add_epi8(first_eight, _mm512_set1_epi8(group as i8));
            let values = group_values(pick, ends, starts, head, tail, before_comma);
            let eight = _mm512_cvtepi64_epi32(values);
            if let Some(dst) = slots
                .get_mut(group..)
                .and_then(|s| s.first_chunk_mut::<8>())
            {
                // SAFETY: the store writes the 32 bytes of `dst`, eight slots; `storeu` has
                // no alignment requirement.
                unsafe { _mm256_storeu_si256(dst.as_mut_ptr().cast(), eight) };
            }
            group += 8;
        }
        // SAFETY: the stores above wrote slots 0..16 and then 8 more per group up to `count`
        // (at most 32), so the first `count` slots after `filled` are initialized.
        unsafe { out.set_len(filled + count) };
        // The next id starts after the block's last comma.
        from = (commas.leading_zeros() as usize).wrapping_neg();
        after_comma = commas >> 63;
        base += 64;
    }
    base.wrapping_add(from)
}

/// The values of eight ids as the low 32 bits of the 64-bit lanes: lane `k` takes the id
/// whose element `pick` names in its 8 bytes, its digits being the 8 window bytes that end
/// at its comma (`ends`), those before its start (`starts`) zeroed.
#[inline(always)]
fn group_values(
    pick: __m512i,
    ends: __m512i,
    starts: __m512i,
    head: __m512i,
    tail: __m512i,
    before_comma: __m512i,
) -> __m512i {
    // SAFETY: register-only intrinsics of AVX-512F/BW/VBMI, which every caller (inlined into
    // `compact_ids_avx512`) has.
    unsafe {
        let end = _mm512_permutexvar_epi8(pick, ends);
        let start = _mm512_permutexvar_epi8(pick, starts);
        let positions = _mm512_add_epi8(end, before_comma);
        // Positions 0..64 index `head`, 64..72 `tail`.
        let bytes = _mm512_permutex2var_epi8(head, positions, tail);
        let own = _mm512_cmpge_epu8_mask(positions, start);
        let digits = _mm512_maskz_sub_epi8(own, bytes, _mm512_set1_epi8(b'0' as i8));
        // The conversion of `quads_values`, over eight words.
        let pairs = _mm512_maddubs_epi16(digits, _mm512_set1_epi16(0x010a));
        let fours = _mm512_madd_epi16(pairs, _mm512_set1_epi32(0x0001_0064));
        let high = _mm512_mul_epu32(fours, _mm512_set1_epi64(10_000));
        _mm512_add_epi64(high, _mm512_srli_epi64(fours, 32))
    }
}
