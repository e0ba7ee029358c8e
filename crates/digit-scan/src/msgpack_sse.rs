//! msgpack.rs's token-id decoder for CPUs without AVX-512 (SSSE3, SSE4.1 and AVX: every
//! x86-64 server CPU since 2011), in 16-byte windows. AVX is for its three-operand encoding
//! alone: without it every blend ties its mask to `xmm0`, a register copy per blend, and
//! the decoder was no faster than the one-id-at-a-time loop (docs/hot-path.md).
//!
//! The walk is msgpack.rs's: each byte read as a marker gives its id's length, so "the
//! position after an id starting here" is a table of 16 bytes, and the positions of a
//! window's ids are that table applied 0, 1, 2, … times to where its first id starts, built
//! by doubling with byte shuffles (three rounds: up to 8 ids, and a window of more, only
//! fixints, is walked again from its 9th). A shuffle indexes 16 bytes only, so a position
//! past the window is kept as `0x80 | (position - 16)`: the shuffle zeroes it and a blend
//! on its top bit puts it back, so it stays where it is, as a stop does. Windows lie at
//! fixed 16-byte steps and each takes the ids that start in it, so all one hands the next is
//! where the next one's first id starts (0 to 4 bytes in). Two more shuffles per group of 4
//! ids gather their value bytes from the window and the next one, and both groups are
//! stored at once, whatever the count (up to 7 slots past the ids taken are written).
//!
//! Every `unsafe` here is one of the kinds simd.rs lists: calling an intrinsic of a feature
//! the CPU is known to have (after `is_x86_feature_detected!`), or a load or store through a
//! pointer derived from a reference to the 16 bytes it touches.
#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m128i, _MM_HINT_T0, _mm_add_epi8, _mm_and_si128, _mm_blendv_epi8, _mm_cmpeq_epi8,
    _mm_cmpgt_epi8, _mm_cvtsi128_si32, _mm_loadu_si128, _mm_max_epu8, _mm_movemask_epi8,
    _mm_or_si128, _mm_prefetch, _mm_set1_epi8, _mm_shuffle_epi8, _mm_storeu_si128, _mm_sub_epi8,
};

/// [`crate::msgpack_uints`] with SSSE3, SSE4.1 and AVX, or `None` when the CPU lacks them.
#[inline]
pub(crate) fn msgpack_uints(bytes: &[u8], out: &mut [u32]) -> Option<(usize, usize)> {
    let sse = std::arch::is_x86_feature_detected!("ssse3")
        && std::arch::is_x86_feature_detected!("sse4.1")
        && std::arch::is_x86_feature_detected!("avx");
    // SAFETY: the CPU has the three features (checked just above).
    sse.then(|| unsafe { msgpack_uints_sse(bytes, out) })
}

/// The window's positions.
static POSITIONS: [u8; 16] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15];
/// Lane `k` takes `jump^(2^i)` in doubling round `i` when bit `i` of `k` is set.
static ROUND_LANES: [[u8; 16]; 3] = {
    let mut rounds = [[0u8; 16]; 3];
    let mut i = 0;
    while i < 3 {
        let mut k = 0;
        while k < 16 {
            if k & (1 << i) != 0 {
                rounds[i][k] = 0xff;
            }
            k += 1;
        }
        i += 1;
    }
    rounds
};
/// The length of the id a marker `0xcc + i` starts (`0xcc`, `0xcd`, `0xce`: a u8, u16 or u32
/// and its marker), 0 for the other markers.
static MARKER_LENGTHS: [u8; 16] = [2, 3, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
/// Byte `i` is `i % 4`: which little-endian byte of its 32-bit lane it is.
static BYTE_OF_LANE: [u8; 16] = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3];
/// The walk's lane of each byte, for its two groups of 4 ids.
static GROUPS: [[u8; 16]; 2] = [
    [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3],
    [4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7],
];
/// Bytes ahead of the window that each window prefetches.
const PREFETCH_AHEAD: usize = 256;
/// Ids a walk takes at most (three doubling rounds).
const MAX_IDS: usize = 8;

/// The 16 bytes of `table`.
#[inline(always)]
fn constant(table: &'static [u8; 16]) -> __m128i {
    // SAFETY: the load reads the 16 bytes of `table`; `loadu` has no alignment requirement
    // and is SSE2, which every x86-64 CPU has.
    unsafe { _mm_loadu_si128(table.as_ptr().cast()) }
}

/// The 16 bytes of `bytes` from `at` on, zero past its end.
#[inline(always)]
fn window_at(bytes: &[u8], at: usize) -> __m128i {
    let rest = bytes.get(at..).unwrap_or(&[]);
    let mut padded = [0u8; 16];
    let whole = match rest.first_chunk::<16>() {
        Some(whole) => whole,
        None => {
            padded[..rest.len()].copy_from_slice(rest);
            &padded
        }
    };
    // SAFETY: `whole` is 16 bytes; `loadu` has no alignment requirement (SSE2).
    unsafe { _mm_loadu_si128(whole.as_ptr().cast()) }
}

/// `a` applied to each lane of `b` that is a position in the window; a lane past it
/// (`0x80 | …`) stays as it is.
#[inline(always)]
fn apply(a: __m128i, b: __m128i) -> __m128i {
    // SAFETY: SSSE3, SSE4.1 and AVX, which every caller (inlined into `msgpack_uints_sse`) has.
    unsafe { _mm_blendv_epi8(_mm_shuffle_epi8(a, b), b, b) }
}

/// The values of a walk's group of 4 ids (`pick` names their lanes), given each id's last
/// byte (up to 19) and value width, from the window and the one after it.
///
/// # Safety
/// The CPU must have SSSE3, SSE4.1 and AVX.
#[inline]
#[target_feature(enable = "ssse3,sse4.1,avx")]
unsafe fn group_values(
    pick: &'static [u8; 16],
    last: __m128i,
    width: __m128i,
    window: __m128i,
    following: __m128i,
) -> __m128i {
    let byte_of_lane = constant(&BYTE_OF_LANE);
    let pick = constant(pick);
    let last = _mm_shuffle_epi8(last, pick);
    let width = _mm_shuffle_epi8(width, pick);
    // Little-endian byte `b` of an id is its `b`-th byte from the end, if it has one: from
    // the window below 16, from the next one from 16 on (a source below 16 less 16 has its
    // top bit set, which the shuffle zeroes).
    let source = _mm_sub_epi8(last, byte_of_lane);
    let present = _mm_cmpgt_epi8(width, byte_of_lane);
    let here = _mm_shuffle_epi8(window, source);
    let there = _mm_shuffle_epi8(following, _mm_sub_epi8(source, _mm_set1_epi8(16)));
    let past = _mm_cmpgt_epi8(source, _mm_set1_epi8(15));
    _mm_and_si128(_mm_blendv_epi8(here, there, past), present)
}

/// The decoder, window by window (see the module docs).
///
/// # Safety
/// The CPU must have SSSE3, SSE4.1 and AVX.
#[target_feature(enable = "ssse3,sse4.1,avx")]
unsafe fn msgpack_uints_sse(bytes: &[u8], out: &mut [u32]) -> (usize, usize) {
    let positions = constant(&POSITIONS);
    let rounds = ROUND_LANES.each_ref().map(constant);
    let mut filled = 0usize;
    let mut base = 0usize;
    let mut entry = 0usize;
    let marker_lengths = constant(&MARKER_LENGTHS);
    let one = _mm_set1_epi8(1);
    let mut window = window_at(bytes, 0);
    while filled < out.len() && base + entry < bytes.len() {
        // A message's bytes arrive written by another core (the ZMQ I/O thread): fetch a
        // few windows ahead (a prefetch never faults, whatever the address).
        _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().wrapping_add(base + PREFETCH_AHEAD).cast());
        let following = window_at(bytes, base + 16);
        // Bytes of the data from the window's start, as far as an id's end can reach.
        let avail = (bytes.len() - base).min(127);
        // Each byte read as a marker: its id's length, 0 for none of the four forms. A
        // fixint is a byte below 0x80; a byte minus 0xcc below 16 picks the length of
        // 0xcc, 0xcd or 0xce from a table (0 for the rest), and any other is made 0xff,
        // which the shuffle zeroes.
        let fixints = _mm_and_si128(_mm_cmpgt_epi8(window, _mm_set1_epi8(-1)), _mm_set1_epi8(1));
        let from_cc = _mm_sub_epi8(window, _mm_set1_epi8(0xccu8 as i8));
        let from_cc = _mm_or_si128(from_cc, _mm_cmpgt_epi8(from_cc, _mm_set1_epi8(15)));
        let len = _mm_or_si128(fixints, _mm_shuffle_epi8(marker_lengths, from_cc));
        // The next id's position after an id at each position (at most 20). Another marker
        // (length 0) maps to itself, and so does an id cut off by the end of the data; a
        // position past the window is kept as `0x80 | (position - 16)`.
        let ends = _mm_add_epi8(positions, len);
        let cut = _mm_cmpgt_epi8(ends, _mm_set1_epi8(avail as i8));
        let ends = _mm_blendv_epi8(ends, positions, cut);
        let past = _mm_and_si128(_mm_cmpgt_epi8(ends, _mm_set1_epi8(15)), _mm_set1_epi8(0x70));
        let jump = _mm_add_epi8(ends, past);
        // `jump^(2^i)` for i = 0..3: from the window's bytes alone.
        let mut powers = [jump; 4];
        for i in 1..powers.len() {
            powers[i] = apply(powers[i - 1], powers[i - 1]);
        }
        // A window of more than 8 ids (fixints) is walked again from its 9th.
        loop {
            // Lane `k` below 8: the position of the id `k` ids after `entry`; `jump^8` at
            // `entry` is where this walk ends: the first id not taken. The walk only moves
            // forward and stays at a stop, so the ids taken are the lanes before it.
            let start = _mm_set1_epi8(entry as i8);
            let mut at = start;
            for (power, lanes) in powers.iter().zip(rounds) {
                at = _mm_blendv_epi8(at, apply(*power, at), lanes);
            }
            let stop_at = apply(powers[3], start);
            let next = (_mm_cvtsi128_si32(stop_at) & 0xff) as usize;
            let at_stop = (_mm_movemask_epi8(_mm_cmpeq_epi8(at, stop_at)) as u32) | 1 << MAX_IDS;
            let taken = at_stop.trailing_zeros() as usize;
            let count = taken.min(out.len() - filled);
            if count > 0 {
                // An id's last byte (up to 19, in the next window), and how many bytes its
                // value has (1 for a fixint, the marker).
                let len_at = _mm_shuffle_epi8(len, at);
                let last = _mm_sub_epi8(_mm_add_epi8(at, len_at), one);
                let width = _mm_max_epu8(_mm_sub_epi8(len_at, one), one);
                let values = GROUPS.each_ref().map(|pick| {
                    // SAFETY: SSSE3, SSE4.1 and AVX, which this function has.
                    unsafe { group_values(pick, last, width, window, following) }
                });
                // Both groups are stored whole where `out` has room for them (no branch on
                // how many ids the window held, which varies at random); the slots past
                // the ids taken are the next window's to write, or left as the docs of
                // `crate::msgpack_uints` say.
                let mut eight = [0u32; MAX_IDS];
                let room = &mut out[filled..];
                let dst = match room.first_chunk_mut::<MAX_IDS>() {
                    Some(dst) => dst,
                    None => &mut eight,
                };
                // SAFETY: the two stores write the 32 bytes of `dst`'s eight slots.
                unsafe {
                    _mm_storeu_si128(dst.as_mut_ptr().cast(), values[0]);
                    _mm_storeu_si128(dst.as_mut_ptr().wrapping_add(4).cast(), values[1]);
                }
                if room.len() < MAX_IDS {
                    room[..count].copy_from_slice(&eight[..count]);
                }
                filled += count;
            }
            if count < taken {
                // `out` is full: the first id not taken starts at lane `count` (lane 0 is
                // `entry`; the others were just stored).
                let mut lanes = [0u8; 16];
                // SAFETY: the store writes the 16 bytes of `lanes`.
                unsafe { _mm_storeu_si128(lanes.as_mut_ptr().cast(), at) };
                let first = usize::from(lanes[count]);
                return (base + first, filled);
            }
            if next >= 0x80 {
                // Every id that starts in the window is taken.
                entry = next - 0x80;
                break;
            }
            if taken < MAX_IDS {
                // Stopped at another marker or a cut-off id: the caller's loop goes on there.
                return (base + next, filled);
            }
            entry = next;
        }
        base += 16;
        window = following;
    }
    (bytes.len().min(base + entry), filled)
}
