//! `index_lookup`: median `find_matches` of a 4k-token prompt against a 128-worker tree built
//! from the Mooncake conversation trace (block size 16 and 64), alone and while a writer
//! thread applies store/remove events to the same shared index.

mod index_common;

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use index_common as common;
use kv_index::{KvIndex, OverlapScores, SharedKvIndex};
use kv_types::WorkerKey;

fn index_lookup(c: &mut Criterion) {
    let trace = common::load_trace();
    let mut group = c.benchmark_group("index_lookup");
    for block_size in [16u32, 64] {
        let mut index = KvIndex::with_block_size(block_size);
        common::build(&mut index, &trace, block_size, 0);
        let stats = index.primary_stats();
        eprintln!(
            "block size {block_size}: {} nodes, {} memberships, {} workers",
            stats.nodes, stats.memberships, stats.workers
        );
        let prompts = common::prompts_4k(&trace, block_size, 1024);
        if prompts.is_empty() {
            continue;
        }
        let mut out = OverlapScores::new();
        let mut i = 0usize;
        group.bench_function(BenchmarkId::new("4k_prompt", block_size), |b| {
            b.iter(|| {
                i = (i + 1) % prompts.len();
                index.find_matches(black_box(&prompts[i]), &mut out);
                black_box(out.len())
            })
        });

        // Same lookups while another thread keeps writing (one event per write section).
        let shared = Arc::new(SharedKvIndex::new(index));
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let shared = Arc::clone(&shared);
            let stop = Arc::clone(&stop);
            let churn: Vec<_> = trace
                .iter()
                .skip(trace.len() / 2)
                .take(2000)
                .enumerate()
                .map(|(k, ids)| {
                    let w = WorkerKey::new(200 + (k as u64 % 64), 0);
                    let l = common::locals(ids, block_size);
                    (common::store_op(w, &l), common::remove_op(w, &l))
                })
                .collect();
            std::thread::spawn(move || {
                let mut events = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for (store, remove) in &churn {
                        shared.apply(store);
                        shared.apply(remove);
                        events += 2;
                    }
                }
                events
            })
        };
        group.bench_function(
            BenchmarkId::new("4k_prompt_during_writes", block_size),
            |b| {
                b.iter(|| {
                    i = (i + 1) % prompts.len();
                    shared.find_matches(black_box(&prompts[i]), &mut out);
                    black_box(out.len())
                })
            },
        );
        stop.store(true, Ordering::Relaxed);
        let events = writer.join().unwrap_or(0);
        eprintln!("writer applied {events} events during the run");
    }
    group.finish();
}

criterion_group!(benches, index_lookup);
criterion_main!(benches);
