//! KV-event ingestion: decode + filter + re-hash of a realistic batch (32 `BlockStored`
//! events × 16 blocks × 16 tokens, block size 16), as one listener thread does per batch.
//!
//! Run: `cargo bench -p benches --bench events -- --warm-up-time 1 --measurement-time 3`.

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kv_events::{Normalizer, decode_batch};
use kv_types::{KvOperation, WorkerKey};

const EVENTS: u32 = 32;
const BLOCKS: u32 = 16;
const BLOCK_SIZE: u32 = 16;

/// `[ts, [["BlockStored", hashes, parent, tokens, 16, nil, "GPU"], …], 0]`, vLLM positional.
fn payload() -> Vec<u8> {
    use rmp::encode::*;
    let mut out = Vec::new();
    let w = &mut out;
    write_array_len(w, 3).expect("vec write");
    write_f64(w, 1_700_000_000.5).expect("vec write");
    write_array_len(w, EVENTS).expect("vec write");
    let mut token = 1000u32;
    for e in 0..EVENTS {
        write_array_len(w, 7).expect("vec write");
        write_str(w, "BlockStored").expect("vec write");
        write_array_len(w, BLOCKS).expect("vec write");
        for b in 0..BLOCKS {
            // Large hashes, as engines emit (8-byte encodings, some negative).
            let h = (u64::from(e) << 32 | u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            write_sint(w, h as i64).expect("vec write");
        }
        write_nil(w).expect("vec write");
        write_array_len(w, BLOCKS * BLOCK_SIZE).expect("vec write");
        for _ in 0..BLOCKS * BLOCK_SIZE {
            write_uint(w, u64::from(token)).expect("vec write");
            token = token.wrapping_mul(31).wrapping_add(7) % 150_000;
        }
        write_uint(w, u64::from(BLOCK_SIZE)).expect("vec write");
        write_nil(w).expect("vec write");
        write_str(w, "GPU").expect("vec write");
    }
    write_sint(w, 0).expect("vec write");
    out
}

fn bench_events(c: &mut Criterion) {
    let payload = payload();
    let mut group = c.benchmark_group("events");

    group.throughput(Throughput::Elements(u64::from(EVENTS * BLOCKS)));
    group.bench_function("decode_convert_32x16_blocks", |b| {
        let mut n = Normalizer::new(WorkerKey::new(1, 0), BLOCK_SIZE);
        let mut ops: Vec<KvOperation> = Vec::with_capacity(EVENTS as usize);
        b.iter_batched_ref(
            || (),
            |()| {
                ops.clear();
                n.process_payload(&payload, 1, &mut ops, |_| {})
                    .expect("valid payload");
                std::hint::black_box(&ops);
            },
            BatchSize::SmallInput,
        );
    });

    group.throughput(Throughput::Elements(u64::from(EVENTS)));
    group.bench_function("decode_only_32_events", |b| {
        b.iter(|| std::hint::black_box(decode_batch(&payload).expect("valid payload")));
    });
    group.finish();
}

criterion_group!(benches, bench_events);
criterion_main!(benches);
