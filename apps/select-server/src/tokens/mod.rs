//! The `token_ids` fast path of the selection routes (docs/hot-path.md).
//!
//! On a 2,048-token body, serde spent over half of the server's CPU on `token_ids`: a visitor
//! call chain per element, and with `RawValue` still a full syntax pass before any
//! conversion. [`split_token_ids`] instead walks the top level of the body object once, parses
//! the `token_ids` array in place (its compact part 64 bytes at a time, `digit_scan`; the rest
//! one id at a time with a SWAR digit loop), and hands the remaining (small) object to serde.
//! It only has to be right on the shapes it accepts: anything unusual (escaped keys, a
//! duplicate key, `null`, negative or fractional ids, ids ≥ 2^32, leading zeros, stray bytes)
//! returns `None`, and the caller parses the whole body the exact way,
//! with serde's error messages and field paths.
//!
//! Why the split cannot accept an invalid body: the cut-out member is validated here
//! (grammar of an array of integers), and everything else is validated by serde afterwards;
//! strings are skipped by the same grammar serde uses, so both agree on where the top-level
//! members start.

/// Splits a JSON object body into its `token_ids` (an array of plain u32 literals) and the
/// body without that member. `None` when the body has no such member or anything is unusual.
///
/// Public for the benchmarks and the fuzz target; the routes use it through the selection
/// body parser, which validates the rest with serde.
pub fn split_token_ids(body: &[u8]) -> Option<(Vec<u32>, Vec<u8>)> {
    let mut i = skip_ws(body, 0);
    if body.get(i) != Some(&b'{') {
        return None;
    }
    i = skip_ws(body, i + 1);
    if body.get(i) == Some(&b'}') {
        return None;
    }
    // (cut start, cut end, tokens)
    let mut found: Option<(usize, usize, Vec<u32>)> = None;
    let mut prev_comma: Option<usize> = None;
    loop {
        let key_start = i;
        let key_end = skip_string(body, i)?;
        let key = &body[key_start + 1..key_end - 1];
        if key.contains(&b'\\') {
            return None;
        }
        i = skip_ws(body, key_end);
        if body.get(i) != Some(&b':') {
            return None;
        }
        i = skip_ws(body, i + 1);
        let is_tokens = key == b"token_ids";
        let value_end = if is_tokens {
            if found.is_some() {
                return None; // duplicate: serde's error
            }
            let (tokens, end) = parse_token_array(body, i)?;
            found = Some((key_start, end, tokens));
            end
        } else {
            skip_value(body, i)?
        };
        i = skip_ws(body, value_end);
        match body.get(i) {
            Some(b',') => {
                if let Some((start, end, _)) = found.as_mut()
                    && is_tokens
                {
                    // Followed by another member: cut through this comma.
                    debug_assert_eq!(*start, key_start);
                    *end = i + 1;
                }
                prev_comma = Some(i);
                i = skip_ws(body, i + 1);
            }
            Some(b'}') => {
                if is_tokens
                    && let (Some((start, _, _)), Some(comma)) = (found.as_mut(), prev_comma)
                {
                    // Last member: cut from the comma before it.
                    *start = comma;
                }
                i += 1;
                break;
            }
            _ => return None,
        }
    }
    if skip_ws(body, i) != body.len() {
        return None;
    }
    let (start, end, tokens) = found?;
    let mut rest = Vec::with_capacity(body.len() - (end - start));
    rest.extend_from_slice(&body[..start]);
    rest.extend_from_slice(&body[end..]);
    Some((tokens, rest))
}

/// Parses the array of plain u32 literals starting at `body[i]`; returns it and the index
/// after its `]`.
fn parse_token_array(body: &[u8], i: usize) -> Option<(Vec<u32>, usize)> {
    if body.get(i) != Some(&b'[') {
        return None;
    }
    let i = skip_ws(body, i + 1);
    // Sized for ids of three or more digits (real vocabularies); shorter ones regrow.
    let mut out = Vec::with_capacity((body.len() - i) / 4 + 1);
    if body.get(i) == Some(&b']') {
        return Some((out, i + 1));
    }
    let resume = digit_scan::compact_ids(body, i, &mut out);
    // After a comma the general loop expects the next value's first byte.
    finish_array(body, skip_ws(body, resume), out)
}

/// The rest of an id array from `body[i]` (an id's first byte) on, one id at a time, with
/// whitespace anywhere JSON allows it; appends to `out` and returns it with the index after
/// the `]`.
fn finish_array(body: &[u8], mut i: usize, mut out: Vec<u32>) -> Option<(Vec<u32>, usize)> {
    loop {
        let rest = body.get(i..)?;
        let (value, len) = match swar_digits(rest) {
            Some(parsed) => parsed,
            None => slow_digits(rest)?,
        };
        // JSON forbids leading zeros ("01"); serde reports them.
        if len > 1 && rest[0] == b'0' {
            return None;
        }
        out.push(value);
        i += len;
        // Compact JSON has the separator right here; whitespace is the rare case.
        if !matches!(body.get(i), Some(b',' | b']')) {
            i = skip_ws(body, i);
        }
        match body.get(i) {
            Some(b',') => i = skip_ws(body, i + 1),
            Some(b']') => return Some((out, i + 1)),
            // '.', 'e', '-', a nested value...: serde decides.
            _ => return None,
        }
    }
}

/// A run of 1 to 7 digits at the start of `rest`, converted without a branch per digit (the
/// unpredictable number lengths of token ids made the byte loop mispredict once per token).
/// `None` when fewer than 8 bytes remain or the run is empty or 8+ digits long.
fn swar_digits(rest: &[u8]) -> Option<(u32, usize)> {
    let word = u64::from_le_bytes(rest.get(..8)?.try_into().ok()?);
    let x = word ^ 0x3030_3030_3030_3030;
    let len = first_non_digit(x) as usize;
    if len == 0 || len == 8 {
        return None;
    }
    Some((digits_value(x, len as u32), len))
}

/// The value of the `len` (1..=7) digits in the low lanes of `x = word ^ 0x30…30`, first
/// digit lowest: shifted up, they are a digit word (`digit_scan::word_value`).
#[inline(always)]
fn digits_value(x: u64, len: u32) -> u32 {
    // Shifting up drops the lanes past the id and pads the front with zero digits.
    digit_scan::word_value(x << (8 * (8 - len)))
}

/// The lane (0..=8, 8 = none) of the first byte of `x = word ^ 0x30…30` that is not an
/// ASCII digit. Digits are exactly the lanes with `x < 10`: there `x + 0x76 < 0x80` and
/// nothing carries out, so every lane below the first non-digit is clean, and that lane's
/// high bit is set (by the sum when `10 ≤ x < 0x80`, by `x` itself above). Lanes above it
/// may be garbled by its carry; only the lowest set bit is read. Four instructions, where
/// the nibble-wise test it replaces took eight: a 2,048-id body went from 62 to 56
/// instructions per id (callgrind), about 4 % faster.
#[inline(always)]
fn first_non_digit(x: u64) -> u32 {
    let non_digit = (x.wrapping_add(0x7676_7676_7676_7676) | x) & 0x8080_8080_8080_8080;
    non_digit.trailing_zeros() / 8
}

/// The digit run at the start of `rest` the plain way (array tails, 8+ digits); `None` when
/// empty or not a u32.
fn slow_digits(rest: &[u8]) -> Option<(u32, usize)> {
    let len = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    // Eleven digits exceed u32 whatever they are; ten cannot overflow the u64 below.
    if len == 0 || len > 10 {
        return None;
    }
    let value = rest[..len]
        .iter()
        .fold(0u64, |v, &d| v * 10 + u64::from(d - b'0'));
    Some((u32::try_from(value).ok()?, len))
}

fn skip_ws(body: &[u8], mut i: usize) -> usize {
    while matches!(body.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// `body[i]` must open a string; returns the index after its closing quote.
fn skip_string(body: &[u8], i: usize) -> Option<usize> {
    if body.get(i) != Some(&b'"') {
        return None;
    }
    let mut j = i + 1;
    loop {
        match body.get(j)? {
            b'\\' => j += 2,
            b'"' => return Some(j + 1),
            _ => j += 1,
        }
    }
}

/// Skips one value starting at `body[i]` (serde validates it later); returns the index after.
fn skip_value(body: &[u8], i: usize) -> Option<usize> {
    match body.get(i)? {
        b'"' => skip_string(body, i),
        b'[' | b'{' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match body.get(j)? {
                    b'"' => {
                        j = skip_string(body, j)?;
                        continue;
                    }
                    b'[' | b'{' => depth += 1,
                    b']' | b'}' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let len = body[i..]
                .iter()
                .take_while(|b| !matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
                .count();
            (len > 0).then_some(i + len)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(body: &str) -> Option<(Vec<u32>, String)> {
        split_token_ids(body.as_bytes()).map(|(t, r)| (t, String::from_utf8(r).unwrap()))
    }

    #[test]
    fn cuts_the_member_wherever_it_is() {
        let check = |body: &str, tokens: &[u32], rest: &str| {
            assert_eq!(
                split(body),
                Some((tokens.to_vec(), rest.to_owned())),
                "{body}"
            );
        };
        check(r#"{"token_ids":[1,2,3]}"#, &[1, 2, 3], "{}");
        check(r#" { "token_ids" : [ ] } "#, &[], " {  } ");
        check(
            r#"{"token_ids":[7],"model_name":"m"}"#,
            &[7],
            r#"{"model_name":"m"}"#,
        );
        check(
            r#"{"a":{"token_ids":[9]},"s":"x\",\"token_ids\":[","token_ids":[ 5 ,6 ]}"#,
            &[5, 6],
            r#"{"a":{"token_ids":[9]},"s":"x\",\"token_ids\":["}"#,
        );
        check(
            r#"{"n":-1.5e3,"b":[true,null],"token_ids":[0,10],"c":false}"#,
            &[0, 10],
            r#"{"n":-1.5e3,"b":[true,null],"c":false}"#,
        );
    }

    #[test]
    fn declines_anything_unusual() {
        for body in [
            r#"{}"#,
            r#"{"model_name":"m"}"#,
            r#"{"token_ids":null}"#,
            r#"{"token_ids":[1],"token_ids":[2]}"#,
            r#"{"token\u005fids":[1]}"#,
            r#"{"token_ids":[-1]}"#,
            r#"{"token_ids":[1.0]}"#,
            r#"{"token_ids":[1e3]}"#,
            r#"{"token_ids":[01]}"#,
            r#"{"token_ids":[4294967296]}"#,
            r#"{"token_ids":[[1]]}"#,
            r#"{"token_ids":["1"]}"#,
            r#"{"token_ids":[1,]}"#,
            r#"{"token_ids":[1 2]}"#,
            r#"{"token_ids":[1]} x"#,
            r#"{"token_ids":[1]"#,
            r#"{"token_ids":[1] "a":1}"#,
            r#"[1]"#,
            "{\"token_ids\":[12\u{e9}3,4567,8]}",
            "{\"token_ids\":[1234:,5]}",
            "{\"token_ids\":[123/,5]}",
        ] {
            assert_eq!(split(body), None, "{body}");
        }
    }

    mod props {
        use super::*;
        use proptest::prelude::*;
        use serde_json::Value;

        /// A selection-like body: other members around a `token_ids` array, with varied
        /// separators, optionally damaged at one byte.
        fn body(ids: std::ops::Range<usize>) -> impl Strategy<Value = Vec<u8>> {
            body_below(ids, 300_000)
        }

        /// As [`body`], with ids below `limit` (any `u32`: some of 8 to 10 digits).
        fn body_below(ids: std::ops::Range<usize>, limit: u64) -> impl Strategy<Value = Vec<u8>> {
            let member = prop::sample::select(vec![
                r#""model_name":"m""#,
                r#""n":-1.5e3"#,
                r#""s":"x\",\"token_ids\":[""#,
                r#""b":[true,null,{"token_ids":[1]}]"#,
                r#""advisory":false"#,
            ]);
            let sep = prop::sample::select(vec![",", " , ", ",\n  ", "\t,"]);
            (
                prop::collection::vec(member, 0..3),
                prop::collection::vec(
                    any::<u32>().prop_map(move |t| (u64::from(t) % limit) as u32),
                    ids,
                ),
                prop::collection::vec(sep, 1..4),
                0usize..4,
                prop::option::of((any::<prop::sample::Index>(), any::<u8>())),
            )
                .prop_map(|(members, tokens, seps, at, damage)| {
                    let list = tokens
                        .iter()
                        .enumerate()
                        .map(|(i, t)| {
                            let sep = if i == 0 { "" } else { seps[i % seps.len()] };
                            format!("{sep}{t}")
                        })
                        .collect::<String>();
                    let mut parts: Vec<String> = members.iter().map(|m| m.to_string()).collect();
                    let at = at.min(parts.len());
                    parts.insert(at, format!(r#""token_ids":[{list}]"#));
                    let mut bytes = format!("{{{}}}", parts.join(",")).into_bytes();
                    if let Some((i, b)) = damage {
                        let i = i.index(bytes.len());
                        // Mostly JSON punctuation and digits: the damage that parses.
                        const SET: &[u8] = b"0123456789,[]{}\" -.e ";
                        bytes[i] = SET[usize::from(b) % SET.len()];
                    }
                    bytes
                })
        }

        proptest! {
            /// Whenever the fast path accepts a body (and serde accepts the rest, as the
            /// caller requires), serde agrees on the whole body: the same ids, and the
            /// same other members.
            #[test]
            fn agrees_with_serde(bytes in body(0..40)) {
                agree_with_serde(&bytes)?;
            }

            /// Arrays long enough for the block scan.
            #[test]
            fn agrees_with_serde_on_long_arrays(bytes in body(90..400)) {
                agree_with_serde(&bytes)?;
            }

            /// Long arrays with ids of up to 10 digits, which the block scan leaves to the
            /// one-id-at-a-time loop.
            #[test]
            fn agrees_with_serde_on_long_arrays_of_any_ids(
                bytes in body_below(90..400, 1 << 32)
            ) {
                agree_with_serde(&bytes)?;
            }

            /// Long arrays of arbitrary digits, commas and other bytes never panic, and
            /// serde agrees with whatever is accepted.
            #[test]
            fn long_arrays_of_arbitrary_bytes_never_panic(
                inner in prop::collection::vec(
                    prop_oneof![
                        8 => prop::sample::select(b"0123456789".to_vec()),
                        3 => Just(b','),
                        1 => any::<u8>(),
                    ],
                    0..1_000,
                )
            ) {
                let mut bytes = br#"{"token_ids":["#.to_vec();
                bytes.extend_from_slice(&inner);
                bytes.extend_from_slice(b"]}");
                agree_with_serde(&bytes)?;
            }

            /// Arbitrary bytes never panic.
            #[test]
            fn never_panics(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
                let _ = split_token_ids(&bytes);
            }
        }

        fn agree_with_serde(bytes: &[u8]) -> Result<(), TestCaseError> {
            let Some((tokens, rest)) = split_token_ids(bytes) else {
                return Ok(());
            };
            let Ok(Value::Object(rest)) = serde_json::from_slice::<Value>(&rest) else {
                return Ok(());
            };
            let whole: Value = serde_json::from_slice(bytes).map_err(|e| {
                TestCaseError::fail(format!("fast path accepted invalid JSON: {e}"))
            })?;
            let Value::Object(mut whole) = whole else {
                return Err(TestCaseError::fail("fast path accepted a non-object"));
            };
            let ids: Vec<u32> =
                serde_json::from_value(whole.remove("token_ids").unwrap_or_default())
                    .map_err(|e| TestCaseError::fail(format!("serde rejects the ids: {e}")))?;
            prop_assert_eq!(ids, tokens);
            prop_assert_eq!(whole, rest);
            Ok(())
        }
    }

    /// The block scan and the one-id-at-a-time loop give the same result, whatever one byte
    /// of a long array is turned into: an empty id, a leading zero, an 8-digit id, the end,
    /// whitespace, in any block and at any position in it.
    #[test]
    fn the_block_scan_agrees_with_one_id_at_a_time_at_every_byte() {
        let ids: Vec<String> = (0..160u32)
            .map(|k| (k * 7_919 % 150_000).to_string())
            .collect();
        let clean = format!(r#"{{"m":"x","token_ids":[{}],"n":1}}"#, ids.join(","));
        let open = clean.find('[').unwrap() + 1;
        let one_at_a_time = |body: &[u8]| {
            let i = skip_ws(body, open);
            if body.get(i) == Some(&b']') {
                return Some((Vec::new(), i + 1));
            }
            finish_array(body, i, Vec::new())
        };
        let mut scanned = 0;
        for at in open..clean.len() {
            for byte in *b"0,] x-9" {
                let mut body = clean.clone().into_bytes();
                body[at] = byte;
                let mut out = Vec::new();
                if digit_scan::compact_ids(&body, open, &mut out) > open + 64 {
                    scanned += 1;
                }
                assert_eq!(
                    parse_token_array(&body, open - 1),
                    one_at_a_time(&body),
                    "byte {byte:?} at {at}"
                );
            }
        }
        // Most damage leaves whole blocks before it: the scan really ran.
        assert!(scanned > clean.len() * 5, "{scanned}");
    }

    #[test]
    fn first_non_digit_is_exact_for_every_byte_in_every_lane() {
        for lane in 0..8 {
            for byte in 0..=255u8 {
                // Digits below `lane`, the byte at `lane`, garbage above it.
                let mut word = [0xffu8; 8];
                word[..lane].fill(b'7');
                word[lane] = byte;
                let x = u64::from_le_bytes(word) ^ 0x3030_3030_3030_3030;
                let want = if byte.is_ascii_digit() {
                    // The next lane (0xff) is the first non-digit.
                    lane + 1
                } else {
                    lane
                };
                assert_eq!(
                    first_non_digit(x) as usize,
                    want,
                    "lane {lane} byte {byte:#x}"
                );
            }
        }
        let all_digits = u64::from_le_bytes(*b"01234567") ^ 0x3030_3030_3030_3030;
        assert_eq!(first_non_digit(all_digits), 8);
    }

    #[test]
    fn numbers_of_every_length_on_both_digit_paths() {
        // SWAR while 8 bytes remain, the plain loop at the tail; serde is the model.
        let numbers: Vec<u32> = (0..=10)
            .flat_map(|len| [10u64.pow(len) / 10 * 9 + 7, 10u64.pow(len)])
            .filter_map(|n| u32::try_from(n).ok())
            .chain([0, 9, 10, 99, 100, 127_999, 12_345_678, 99_999_999, u32::MAX])
            .collect();
        for sep in [",", " , ", ",\n  "] {
            let list = numbers
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(sep);
            let body = format!(r#"{{"token_ids":[{list}]}}"#);
            let want: Vec<u32> = serde_json::from_str(&format!("[{list}]")).unwrap();
            assert_eq!(split(&body), Some((want, "{}".to_owned())), "{body}");
        }
    }
}
