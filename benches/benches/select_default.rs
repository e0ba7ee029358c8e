//! One default-policy selection over 2, 32, 128, 1,024 and 10,000 candidates at temperature
//! 0 and 0.7 (`scheduling.md` §4). Throughput is per candidate; target ≤ 30 ns each.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kv_types::WorkerKey;
use selection_policy::{
    CacheInputs, Candidate, Capacity, LoadInputs, PickRng, Policy, PoolLabel, RouterConfig,
    Scratch, SelectionContext,
};
use std::hint::black_box;

fn candidates(n: usize) -> Vec<Candidate> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    (0..n)
        .map(|i| Candidate {
            worker: WorkerKey::new(i as u64 / 4, (i % 4) as u32),
            cache: CacheInputs {
                device_blocks: next(64) as u32,
                host_blocks: next(16) as u32,
                disk_blocks: next(16) as u32,
                shared_beyond_blocks: 0,
            },
            load: Some(LoadInputs {
                active_prefill_tokens: next(20_000),
                potential_decode_blocks: next(4_000),
                active_requests: next(64),
            }),
            capacity: Capacity {
                max_num_batched_tokens: Some(16_384),
                total_kv_blocks: Some(8_192),
            },
            preferred_taint_multiplier: 1.0,
        })
        .collect()
}

fn select_default(c: &mut Criterion) {
    let mut group = c.benchmark_group("select_default");
    for temperature in [0.0, 0.7] {
        let config = RouterConfig {
            router_temperature: temperature,
            ..RouterConfig::default()
        };
        let policy = Policy::default_policy(&config, PoolLabel::Decode);
        for n in [2usize, 32, 128, 1_024, 10_000] {
            let rows = candidates(n);
            let ctx = SelectionContext::new(2_048, 16, 128);
            let mut scratch = Scratch::default();
            let mut rng = PickRng::seeded(7);
            group.throughput(Throughput::Elements(n as u64));
            group.bench_with_input(
                BenchmarkId::new(format!("t{temperature}"), n),
                &rows,
                |b, rows| {
                    b.iter(|| {
                        policy
                            .select(black_box(&ctx), black_box(rows), &mut scratch, &mut rng)
                            .map(|s| s.row)
                    })
                },
            );
        }
    }
    group.finish();
}

criterion_group!(benches, select_default);
criterion_main!(benches);
