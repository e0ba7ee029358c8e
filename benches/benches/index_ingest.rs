//! `index_ingest`: the stream of `cargo xtask bench ingest` (default workload) applied to
//! one index on one thread, without decoding, sockets or locks: the index's share of the
//! ingestion, in blocks per second.
//!
//! 16 workers; each stores 4 shared prefix chains of 8 blocks, then 977 batches of 32
//! events of 8 fresh blocks, a third of the events below a prefix, the others from the
//! root; the batches of the workers interleave as the listeners apply them. The shape
//! (hash layout, parents) mirrors `xtask/src/ingest_workload.rs`; the local hashes are
//! a mix of the engine hashes instead of the hashes of token ids. Every iteration fills a
//! fresh index (about 4 M nodes) and drops it outside the timing, so the figure includes
//! the page faults of a growing index, as the server pays them once.
//!
//! The same stream through an `IndexCell`, a batch per write as the listeners write, with
//! one copy and with two (the index and its mirror): what the mirror costs a writer; and
//! from two writer threads taking turns, as two listener threads share one partition.

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kv_index::{IndexCell, IndexCopies, KvIndex};
use kv_types::{
    BlockHash, ExternalHash, KvOperation, KvOperationKind, StorageTier, StoredBlock, WorkerKey,
};

const WORKERS: u64 = 16;
const BATCHES: u64 = 977;
const EVENTS: u64 = 32;
const BLOCKS: u64 = 8;
const PREFIXES: u64 = 4;
const PREFIX_BLOCKS: u64 = 8;
/// `total_kv_blocks` of every worker in `cell_two_copies_capacity`: `bench ingest`'s
/// default, four times what a worker stores.
const DECLARED_CAPACITY: u32 = 1_000_000;

/// splitmix64's finalizer: a local hash for an engine hash.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn prefix_hash(p: u64, b: u64) -> u64 {
    (1 << 62) | (p << 8) | b
}

fn store(w: u64, parent: Option<u64>, hashes: impl Iterator<Item = u64>) -> KvOperation {
    KvOperation {
        worker: WorkerKey::new(w, 0),
        tier: StorageTier::Device,
        event_id: 0,
        kind: KvOperationKind::Stored {
            parent_hash: parent.map(ExternalHash),
            blocks: hashes
                .map(|h| StoredBlock::new(ExternalHash(h), BlockHash(mix(h))))
                .collect(),
        },
    }
}

/// The stream, batch by batch in the order the listeners apply it.
fn stream() -> Vec<Vec<KvOperation>> {
    let mut batches = Vec::new();
    for w in 0..WORKERS {
        batches.push(
            (0..PREFIXES)
                .map(|p| store(w, None, (0..PREFIX_BLOCKS).map(|b| prefix_hash(p, b))))
                .collect(),
        );
    }
    for j in 0..BATCHES {
        for w in 0..WORKERS {
            let batch = (0..EVENTS)
                .map(|e| {
                    let g = j * EVENTS + e;
                    // Every third event hangs below a prefix, as `--shared 1/3` spreads them.
                    let parent =
                        ((g + 1) / 3 > g / 3).then(|| prefix_hash(g % PREFIXES, PREFIX_BLOCKS - 1));
                    store(
                        w,
                        parent,
                        (0..BLOCKS).map(|b| ((w + 1) << 40) | (g * BLOCKS + b)),
                    )
                })
                .collect();
            batches.push(batch);
        }
    }
    batches
}

fn index_ingest(c: &mut Criterion) {
    let batches = stream();
    let mut group = c.benchmark_group("index_ingest");
    group.sample_size(10);
    group.throughput(Throughput::Elements(WORKERS * BATCHES * EVENTS * BLOCKS));
    group.bench_function("bench_ingest_stream_16_workers", |b| {
        b.iter_batched(
            || KvIndex::with_block_size(16),
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
                || IndexCell::new(copies, None, || KvIndex::with_block_size(16)),
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
                || IndexCell::new(copies, None, || KvIndex::with_block_size(16)),
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
            || {
                IndexCell::new(IndexCopies::Two, None, || {
                    let mut index = KvIndex::with_block_size(16);
                    for w in 0..WORKERS {
                        index.set_capacity(WorkerKey::new(w, 0), Some(DECLARED_CAPACITY));
                    }
                    index
                })
            },
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
