//! Arbitrary bytes as the payload of both replica-sync topics (and as an unknown topic).
//! Must never panic; whatever decodes must re-encode and decode again.
#![no_main]

use libfuzzer_sys::fuzz_target;
use replica_sync::{SESSION_AFFINITY_TOPIC, SLOT_TRACKER_TOPIC, decode, encode};

fuzz_target!(|data: &[u8]| {
    let mut buf = Vec::new();
    for topic in [SLOT_TRACKER_TOPIC, SESSION_AFFINITY_TOPIC] {
        if let Ok(event) = decode(topic.as_bytes(), data) {
            buf.clear();
            if let Ok(t) = encode(&event, &mut buf) {
                assert!(
                    decode(t.as_str().as_bytes(), &buf).is_ok(),
                    "a decoded event re-encodes to bytes that decode"
                );
            }
        }
    }
    // The first bytes as a topic frame: unknown topics are rejected, never panic.
    let cut = data.len().min(32);
    let _ = decode(&data[..cut], &data[cut..]);
});
