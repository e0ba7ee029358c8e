//! Prompt hashing: public block hashes + public chain, and keyed tracking hashes, for
//! 1, 32, 128, 256 and 62,500 blocks of 16 tokens (62,500 blocks = a 1 M-token prompt).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kv_types::{HashOptions, TrackingHasher, TrackingKey, TrackingScope};
use std::hint::black_box;

const BLOCK: u32 = 16;

fn hashing(c: &mut Criterion) {
    let keyed = TrackingHasher::Keyed {
        key: TrackingKey::new([7; 32]),
        key_id: "epoch-1".into(),
    };
    let scope = TrackingScope {
        model_name: "model-a",
        routing_group: "default",
        block_size: BLOCK,
        ..Default::default()
    };
    let mut blocks = Vec::new();
    let mut seqs = Vec::new();
    let mut group = c.benchmark_group("hashing");
    for n_blocks in [1usize, 32, 128, 256, 62_500] {
        let tokens = benches::tokens(n_blocks * BLOCK as usize, 42);
        group.throughput(Throughput::Bytes((tokens.len() * 4) as u64));
        group.bench_with_input(
            BenchmarkId::new("public_blocks_and_chain", n_blocks),
            &tokens,
            |b, t| {
                b.iter(|| {
                    kv_types::block_hashes_into(
                        black_box(t),
                        BLOCK,
                        &HashOptions::default(),
                        &mut blocks,
                    );
                    kv_types::sequence_hashes_into(&blocks, &mut seqs);
                    black_box(seqs.last().copied())
                })
            },
        );
        group.bench_with_input(
            BenchmarkId::new("public_one_pass", n_blocks),
            &tokens,
            |b, t| {
                b.iter(|| {
                    kv_types::prompt_hashes_into(
                        black_box(t),
                        BLOCK,
                        &HashOptions::default(),
                        &mut blocks,
                        &mut seqs,
                    );
                    black_box(seqs.last().copied())
                })
            },
        );
        group.bench_with_input(
            BenchmarkId::new("keyed_tracking", n_blocks),
            &tokens,
            |b, t| {
                b.iter(|| {
                    keyed.tracking_hashes_into(&scope, black_box(t), &[], &[], &mut seqs);
                    black_box(seqs.last().copied())
                })
            },
        );
    }
    group.finish();
}

criterion_group!(benches, hashing);
criterion_main!(benches);
