//! The compact part of a long token-id array (`12,345,6789,…`), 64 bytes at a time.
//!
//! Parsing one id after another is bound by a chain of dependent steps: an id's end is only
//! known once its bytes are classified, and that end is where the next id starts. Here the
//! commas of a whole 64-byte block come out of one classification (`digit_scan::classify`,
//! SSE2 on x86-64), so every id's position is known up front; an id's digit word is the 8
//! bytes that end at its comma, masked to its length, and the words are converted in bulk
//! (`digit_scan::words_to_values`, four at a time with AVX2). docs/hot-path.md has the
//! figures.
//!
//! Validation is per block, on the masks: a block is taken only if it holds nothing but
//! digits and commas, no comma starts an id (`,,`, or a comma first) and no `0` starts an id
//! of two or more digits; an id of 8 or more digits is left to the caller. So every byte
//! taken was checked against the same `digits,digits,…,` rule the one-id-at-a-time loop
//! applies, and whatever this stops at, that loop parses (or rejects) from there.

/// Digit words collected before they are converted.
const BATCH: usize = 512;

/// The lanes an id of `len` digits keeps of the 8 bytes that end at its comma: its digits
/// are the top `len`. A table, not `u64::MAX << (64 - 8 * len)`: a shift by a variable
/// count is three micro-ops on Intel cores, and with it the loop took a third longer.
const KEEP: [u64; 8] = {
    let mut keep = [0u64; 8];
    let mut len = 1;
    while len < 8 {
        keep[len] = u64::MAX << (64 - 8 * len);
        len += 1;
    }
    keep
};

/// Takes the compact ids from `body[start]` (an id's first byte, or what stands there) on,
/// while whole blocks of digits and commas remain, and appends them to `out`; returns the
/// index of the first id it did not take, where the caller's loop continues.
pub(super) fn compact_ids(body: &[u8], start: usize, out: &mut Vec<u32>) -> usize {
    let mut words = [0u64; BATCH];
    let mut filled = 0;
    let mut base = start;
    // Where the first id not yet taken starts, relative to the block (wrapping: an id may
    // have begun up to 7 bytes before it). Relative, so the loop over a block's commas does
    // no address arithmetic with `base`.
    let mut from = 0usize;
    // Bit 0: whether the block's first byte starts an id.
    let mut after_comma = 1u64;
    // The window reaches 8 bytes before the block: an id's digit word ends at its comma.
    'blocks: while let Some(window) = base
        .checked_sub(8)
        .and_then(|from| body.get(from..))
        .and_then(|rest| rest.first_chunk::<72>())
    {
        let Some(block) = window.last_chunk::<64>() else {
            break;
        };
        let classes = digit_scan::classify(block);
        // The array's end or whitespace: the caller's loop takes it from there.
        if classes.others != 0 {
            break;
        }
        let starts = (classes.commas << 1) | after_comma;
        let next_is_digit = body.get(base + 64).is_some_and(u8::is_ascii_digit);
        let digit_follows = (!classes.commas >> 1) | (u64::from(next_is_digit) << 63);
        if classes.commas & starts != 0 || classes.zeros & starts & digit_follows != 0 {
            break; // an empty id or a leading zero: the caller's loop reports it
        }
        if filled + 64 > BATCH {
            digit_scan::words_to_values(&words[..filled], out);
            filled = 0;
        }
        let mut commas = classes.commas;
        while commas != 0 {
            // `& 63` only tells the compiler what `trailing_zeros` of a nonzero mask is.
            let at = commas.trailing_zeros() as usize & 63;
            commas &= commas - 1;
            let len = at.wrapping_sub(from);
            if len > 7 {
                break 'blocks; // 8 or more digits: the caller's loop
            }
            let word = u64::from_le_bytes(*window[at..].first_chunk::<8>().unwrap_or(&[0; 8]));
            words[filled & (BATCH - 1)] = (word ^ 0x3030_3030_3030_3030) & KEEP[len];
            filled += 1;
            from = at + 1;
        }
        after_comma = classes.commas >> 63;
        from = from.wrapping_sub(64);
        base += 64;
    }
    digit_scan::words_to_values(&words[..filled], out);
    base.wrapping_add(from)
}
