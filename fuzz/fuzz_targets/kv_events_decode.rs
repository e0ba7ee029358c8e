//! Arbitrary bytes through the whole sans-IO path: live framing, batch decoding and the
//! stateful normalizer (filters, namespace propagation, re-hashing). Must never panic.
#![no_main]

use kv_events::{Normalizer, Spares, decode::parse_live_frames, decode_batch};
use kv_types::WorkerKey;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // First byte picks a frame split so framing errors are exercised too.
    let (split, rest) = data
        .split_first()
        .map_or((0, data), |(s, r)| (*s as usize, r));
    let cut = split.min(rest.len());
    let (seq, payload) = rest.split_at(cut);
    let _ = parse_live_frames(&[b"", seq, payload]);
    let _ = decode_batch(rest);
    let mut n = Normalizer::new(WorkerKey::new(1, 0), 4);
    let mut ops = Vec::new();
    let _ = n.process_payload(rest, 0, &mut ops, |_| {});
    let _ = n.process_payload(payload, 1, &mut ops, |_| {});
    // The listener's path: vectors reused from one payload to the next must give the same
    // operations as fresh ones.
    let mut spares = Spares::default();
    let mut fresh = Normalizer::new(WorkerKey::new(1, 0), 4);
    let mut reusing = Normalizer::new(WorkerKey::new(1, 0), 4);
    for (seq, bytes) in [rest, payload, rest].into_iter().enumerate() {
        let (mut want, mut got) = (Vec::new(), Vec::new());
        let a = fresh.process_payload(bytes, seq as u64, &mut want, |_| {});
        let b = reusing.process_payload_reusing(bytes, seq as u64, &mut got, &mut spares, |_| {});
        assert_eq!(a.is_ok(), b.is_ok());
        assert_eq!(want, got);
        spares.recycle(&mut got);
    }
});
