//! `index_apply`: stored + removed block operations per second on one core. A 64-worker
//! churn set (1,000 Mooncake requests, block size 16) is stored and then removed again on
//! top of a steady 128-worker tree built from the first half of the trace.

mod index_common;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use index_common as common;
use kv_index::KvIndex;
use kv_types::{KvOperationKind, WorkerKey};

fn index_apply(c: &mut Criterion) {
    let trace = common::load_trace();
    let block_size = 16;
    let mut index = KvIndex::with_block_size(block_size);
    common::build(&mut index, &trace[..trace.len() / 2], block_size, 0);
    let ops: Vec<_> = trace
        .iter()
        .skip(trace.len() / 2)
        .take(1000)
        .enumerate()
        .map(|(k, ids)| {
            let w = WorkerKey::new(200 + (k as u64 % 64), 0);
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
    let mut group = c.benchmark_group("index_apply");
    group.throughput(Throughput::Elements(block_ops));
    group.bench_function("store_then_remove_1000_requests_bs16", |b| {
        b.iter(|| {
            for (store, _) in &ops {
                index.apply(store);
            }
            for (_, remove) in &ops {
                index.apply(remove);
            }
        })
    });
    group.finish();
}

criterion_group!(benches, index_apply);
criterion_main!(benches);
