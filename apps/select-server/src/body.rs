//! Body rejections of `http-api.md` §1.4 plus the bounds of `beyond-reference.md` #1/#9.
//!
//! Order, as in the reference's extractor: content type (415) → buffering (413, or 408
//! when the body stalls) → JSON syntax (400) → shape (422). The nesting/array pre-scan runs before serde so that a hostile
//! body costs one linear pass and no allocation beyond the buffered bytes.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode, header};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Body;
use serde::Deserialize as _;
use serde::de::DeserializeOwned;

use crate::ApiError;

/// Bounds applied to every request body.
#[derive(Clone, Debug)]
pub struct BodyLimits {
    /// Maximum body size in bytes (contract: 8 MiB).
    pub max_body_bytes: usize,
    /// Maximum nesting depth of arrays/objects, counting the top-level value as 1.
    pub max_json_depth: usize,
    /// Maximum number of elements of any one JSON array (`token_ids` included).
    pub max_array_len: usize,
    /// Longest wait for a whole body once the request head is in. A client that stalls
    /// mid-body gets 408 and its connection is closed; without this, such a connection
    /// held its descriptor for good (the head timeout ends with the head).
    pub body_timeout: Duration,
}

impl Default for BodyLimits {
    fn default() -> Self {
        Self {
            max_body_bytes: 8 * 1024 * 1024,
            max_json_depth: 32,
            max_array_len: 2 * 1024 * 1024,
            body_timeout: Duration::from_secs(30),
        }
    }
}

const PARSE_PREFIX: &str = "Failed to parse the request body as JSON";
const SHAPE_PREFIX: &str = "Failed to deserialize the JSON body into the target type";

/// `application/json` with any parameters, or any `application/*+json` (case-insensitive).
pub(crate) fn is_json_content_type(headers: &HeaderMap) -> bool {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return false;
    };
    let Ok(value) = value.to_str() else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or("").trim();
    let Some((ty, subtype)) = essence.split_once('/') else {
        return false;
    };
    ty.eq_ignore_ascii_case("application")
        && (subtype.eq_ignore_ascii_case("json")
            || subtype.len() > 5
                && subtype.as_bytes()[subtype.len() - 5..].eq_ignore_ascii_case(b"+json"))
}

/// Content type check and buffering under the size limit.
pub(crate) async fn read_json_body<B>(
    headers: &HeaderMap,
    body: B,
    limits: &BodyLimits,
) -> Result<Bytes, ApiError>
where
    B: Body + Send,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    if !is_json_content_type(headers) {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "Expected request with `Content-Type: application/json`",
        ));
    }
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "Failed to buffer the request body: length limit exceeded",
        )
    };
    // A declared length over the limit is rejected without reading a byte.
    if let Some(len) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && len > limits.max_body_bytes as u64
    {
        return Err(too_large());
    }
    let collected = tokio::time::timeout(
        limits.body_timeout,
        Limited::new(body, limits.max_body_bytes).collect(),
    )
    .await
    .map_err(|_| {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request body did not arrive within {:?}",
                limits.body_timeout
            ),
        )
    })?;
    match collected {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(too_large()),
        Err(e) => Err(ApiError::bad_request(format!(
            "Failed to buffer the request body: {e}"
        ))),
    }
}

/// Parses a buffered body: bounds pre-scan, then serde with field paths; trailing bytes after
/// the value are a syntax error (whitespace is fine).
pub(crate) fn parse_json<T: DeserializeOwned>(
    bytes: &[u8],
    limits: &BodyLimits,
) -> Result<T, ApiError> {
    if let Some(value) = try_parse_json(bytes, limits) {
        return Ok(value);
    }
    // Parsing is deterministic, so this slower, tracked pass fails where the fast one did
    // and names the field.
    check_bounds(bytes, limits)?;
    let first = bytes.iter().copied().find(|b| !b.is_ascii_whitespace());
    if first != Some(b'{') {
        // Every request body is an object. serde's derived structs would also accept an
        // array of positional fields, which the contract rejects. Syntax errors (an empty
        // body included) still win: they are 400, not 422.
        parse_as_value(bytes).map_err(|e| classify(&e, "."))?;
        let kind = match first {
            Some(b'[') => "sequence",
            Some(b'"') => "string",
            Some(b't' | b'f') => "boolean",
            Some(b'n') => "null",
            _ => "number",
        };
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("{SHAPE_PREFIX}: invalid type: {kind}, expected a JSON object"),
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        // Syntax before shape: a shape error met before the part serde_json cannot parse
        // (a bad number or string further on, in a member this type skips) is still a 400.
        if let serde_json::error::Category::Data = e.inner().classify()
            && let Err(syntax) = parse_as_value(bytes)
        {
            return classify(&syntax, ".");
        }
        let path = e.path().to_string();
        classify(e.inner(), &path)
    })?;
    de.end().map_err(|e| classify(&e, "."))?;
    check_skipped_values(bytes).map_err(|e| classify(&e, "."))?;
    Ok(value)
}

/// The happy path of [`parse_json`] alone: `Some` when the body is within bounds, an object,
/// and deserializes without error; `None` means "ask [`parse_json`] for the exact error".
/// Lets a route try a faster parse that may refuse what the exact one accepts (the selection
/// body with its `token_ids` cut out, [`crate::dto::WireSelection::parse_fast`]) before
/// falling back.
pub(crate) fn try_parse_json<T: DeserializeOwned>(bytes: &[u8], limits: &BodyLimits) -> Option<T> {
    check_bounds(bytes, limits).ok()?;
    if bytes.iter().copied().find(|b| !b.is_ascii_whitespace()) != Some(b'{') {
        return None;
    }
    // Without path tracking: it costs about a third of the parse of a long `token_ids` array
    // (docs/hot-path.md), and only an error message needs the path.
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = T::deserialize(&mut de).ok()?;
    de.end().ok()?;
    check_skipped_values(bytes).ok()?;
    Some(value)
}

/// Rejects what `serde_json` rejects in a value that a typed parse skipped. A struct skips a
/// member it does not know (serde's `IgnoredAny`), and serde_json checks a skipped value's
/// syntax but not what only keeping it reveals: a number out of `f64` range (`1e400`), a
/// string that is not UTF-8 or escapes a lone surrogate, nesting past serde_json's
/// recursion limit. The contract answers 400 to every body serde_json cannot parse.
///
/// [`plainly_skippable`] proves most bodies free of all four in one cheap pass; only the
/// others are walked again, by [`KeptValue`], which sees every value as
/// `serde_json::Value` would without building one.
fn check_skipped_values(bytes: &[u8]) -> Result<(), serde_json::Error> {
    if plainly_skippable(bytes) {
        return Ok(());
    }
    parse_as_value(bytes)
}

/// Whether serde_json parses `bytes` as one JSON value, checked the way
/// `serde_json::Value` parses without building one.
fn parse_as_value(bytes: &[u8]) -> Result<(), serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    KeptValue::deserialize(&mut de)?;
    de.end()
}

/// Whether skipping any value of `bytes` accepts only what keeping it would, judged from
/// bytes alone: an out-of-range number needs an exponent (a digit directly followed by `e` or
/// `E`) or a run of at least 309 digits, which fills some aligned 155-byte block; a bad
/// string needs a byte above ASCII or a backslash; the recursion limit (128) needs as many
/// openers. A string can trip these too, which only costs the exact walk.
fn plainly_skippable(bytes: &[u8]) -> bool {
    const BLOCK: usize = 155;
    let (mut unusual, mut openers) = (false, 0usize);
    for block in bytes.chunks(BLOCK) {
        // Branch-free per byte, so the loop vectorizes; u8 counters cannot overflow a block.
        let (mut digits, mut opens, mut odd) = (0u8, 0u8, 0u8);
        for &b in block {
            digits += u8::from(b.is_ascii_digit());
            opens += u8::from((b == b'[') | (b == b'{'));
            odd |= u8::from((b >= 0x80) | (b == b'\\'));
        }
        openers += usize::from(opens);
        unusual |= (odd != 0) | (usize::from(digits) == BLOCK);
    }
    let exponent = bytes
        .iter()
        .zip(&bytes[1.min(bytes.len())..])
        .fold(false, |seen, (&a, &b)| {
            seen | (a.is_ascii_digit() & ((b | 0x20) == b'e'))
        });
    !unusual && !exponent && openers < 128
}

/// Any JSON value, deserialized the way `serde_json::Value` is (`deserialize_any`: numbers
/// converted, strings decoded) and dropped.
struct KeptValue;

impl<'de> serde::Deserialize<'de> for KeptValue {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(KeptValue)
    }
}

impl<'de> serde::de::Visitor<'de> for KeptValue {
    type Value = KeptValue;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self, E> {
        Ok(self)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self, E> {
        Ok(self)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self, E> {
        Ok(self)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self, E> {
        Ok(self)
    }

    fn visit_str<E>(self, _: &str) -> Result<Self, E> {
        Ok(self)
    }

    fn visit_unit<E>(self) -> Result<Self, E> {
        Ok(self)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self, A::Error> {
        while seq.next_element::<KeptValue>()?.is_some() {}
        Ok(self)
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self, A::Error> {
        while map.next_entry::<KeptValue, KeptValue>()?.is_some() {}
        Ok(self)
    }
}

fn classify(e: &serde_json::Error, path: &str) -> ApiError {
    let detail = if path.is_empty() || path == "." {
        e.to_string()
    } else {
        format!("{path}: {e}")
    };
    match e.classify() {
        serde_json::error::Category::Data => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("{SHAPE_PREFIX}: {detail}"),
        ),
        _ => ApiError::bad_request(format!("{PARSE_PREFIX}: {detail}")),
    }
}

/// Linear scan enforcing nesting depth and array length. It only has to be right on valid
/// JSON; on invalid JSON whatever it reports is still a 4xx and serde reports the rest.
fn check_bounds(bytes: &[u8], limits: &BodyLimits) -> Result<(), ApiError> {
    if trivially_within_bounds(bytes, limits) {
        return Ok(());
    }
    // Per open container: `Some(separators seen)` for arrays, `None` for objects.
    let mut stack: Vec<Option<usize>> = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                i += 1;
                while i < bytes.len() {
                    match bytes[i] {
                        b'\\' => i += 2,
                        b'"' => break,
                        _ => i += 1,
                    }
                }
            }
            open @ (b'[' | b'{') => {
                if stack.len() >= limits.max_json_depth {
                    return Err(ApiError::bad_request(format!(
                        "{PARSE_PREFIX}: nesting depth exceeds {} at byte {i}",
                        limits.max_json_depth
                    )));
                }
                stack.push((open == b'[').then_some(0));
            }
            b']' | b'}' => {
                stack.pop();
            }
            b',' => {
                if let Some(Some(separators)) = stack.last_mut() {
                    *separators += 1;
                    // n separators ⇒ n + 1 elements
                    if *separators >= limits.max_array_len {
                        return Err(ApiError::new(
                            StatusCode::UNPROCESSABLE_ENTITY,
                            format!(
                                "{SHAPE_PREFIX}: array has more than {} elements",
                                limits.max_array_len
                            ),
                        ));
                    }
                }
            }
            _ => {}
        }
        i += 1;
    }
    Ok(())
}

/// Whether the counts of openers and commas alone prove the bounds hold: a chain of depth `d`
/// needs `d` openers and an array of `n` elements `n - 1` commas, and counting inside strings
/// too only over-estimates. Typical bodies (a few openers, a few thousand commas) pass, and
/// this branch-free count vectorizes, unlike the exact scan it skips (about 10x faster on a
/// 14 KB `token_ids` body).
fn trivially_within_bounds(bytes: &[u8], limits: &BodyLimits) -> bool {
    let (mut openers, mut commas) = (0usize, 0usize);
    // u8 counters over chunks that cannot overflow them: 16/32 bytes per SIMD compare.
    for chunk in bytes.chunks(255) {
        let (mut o, mut c) = (0u8, 0u8);
        for &b in chunk {
            o += u8::from((b == b'[') | (b == b'{'));
            c += u8::from(b == b',');
        }
        openers += usize::from(o);
        commas += usize::from(c);
    }
    openers <= limits.max_json_depth && commas < limits.max_array_len
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ct(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, v.parse().unwrap());
        h
    }

    #[test]
    fn content_types() {
        for ok in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/vnd.api+json",
            "application/problem+JSON;x=y",
        ] {
            assert!(is_json_content_type(&ct(ok)), "{ok}");
        }
        for bad in [
            "text/plain",
            "application/jsonx",
            "application/+json",
            "json",
            "",
        ] {
            assert!(!is_json_content_type(&ct(bad)), "{bad}");
        }
        assert!(!is_json_content_type(&HeaderMap::new()));
    }

    fn limits(depth: usize, len: usize) -> BodyLimits {
        BodyLimits {
            max_body_bytes: 1 << 20,
            max_json_depth: depth,
            max_array_len: len,
            ..BodyLimits::default()
        }
    }

    #[test]
    fn bounds() {
        let l = limits(3, 3);
        assert!(check_bounds(br#"{"a":[[1,2,3]]}"#, &l).is_ok());
        assert_eq!(
            check_bounds(br#"{"a":[[[1]]]}"#, &l).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            check_bounds(br#"[1,2,3,4]"#, &l).unwrap_err().status,
            StatusCode::UNPROCESSABLE_ENTITY
        );
        // brackets and commas inside strings (with escapes) do not count
        assert!(check_bounds(br#"{"a":"[[[[,,,,\"[[[["}"#, &l).is_ok());
        // object members are not array elements
        assert!(check_bounds(br#"{"a":1,"b":2,"c":3,"d":4}"#, &l).is_ok());
    }

    #[test]
    fn the_counting_shortcut_agrees_with_the_exact_scan_at_the_limits() {
        // Exactly at each limit passes, one over fails, whichever path decides.
        let l = limits(3, 3);
        for (body, ok) in [
            (&br#"[[[1,2,3]]]"#[..], true),
            (br#"[[[[1]]]]"#, false),
            (br#"[1,2,3]"#, true),
            (br#"[1,2,3,4]"#, false),
            // over-counted by the shortcut (strings, sibling arrays), accepted by the scan
            (br#"{"a":"[[[[,,,,","b":[1,2],"c":[3,4]}"#, true),
        ] {
            assert_eq!(
                check_bounds(body, &l).is_ok(),
                ok,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        assert!(trivially_within_bounds(br#"[[[1,2,3]]]"#, &l));
        assert!(!trivially_within_bounds(br#"[1,2,3,4]"#, &l));
        let long = format!("{{\"token_ids\":[{}]}}", vec!["123456"; 4096].join(","));
        assert!(trivially_within_bounds(
            long.as_bytes(),
            &BodyLimits::default()
        ));
    }

    #[test]
    fn errors_after_the_fast_path_still_name_the_field() {
        #[derive(Debug, serde::Deserialize)]
        struct T {
            #[expect(dead_code, reason = "only the error matters")]
            token_ids: Vec<u32>,
        }
        let l = BodyLimits::default();
        let e = parse_json::<T>(br#"{"token_ids":[1,2,-3]}"#, &l).unwrap_err();
        assert_eq!(e.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(e.message.contains("token_ids[2]"), "{}", e.message);
        let e = parse_json::<T>(br#"{"token_ids":[1,2}"#, &l).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
    }

    /// A body type that knows one member and skips the rest, as every request DTO does.
    #[derive(Debug, serde::Deserialize)]
    struct Known {
        #[expect(dead_code, reason = "only acceptance matters")]
        #[serde(default)]
        a: Option<u32>,
    }

    /// What the contract accepts: exactly the bodies serde_json parses.
    fn serde_json_parses(body: &[u8]) -> bool {
        serde_json::from_slice::<serde_json::Value>(body).is_ok()
    }

    #[test]
    fn skipped_members_are_rejected_where_serde_json_rejects_them() {
        let l = BodyLimits::default();
        let deep = format!("{{\"x\":{}1{}}}", "[".repeat(130), "]".repeat(130));
        let (nines_309, nines_308) = (
            format!(r#"{{"foo": {}}}"#, "9".repeat(309)),
            format!(r#"{{"foo": {}}}"#, "9".repeat(308)),
        );
        let deep_limits = BodyLimits {
            max_json_depth: 200,
            ..BodyLimits::default()
        };
        let cases: &[(&[u8], &BodyLimits, Option<&str>)] = &[
            (
                br#"{"foo": 1e400}"#,
                &l,
                Some("number out of range at line 1 column 13"),
            ),
            (br#"{"foo": -1.5E+309}"#, &l, Some("number out of range")),
            (
                br#"{"a":1,"foo":{"x":[1,2e999]}}"#,
                &l,
                Some("number out of range"),
            ),
            (nines_309.as_bytes(), &l, Some("number out of range")),
            (br#"{"foo": "\ud800"}"#, &l, Some("hex escape")),
            (
                b"{\"foo\": \"\xff\"}",
                &l,
                Some("invalid unicode code point"),
            ),
            (b"{\"\xc3\": 1}", &l, Some("invalid unicode code point")),
            (
                deep.as_bytes(),
                &deep_limits,
                Some("recursion limit exceeded"),
            ),
            // syntax before shape: a wrong type met first does not hide the bad number
            (
                br#"{"a": "no", "foo": 1e400}"#,
                &l,
                Some("number out of range"),
            ),
            // what serde_json keeps fine stays accepted
            (
                br#"{"foo": 1e-400, "bar": 1e308, "baz": "1e400"}"#,
                &l,
                None,
            ),
            (nines_308.as_bytes(), &l, None),
            (
                b"{\"foo\": \"\\ud83d\\ude00 caf\\u00e9\", \"b\": \"caf\xc3\xa9\"}",
                &l,
                None,
            ),
            (br#"{"a": 7, "m1e": [0, -0.5e3]}"#, &l, None),
        ];
        for (body, limits, error) in cases {
            let shown = String::from_utf8_lossy(body);
            let got = parse_json::<Known>(body, limits);
            assert_eq!(got.is_ok(), serde_json_parses(body), "{shown}");
            match error {
                Some(needle) => {
                    let e = got.unwrap_err();
                    assert_eq!(e.status, StatusCode::BAD_REQUEST, "{shown}");
                    assert!(e.message.starts_with(PARSE_PREFIX), "{}", e.message);
                    assert!(e.message.contains(needle), "{shown}: {}", e.message);
                    assert!(try_parse_json::<Known>(body, limits).is_none(), "{shown}");
                }
                None => assert!(try_parse_json::<Known>(body, limits).is_some(), "{shown}"),
            }
        }
    }

    proptest::proptest! {
        /// Bodies built from the pieces that decide it (digits, exponents, escapes, bytes above
        /// ASCII, nesting): a skipping parse accepts exactly what serde_json parses.
        #[test]
        fn skipping_accepts_exactly_what_serde_json_parses(
            pieces in proptest::collection::vec(0usize..14, 0..12),
        ) {
            const PIECES: [&[u8]; 14] = [
                b"1", b"9", b"0", b"e", b"E", b"+", b"-", b".", b"\\u", b"d8", b"00", b"\xc3",
                b"\xa9", b"a",
            ];
            let inner: Vec<u8> = pieces.iter().flat_map(|&i| PIECES[i].iter().copied()).collect();
            for body in [
                [&b"{\"x\":"[..], &inner, b"}"].concat(),
                [&b"{\"x\":\""[..], &inner, b"\"}"].concat(),
                [&b"{\"x\":[\""[..], &inner, b"\",1]}"].concat(),
            ] {
                let l = BodyLimits::default();
                proptest::prop_assert_eq!(
                    parse_json::<Known>(&body, &l).is_ok(),
                    serde_json_parses(&body),
                    "{}",
                    String::from_utf8_lossy(&body)
                );
            }
        }
    }

    #[test]
    fn trailing_bytes_are_a_syntax_error() {
        let l = BodyLimits::default();
        let e =
            parse_json::<serde_json::Value>(br#"{"worker_id":1}{"worker_id":2}"#, &l).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.starts_with(PARSE_PREFIX), "{}", e.message);
        assert!(parse_json::<serde_json::Value>(b"{\"a\":1}  \n\t", &l).is_ok());
    }
}
