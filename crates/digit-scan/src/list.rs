//! Compact decimal lists (`12,345,6789,…`) 64 bytes at a time, with the words of each
//! block's ids converted in bulk: the version for CPUs without AVX-512, and the model the
//! AVX-512 version (simd.rs) is tested against.
//!
//! Parsing one id after another is bound by a chain of dependent steps: an id's end is only
//! known once its bytes are classified, and that end is where the next id starts. Here the
//! commas of a whole 64-byte block come out of one classification ([`crate::classify`],
//! SSE2 on x86-64), so every id's position is known up front; an id's digit word is the 8
//! bytes that end at its comma, masked to its length, and the words are converted in bulk
//! ([`crate::words_to_values`], four at a time with AVX2).

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

/// [`crate::compact_ids`], taking ids one comma at a time within a block.
pub(crate) fn compact_ids(body: &[u8], start: usize, out: &mut Vec<u32>) -> usize {
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
        let classes = crate::classify(block);
        // The array's end or whitespace: the caller's loop takes it from there.
        if classes.others != 0 {
            break;
        }
        if !crate::ids_well_formed(
            classes.commas,
            classes.zeros,
            after_comma,
            body.get(base + 64),
        ) {
            break;
        }
        if filled + 64 > BATCH {
            crate::words_to_values(&words[..filled], out);
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
    crate::words_to_values(&words[..filled], out);
    base.wrapping_add(from)
}
