//! The msgpack form of a token-id list, decoded 64 bytes at a time with AVX-512.
//!
//! A `BlockStored` event carries its blocks' token ids as a msgpack array of unsigned ints,
//! each a positive fixint (1 byte), a u8 (`0xcc` and 1 byte), a u16 (`0xcd` and 2) or a
//! u32 (`0xce` and 4): a 128 k vocabulary mixes u16 and u32 in no order. Decoding one id at
//! a time is a chain of dependent loads (an id's marker gives its length, which gives the
//! next id's position), and it was a fifth of the server's time under a stream of events
//! (docs/hot-path.md). Per 64-byte window this finds every id's position without that
//! chain: each byte's length as a marker is known at once (three compares), so "the next
//! position" is a table of 64 bytes, and the positions of ids 0, 1, 2, … are that table
//! applied 0, 1, 2, … times to the first position, which five rounds of doubling build with
//! byte permutes (for up to 32 ids; a window of more is walked again from its 33rd). One
//! more permute per 16 ids gathers their value bytes in little-endian order. Windows lie at
//! fixed 64-byte steps and each takes the ids that start in it, so all a window hands the
//! next is where the next one's first id starts (0 to 4 bytes in): the powers of the next
//! window's table, most of its permutes, do not wait for the walk before.
//!
//! Every `unsafe` here is one of the kinds simd.rs lists: calling an intrinsic of a feature
//! the CPU is known to have (after `is_x86_feature_detected!`), or a load or store through a
//! pointer derived from a reference to the bytes or slots it touches (a masked load or store
//! touches only the lanes of its mask).
#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m512i, _MM_HINT_T0, _mm_cvtsi128_si32, _mm_prefetch, _mm512_add_epi8, _mm512_castsi512_si128,
    _mm512_cmpeq_epi8_mask, _mm512_cmpgt_epu8_mask, _mm512_cmplt_epu8_mask, _mm512_loadu_si512,
    _mm512_mask_mov_epi8, _mm512_mask_storeu_epi32, _mm512_mask2_permutex2var_epi8,
    _mm512_maskz_loadu_epi8, _mm512_maskz_permutex2var_epi8, _mm512_max_epu8, _mm512_movepi8_mask,
    _mm512_permutex2var_epi8, _mm512_permutexvar_epi8, _mm512_set1_epi8, _mm512_sub_epi8,
};

use crate::simd::{constant, lanes, spread};

/// [`crate::msgpack_uints`] with AVX-512 (F, BW and VBMI, and POPCNT, which every CPU with
/// them has), or `None` when the CPU lacks them.
#[inline]
pub(crate) fn msgpack_uints(bytes: &[u8], out: &mut [u32]) -> Option<(usize, usize)> {
    let avx512 = std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vbmi")
        && std::arch::is_x86_feature_detected!("popcnt");
    // SAFETY: the CPU has the four features (checked just above).
    avx512.then(|| unsafe { msgpack_uints_avx512(bytes, out) })
}

/// The window's positions, and positions 64..128 mapped to themselves: the second table of
/// every two-table permute below, so a position past the window stays where it is.
static POSITIONS: [u8; 64] = lanes(0);
static PAST_WINDOW: [u8; 64] = lanes(64);
/// Byte `i` is `i % 4`: which little-endian byte of its 32-bit lane it is.
static BYTE_OF_LANE: [u8; 64] = {
    let mut lanes = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        lanes[i] = (i % 4) as u8;
        i += 1;
    }
    lanes
};
/// The element of each byte for the two groups of 16 ids of a walk.
static GROUPS: [[u8; 64]; 2] = [spread(4, 0), spread(4, 16)];
/// Bytes ahead of the window that each window prefetches.
const PREFETCH_AHEAD: usize = 256;
/// Ids a window takes at most: more doubling rounds would take more ids of one byte (fixints
/// are rare in token ids) but lengthen every window's chain of permutes.
const MAX_IDS: usize = 32;
/// Lane `k` takes `jump^(2^i)` in doubling round `i` when bit `i` of `k` is set.
const ROUND_LANES: [u64; 5] = [
    0xAAAA_AAAA_AAAA_AAAA,
    0xCCCC_CCCC_CCCC_CCCC,
    0xF0F0_F0F0_F0F0_F0F0,
    0xFF00_FF00_FF00_FF00,
    0xFFFF_0000_FFFF_0000,
];

/// The 64 bytes of `bytes` from `at` on, zero past its end (a masked load where fewer
/// remain).
#[inline(always)]
fn window_at(bytes: &[u8], at: usize) -> __m512i {
    let rest = bytes.get(at..).unwrap_or(&[]);
    if rest.len() >= 64 {
        // SAFETY: `rest` holds at least 64 bytes; `loadu` has no alignment requirement;
        // AVX-512F, which every caller (inlined into `msgpack_uints_avx512`) has.
        unsafe { _mm512_loadu_si512(rest.as_ptr().cast()) }
    } else {
        // SAFETY: the mask selects the first `rest.len()` bytes, all within `rest`; the
        // masked-off lanes are not read; AVX-512BW, as above.
        unsafe { _mm512_maskz_loadu_epi8((1u64 << rest.len()) - 1, rest.as_ptr().cast()) }
    }
}

/// The decoder, window by window (see the module docs). Windows lie at fixed 64-byte steps
/// from the start of `bytes`; a window takes the ids that start in it, the value bytes of
/// its last id reaching at most 4 bytes into the next window. So where a window's walk
/// starts (its `entry`, 0 to 4) is all that one window hands the next: the powers of the
/// next window's table, the bulk of its permutes, do not wait for the walk before.
///
/// # Safety
/// The CPU must have AVX-512F, BW and VBMI, and POPCNT.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,popcnt")]
unsafe fn msgpack_uints_avx512(bytes: &[u8], out: &mut [u32]) -> (usize, usize) {
    let positions = constant(&POSITIONS);
    let past_window = constant(&PAST_WINDOW);
    let byte_of_lane = constant(&BYTE_OF_LANE);
    let one = _mm512_set1_epi8(1);
    let mut filled = 0usize;
    let mut base = 0usize;
    let mut entry = 0usize;
    let mut window = window_at(bytes, 0);
    while filled < out.len() && base + entry < bytes.len() {
        // A message's bytes arrive written by another core (the ZMQ I/O thread): fetch a
        // few windows ahead (a prefetch never faults, whatever the address).
        _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().wrapping_add(base + PREFETCH_AHEAD).cast());
        let following = window_at(bytes, base + 64);
        // Bytes of the data from the window's start, as far as an id's end can reach.
        let avail = (bytes.len() - base).min(127);
        // Each byte read as a marker: its id's length, and whether it is none of the four.
        let u8s = _mm512_cmpeq_epi8_mask(window, _mm512_set1_epi8(0xccu8 as i8));
        let u16s = _mm512_cmpeq_epi8_mask(window, _mm512_set1_epi8(0xcdu8 as i8));
        let u32s = _mm512_cmpeq_epi8_mask(window, _mm512_set1_epi8(0xceu8 as i8));
        let other = _mm512_movepi8_mask(window) & !(u8s | u16s | u32s);
        let mut len = _mm512_mask_mov_epi8(one, u8s, _mm512_set1_epi8(2));
        len = _mm512_mask_mov_epi8(len, u16s, _mm512_set1_epi8(3));
        len = _mm512_mask_mov_epi8(len, u32s, _mm512_set1_epi8(5));
        // The next id's position after an id at each position (at most 68, in the next
        // window). A position where the walk must stop maps to itself: another marker, or
        // an id cut off by the end of the data.
        let ends = _mm512_add_epi8(positions, len);
        let stop = other | _mm512_cmpgt_epu8_mask(ends, _mm512_set1_epi8(avail as i8));
        let jump = _mm512_mask_mov_epi8(ends, stop, positions);
        // `jump^(2^i)` for i = 0..5, and `jump^32`: from the window's bytes alone.
        let mut powers = [jump; 6];
        for i in 1..powers.len() {
            powers[i] = _mm512_permutex2var_epi8(powers[i - 1], powers[i - 1], past_window);
        }
        // A window of more than 32 ids is walked again from its 33rd.
        loop {
            // Lane `k` below 32: the position of the id `k` ids after `entry`, built from
            // the powers for each set bit of `k`; lane 0 of `jump^32` at `entry` is where
            // this walk ends: the first id not taken.
            let start = _mm512_set1_epi8(entry as i8);
            let mut at = start;
            for (power, round_lanes) in powers.iter().zip(ROUND_LANES) {
                at = _mm512_mask2_permutex2var_epi8(*power, at, round_lanes, past_window);
            }
            let stop_at = _mm512_permutexvar_epi8(start, powers[5]);
            let next = (_mm_cvtsi128_si32(_mm512_castsi512_si128(stop_at)) & 0xff) as usize;
            // The ids before the stop (the walk stays at it once there); lanes 32..64
            // repeat lanes 0..32.
            let before = _mm512_cmplt_epu8_mask(at, stop_at) & (u64::MAX >> (64 - MAX_IDS));
            let taken = before.count_ones() as usize;
            let count = taken.min(out.len() - filled);
            if count > 0 {
                let len_at = _mm512_permutexvar_epi8(at, len);
                // An id's last byte (up to 67, in the next window), and how many bytes its
                // value has (1 for a fixint, the marker).
                let last = _mm512_sub_epi8(_mm512_add_epi8(at, len_at), one);
                let width = _mm512_max_epu8(_mm512_sub_epi8(len_at, one), one);
                let slots = &mut out[filled..filled + count];
                for (group, pick) in GROUPS.iter().enumerate().take(count.div_ceil(16)) {
                    let pick = constant(pick);
                    let last = _mm512_permutexvar_epi8(pick, last);
                    let width = _mm512_permutexvar_epi8(pick, width);
                    // Little-endian byte `b` of an id is its `b`-th byte from the end, if
                    // it has one.
                    let source = _mm512_sub_epi8(last, byte_of_lane);
                    let present = _mm512_cmplt_epu8_mask(byte_of_lane, width);
                    let values = _mm512_maskz_permutex2var_epi8(present, window, source, following);
                    let left = count - 16 * group;
                    let mask = if left >= 16 {
                        u16::MAX
                    } else {
                        (1u16 << left) - 1
                    };
                    let dst = &mut slots[16 * group..];
                    // SAFETY: the mask selects the first `min(left, 16)` slots of `dst`,
                    // and `dst` holds `left` of them; the masked-off lanes are not written.
                    unsafe { _mm512_mask_storeu_epi32(dst.as_mut_ptr().cast(), mask, values) };
                }
                filled += count;
            }
            if count < taken {
                // `out` is full: the first id not taken starts at lane `count`.
                let first = _mm512_permutexvar_epi8(_mm512_set1_epi8(count as i8), at);
                let first = (_mm_cvtsi128_si32(_mm512_castsi512_si128(first)) & 0xff) as usize;
                return (base + first, filled);
            }
            if next >= 64 {
                // Every id that starts in the window is taken.
                entry = next - 64;
                break;
            }
            if taken < MAX_IDS {
                // Stopped at another marker or a cut-off id: the caller's loop goes on there.
                return (base + next, filled);
            }
            entry = next;
        }
        base += 64;
        window = following;
    }
    (bytes.len().min(base + entry), filled)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    /// One id at a time: the value and end of every leading id of the four forms.
    fn model(bytes: &[u8]) -> Vec<(u32, usize)> {
        let mut ids = Vec::new();
        let mut pos = 0;
        while let Some(&marker) = bytes.get(pos) {
            let extra = match marker {
                0x00..=0x7f => 0,
                0xcc => 1,
                0xcd => 2,
                0xce => 4,
                _ => break,
            };
            let Some(value) = bytes.get(pos + 1..pos + 1 + extra) else {
                break;
            };
            let value = if extra == 0 {
                u32::from(marker)
            } else {
                value.iter().fold(0u32, |v, &b| (v << 8) | u32::from(b))
            };
            pos += 1 + extra;
            ids.push((value, pos));
        }
        ids
    }

    type Decoder = fn(&[u8], &mut [u32]) -> Option<(usize, usize)>;

    /// The vector decoders, each `None` where the CPU lacks its features, and whether it
    /// leaves the slots past the ids it took as they were (the SSE one writes up to 7 ids'
    /// room further; `crate::msgpack_uints` allows it).
    const DECODERS: [(&str, Decoder, bool); 2] = [
        ("AVX-512", super::msgpack_uints, true),
        ("SSE", crate::msgpack_sse::msgpack_uints, false),
    ];

    /// Each decoder the CPU can run takes exactly the model's ids up to `room`, writes no
    /// slot past `room` (nor past those taken, if it says so), and reports the bytes they
    /// span.
    fn check(bytes: &[u8], room: usize) -> Result<(), TestCaseError> {
        const UNTOUCHED: u32 = 0xdead_beef;
        let expected_all = model(bytes);
        let expected = &expected_all[..expected_all.len().min(room)];
        let values: Vec<u32> = expected.iter().map(|&(v, _)| v).collect();
        for (name, decode, exact) in DECODERS {
            let mut out = vec![UNTOUCHED; room + 20];
            let Some((used, taken)) = decode(bytes, &mut out[..room]) else {
                continue;
            };
            prop_assert_eq!(taken, expected.len(), "{}", name);
            prop_assert_eq!(&out[..taken], &values[..], "{}", name);
            let kept = if exact { taken } else { room };
            prop_assert!(out[kept..].iter().all(|&v| v == UNTOUCHED), "{}", name);
            prop_assert_eq!(used, expected.last().map_or(0, |&(_, end)| end), "{}", name);
        }
        Ok(())
    }

    #[test]
    fn the_sse_decoder_runs_on_every_x86_64_ci_machine() {
        // Otherwise every test here would pass without checking anything.
        assert!(crate::msgpack_sse::msgpack_uints(b"", &mut []).is_some());
    }

    /// `id` in one of the forms that can hold it, chosen by `form`.
    fn encode(id: u32, form: u8, out: &mut Vec<u8>) {
        match form % 4 {
            0 if id < 0x80 => out.push(id as u8),
            0 | 1 if id <= 0xff => out.extend([0xcc, id as u8]),
            0..=2 if id <= 0xffff => {
                out.push(0xcd);
                out.extend((id as u16).to_be_bytes());
            }
            _ => {
                out.push(0xce);
                out.extend(id.to_be_bytes());
            }
        }
    }

    #[test]
    fn a_long_list_is_taken_whole_at_every_room() {
        let ids: Vec<u32> = (0..3_000u32)
            .map(|k| k.wrapping_mul(2_654_435_761) >> (k % 32))
            .collect();
        let mut bytes = Vec::new();
        for (k, &id) in ids.iter().enumerate() {
            encode(id, (k % 7) as u8, &mut bytes);
        }
        bytes.extend([0xc0, 1, 2, 3]);
        for room in [
            0, 1, 15, 16, 17, 63, 64, 65, 200, 2_999, 3_000, 3_001, 4_000,
        ] {
            assert!(check(&bytes, room).is_ok(), "room {room}");
        }
        for cut in 0..80 {
            assert!(
                check(&bytes[..bytes.len() - 4 - cut], 4_000).is_ok(),
                "cut {cut}"
            );
        }
    }

    #[test]
    fn it_stops_at_every_other_marker_at_every_position() {
        let mut clean = Vec::new();
        for k in 0..90u32 {
            encode(k * 1_499, (k % 4) as u8, &mut clean);
        }
        for at in 0..clean.len() {
            for byte in [0x80u8, 0xc0, 0xcb, 0xcf, 0xd0, 0xd3, 0xff, 0xcc, 0xce, 0x00] {
                let mut bytes = clean.clone();
                bytes[at] = byte;
                if let Err(e) = check(&bytes, 100) {
                    panic!("byte {byte:#x} at {at}: {e}");
                }
            }
        }
    }

    proptest! {
        #[test]
        fn it_agrees_with_the_model_on_lists(
            ids in prop::collection::vec(
                (prop_oneof![0u32..0x80, 0u32..0x100, 0u32..0x1_0000, 0u32..200_000, any::<u32>()],
                 any::<u8>()),
                0..400,
            ),
            tail in prop::collection::vec(any::<u8>(), 0..8),
            room in 0usize..450,
        ) {
            let mut bytes = Vec::new();
            for &(id, form) in &ids {
                encode(id, form, &mut bytes);
            }
            bytes.extend(tail);
            check(&bytes, room)?;
        }

        #[test]
        fn it_agrees_with_the_model_on_arbitrary_bytes(
            bytes in prop::collection::vec(
                prop_oneof![
                    4 => 0u8..0x80,
                    2 => prop::sample::select(vec![0xccu8, 0xcd, 0xce]),
                    1 => any::<u8>(),
                ],
                0..700,
            ),
            room in 0usize..700,
        ) {
            check(&bytes, room)?;
        }
    }
}
