//! `index_apply`: stored + removed block operations per second on one core. A 64-worker
//! churn set (1,000 Mooncake requests, block size 16) is stored and then removed again on
//! top of a steady 128-worker tree built from the first half of the trace.
//!
//! The `capacity_*` variants run the same operations with a declared capacity
//! (`total_kv_blocks`) on every churn worker: `unreached` never evicts (what declaring a
//! capacity costs), `evicting` (2,048 blocks per worker) makes every iteration's stores
//! evict about three quarters of what they add (the cost of workers whose removals are
//! lost). Each variant prints what one iteration evicts.

mod index_common;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use index_common as common;
use kv_index::KvIndex;
use kv_types::{KvOperation, KvOperationKind, WorkerKey};

const CHURN_WORKERS: u64 = 64;

fn index_apply(c: &mut Criterion) {
    let trace = common::load_trace();
    let block_size = 16;
    let mut group = c.benchmark_group("index_apply");
    for (name, capacity) in [
        ("store_then_remove_1000_requests_bs16", None),
        (
            "store_then_remove_1000_requests_bs16_capacity_unreached",
            Some(u32::MAX),
        ),
        (
            "store_then_remove_1000_requests_bs16_capacity_evicting",
            Some(2048),
        ),
    ] {
        // The tree first, then the operations (the order the allocations had before the
        // variants existed, which the figures in docs/hot-path.md depend on).
        let mut index = KvIndex::with_block_size(block_size);
        common::build(&mut index, &trace[..trace.len() / 2], block_size, 0);
        for w in 0..CHURN_WORKERS {
            index.set_capacity(WorkerKey::new(200 + w, 0), capacity);
        }
        let ops: Vec<(KvOperation, KvOperation)> = trace
            .iter()
            .skip(trace.len() / 2)
            .take(1000)
            .enumerate()
            .map(|(k, ids)| {
                let w = WorkerKey::new(200 + (k as u64 % CHURN_WORKERS), 0);
                let l = common::locals(ids, block_size);
                (common::store_op(w, &l), common::remove_op(w, &l))
            })
            .collect();
        let block_ops: u64 = ops
            .iter()
            .map(|(s, _)| match &s.kind {
                KvOperationKind::Stored { blocks, .. } => 2 * blocks.len() as u64,
                _ => 0,
            })
            .sum();
        group.throughput(Throughput::Elements(block_ops));
        let pass = |index: &mut KvIndex| {
            for (store, _) in &ops {
                index.apply(store);
            }
            for (_, remove) in &ops {
                index.apply(remove);
            }
        };
        group.bench_function(name, |b| b.iter(|| pass(&mut index)));
        let before = index.counters().capacity_evicted;
        pass(&mut index);
        eprintln!(
            "{name}: an iteration stores {} blocks and evicts {}",
            block_ops / 2,
            index.counters().capacity_evicted - before
        );
    }
    group.finish();
}

criterion_group!(benches, index_apply);
criterion_main!(benches);
