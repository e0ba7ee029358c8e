//! Load ledger: book + prefill_complete + free cycles with 128 ranks and 10 k live
//! reservations (`scheduling.md` §6). Target ≥ 2 M cycles/s on one core.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kv_types::{SequenceHash, WorkerKey};
use load_accounting::{BookRequest, Ledger, LedgerConfig, ReservationId, SlotPolicy};
use std::hint::black_box;
use std::time::Instant;

const RANKS: u64 = 128;
const LIVE: usize = 10_000;
const BLOCKS: u64 = 8;

/// Tracking chains: 16 shared system prompts of 4 blocks, then 4 blocks of their own.
fn chain(i: u64) -> Vec<SequenceHash> {
    (0..BLOCKS)
        .map(|b| {
            if b < 4 {
                SequenceHash((i % 16) << 8 | b)
            } else {
                SequenceHash(i << 8 | b)
            }
        })
        .collect()
}

fn ledger(c: &mut Criterion) {
    let now = Instant::now();
    let mut ledger = Ledger::new(LedgerConfig::default());
    for i in 0..LIVE as u64 {
        let hashes = chain(i);
        let req = BookRequest::new(WorkerKey::new(i % RANKS, 0), &hashes, 128).with_prefill(64);
        ledger
            .book(
                format!("live-{i}").into(),
                &req,
                SlotPolicy::CreateMissing,
                now,
            )
            .expect("fresh id");
    }
    let ids: Vec<ReservationId> = (0..1_024).map(|i| format!("cycle-{i}").into()).collect();
    let chains: Vec<Vec<SequenceHash>> = (0..1_024).map(|i| chain(LIVE as u64 + i)).collect();
    let mut group = c.benchmark_group("ledger");
    group.throughput(Throughput::Elements(1));
    let mut k = 0usize;
    group.bench_function("book_prefill_complete_free", |b| {
        b.iter(|| {
            let i = k % ids.len();
            k += 1;
            let req = BookRequest::new(WorkerKey::new(i as u64 % RANKS, 0), &chains[i], 128)
                .with_prefill(64);
            let id = &ids[i];
            let seq = ledger.book(id.clone(), black_box(&req), SlotPolicy::CreateMissing, now);
            let done = ledger.prefill_complete(id.as_str());
            let freed = ledger.free(id.as_str());
            black_box((seq.is_ok(), done.is_ok(), freed.is_ok()))
        })
    });
    group.finish();
}

criterion_group!(benches, ledger);
criterion_main!(benches);
