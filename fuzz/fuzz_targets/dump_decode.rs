//! Arbitrary bytes as a peer's `/dump` body (startup recovery reads it from the network).
//! Must never panic; whatever decodes must survive an encode/decode round trip unchanged.
#![no_main]

use kv_index::snapshot::{DecodeLimits, decode_dump, encode_dump};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = DecodeLimits::default();
    if let Ok(dump) = decode_dump(data, &limits)
        && let Ok(bytes) = encode_dump(&dump)
    {
        let again = decode_dump(&bytes, &limits);
        assert!(
            again.as_ref().is_ok_and(|d| *d == dump),
            "dump round trip: {again:?}"
        );
    }
});
