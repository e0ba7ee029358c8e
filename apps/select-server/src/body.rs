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
        let mut de = serde_json::Deserializer::from_slice(bytes);
        serde::de::IgnoredAny::deserialize(&mut de)
            .and_then(|_| de.end())
            .map_err(|e| classify(&e, "."))?;
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
        let path = e.path().to_string();
        classify(e.inner(), &path)
    })?;
    de.end().map_err(|e| classify(&e, "."))?;
    Ok(value)
}

/// The happy path of [`parse_json`] alone: `Some` when the body is within bounds, an object,
/// and deserializes without error; `None` means "ask [`parse_json`] for the exact error".
/// Lets a route try a faster body type that may refuse what the exact one accepts (e.g.
/// [`crate::dto::FastTokens`]) before falling back.
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
    Some(value)
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
/// Whether the body passes the depth and array-length bounds.
pub(crate) fn within_bounds(bytes: &[u8], limits: &BodyLimits) -> bool {
    check_bounds(bytes, limits).is_ok()
}

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
