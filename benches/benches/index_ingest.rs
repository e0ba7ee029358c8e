//! `index_ingest`: the stream of `cargo xtask bench ingest` (default workload,
//! `benches::ingest_stream`) applied to one index on one thread, without decoding,
//! sockets or locks: the index's share of the ingestion, in blocks per second. Every
//! iteration fills a fresh index (about 4 M nodes) and drops it outside the timing, so the
//! figure includes the page faults of a growing index, as the server pays them once.
//!
//! The same stream through an `IndexCell`, a batch per write as the listeners write, with
//! one copy and with two (the index and its mirror): what the mirror costs a writer; and
//! from two writer threads taking turns, as two listener threads share one partition.
//! `cargo xtask instructions --ingest` counts the instructions of the same stream.

use benches::ingest_stream::{STREAM_BLOCKS, empty_index, stream};
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kv_index::{IndexCell, IndexCopies};
use kv_types::KvOperation;

fn index_ingest(c: &mut Criterion) {
    let batches = stream();
    let mut group = c.benchmark_group("index_ingest");
    group.sample_size(10);
    group.throughput(Throughput::Elements(STREAM_BLOCKS));
    group.bench_function("bench_ingest_stream_16_workers", |b| {
        b.iter_batched(
            empty_index,
            |mut index| {
                for batch in &batches {
                    for op in batch {
                        index.apply(op);
                    }
                }
                index
            },
            BatchSize::PerIteration,
        );
    });
    // Two writer threads, each with the batches of half the workers, as two listener
    // threads share the workers: what the writers' turns cost on top.
    let halves: [Vec<&Vec<KvOperation>>; 2] = [0, 1].map(|half| {
        batches
            .iter()
            .filter(|b| {
                b.first()
                    .is_some_and(|op| op.worker.worker_id.0 % 2 == half)
            })
            .collect()
    });
    for (name, copies) in [
        ("cell_one_copy_two_writers", IndexCopies::One),
        ("cell_two_copies_two_writers", IndexCopies::Two),
    ] {
        group.bench_function(name, |b| {
            b.iter_batched(
                || IndexCell::new(copies, None, empty_index),
                |cell| {
                    std::thread::scope(|scope| {
                        for half in &halves {
                            let cell = &cell;
                            scope.spawn(move || {
                                for batch in half {
                                    cell.apply_batch(batch);
                                }
                            });
                        }
                    });
                    cell
                },
                BatchSize::PerIteration,
            );
        });
    }
    for (name, copies) in [
        ("cell_one_copy", IndexCopies::One),
        ("cell_two_copies", IndexCopies::Two),
    ] {
        group.bench_function(name, |b| {
            b.iter_batched(
                || IndexCell::new(copies, None, empty_index),
                |cell| {
                    for batch in &batches {
                        cell.apply_batch(batch);
                    }
                    cell
                },
                BatchSize::PerIteration,
            );
        });
    }
    // Every worker declares a capacity it never reaches (`total_kv_blocks`, as `bench
    // ingest` registers them): the gain order the capacity bound keeps on top.
    group.bench_function("cell_two_copies_capacity", |b| {
        b.iter_batched(
            benches::ingest_stream::server_cell,
            |cell| {
                for batch in &batches {
                    cell.apply_batch(batch);
                }
                cell
            },
            BatchSize::PerIteration,
        );
    });
    group.finish();
}

criterion_group!(benches, index_ingest);
criterion_main!(benches);
