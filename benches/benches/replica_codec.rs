//! Replica-sync codec (`replica-sync.md` §4): encode and decode of `AddRequest` admission
//! events with 32 tracking hashes (a 512-token prompt at block size 16), a prefill hint with
//! a duration, a LoRA name and a uint64 router id — what every booking costs on the
//! publishing replica (encode) and on each receiving replica (decode).

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kv_types::{SequenceHash, WorkerKey};
use replica_sync::{
    Admission, PrefillLoadHint, ReplicaEvent, RouterId, SLOT_TRACKER_TOPIC, SequenceEvent,
    SequenceEventKind, decode, encode,
};

const HASHES: u64 = 32;

fn admission(i: u64) -> ReplicaEvent {
    ReplicaEvent::Sequence(SequenceEvent {
        model_name: "meta-llama/Llama-3.1-8B-Instruct".into(),
        routing_group: "default".into(),
        block_size: 16,
        request_id: format!("sel-{i:016x}"),
        worker: WorkerKey::new(i % 128, 0),
        router_id: RouterId(0x9e37_79b9_7f4a_7c15),
        lora_name: Some("adapter-a".into()),
        kind: SequenceEventKind::AddRequest(Admission {
            tracking_hashes: Some(
                (0..HASHES)
                    .map(|b| SequenceHash(b.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i))
                    .collect(),
            ),
            track_prefill_tokens: true,
            expected_output_tokens: Some(256),
            prefill_load_hint: Some(PrefillLoadHint {
                initial_effective_prefill_tokens: 512,
                expected_prefill_duration: Some(Duration::from_micros(23_456)),
            }),
        }),
    })
}

fn replica_codec(c: &mut Criterion) {
    let events: Vec<ReplicaEvent> = (0..256).map(admission).collect();
    let payloads: Vec<Vec<u8>> = events
        .iter()
        .map(|e| {
            let mut buf = Vec::new();
            encode(e, &mut buf).expect("encodable");
            buf
        })
        .collect();

    let mut group = c.benchmark_group("replica_codec");
    group.throughput(Throughput::Elements(events.len() as u64));
    let mut buf = Vec::with_capacity(1024);
    group.bench_function("encode_admission", |b| {
        b.iter(|| {
            for e in &events {
                buf.clear();
                encode(black_box(e), &mut buf).expect("encodable");
                black_box(&buf);
            }
        })
    });
    group.bench_function("decode_admission", |b| {
        b.iter(|| {
            for p in &payloads {
                black_box(decode(SLOT_TRACKER_TOPIC.as_bytes(), black_box(p)).expect("valid"));
            }
        })
    });
    group.finish();
}

criterion_group!(benches, replica_codec);
criterion_main!(benches);
