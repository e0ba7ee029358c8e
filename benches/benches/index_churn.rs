//! `index_churn`: the longest single operation while a worker with a declared capacity
//! (`total_kv_blocks`) loses its blocks out of the order it gained them, as an engine
//! evicting least-recently-used blocks reports them. Each step removes a random held chain
//! of 8 blocks (leaf first) and stores a new one, so stale entries pile up in the worker's
//! gain order until it is compacted (`kv-index/src/capacity.rs`). Prints, per index size,
//! the time of all steps, the longest remove-plus-store and how many took over 1 ms: the
//! pause a lookup would wait behind in one write section. Then the store that first takes
//! a worker past its capacity, and the rate of 16 workers storing past theirs.
//! Not a criterion measurement: the figure of interest is a maximum.

use std::time::{Duration, Instant};

use kv_index::KvIndex;
use kv_types::{
    BlockHash, ExternalHash, KvOperation, KvOperationKind, StorageTier, StoredBlock, WorkerKey,
};

const STEPS: usize = 200_000;

fn op(worker: WorkerKey, kind: KvOperationKind) -> KvOperation {
    KvOperation {
        worker,
        tier: StorageTier::Device,
        event_id: 0,
        kind,
    }
}

/// The engine hashes of chain `c` (its local hashes are the same numbers).
fn chain(c: u64) -> impl DoubleEndedIterator<Item = u64> {
    (0..8).map(move |i| c * 8 + i + 1)
}

fn store(worker: WorkerKey, c: u64) -> KvOperation {
    let blocks = chain(c)
        .map(|h| StoredBlock::new(ExternalHash(h), BlockHash(h)))
        .collect();
    op(
        worker,
        KvOperationKind::Stored {
            parent_hash: None,
            blocks,
        },
    )
}

fn remove(worker: WorkerKey, c: u64) -> KvOperation {
    let block_hashes = chain(c).rev().map(ExternalHash).collect();
    op(worker, KvOperationKind::Removed { block_hashes })
}

fn run(chains: u64) {
    let worker = WorkerKey::new(1, 0);
    let mut index = KvIndex::with_block_size(16);
    index.set_capacity(worker, Some(u32::MAX / 2));
    for c in 0..chains {
        index.apply(&store(worker, c));
    }
    let mut live: Vec<u64> = (0..chains).collect();
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let (mut longest, mut over_1ms) = (Duration::ZERO, 0u32);
    let started = Instant::now();
    for next in chains..chains + STEPS as u64 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let gone = live.swap_remove((rng % live.len() as u64) as usize);
        let (out, new) = (remove(worker, gone), store(worker, next));
        let t = Instant::now();
        index.apply(&out);
        index.apply(&new);
        let took = t.elapsed();
        longest = longest.max(took);
        over_1ms += u32::from(took > Duration::from_millis(1));
        live.push(next);
    }
    eprintln!(
        "index_churn: {} held blocks, {STEPS} random removes and stores of 8 blocks in {:.1?}: longest {:.1?}, {over_1ms} over 1 ms",
        chains * 8,
        started.elapsed(),
        longest
    );
    std::hint::black_box(&index);
}

/// The store that first takes a worker past its capacity, after it gained `chains` chains
/// with nothing removed (an engine whose removals were lost): the eviction bookkeeping
/// starts there, and the store is one write section.
fn first_excess(chains: u64) {
    let worker = WorkerKey::new(1, 0);
    let mut index = KvIndex::with_block_size(16);
    index.set_capacity(worker, Some(u32::try_from(chains * 8).unwrap_or(u32::MAX)));
    // The last eighth of the fill is where the child counts are built, a step per store.
    let mut filling = Duration::ZERO;
    for c in 0..chains {
        let t = Instant::now();
        index.apply(&store(worker, c));
        filling = filling.max(t.elapsed());
    }
    let mut longest = Duration::ZERO;
    let mut next = Duration::ZERO;
    for (i, c) in (chains..chains + 2).enumerate() {
        let t = Instant::now();
        index.apply(&store(worker, c));
        let took = t.elapsed();
        if i == 0 {
            longest = took;
        } else {
            next = took;
        }
    }
    eprintln!(
        "index_churn: {} held blocks at capacity, the first store past it: {:.1?}, the next: {:.1?}; longest store filling it: {:.1?}",
        chains * 8,
        longest,
        next,
        filling
    );
    std::hint::black_box(&index);
}

/// `workers` workers each storing `chains` chains of 8 in turn, with a capacity of
/// `limit` blocks each: the rate of a fleet whose removals are lost, against the same
/// stores without a capacity reached. Prints the time to fill the capacities and in all.
fn fleet(workers: u64, chains: u64, limit: u32) {
    for declared in [limit, u32::MAX / 2] {
        let mut index = KvIndex::with_block_size(16);
        for w in 0..workers {
            index.set_capacity(WorkerKey::new(w, 0), Some(declared));
        }
        let started = Instant::now();
        let mut filled = None;
        for c in 0..chains {
            if c * 8 >= u64::from(declared) {
                filled.get_or_insert_with(|| started.elapsed());
            }
            for w in 0..workers {
                let blocks = chain(c)
                    .map(|h| h | (w << 40))
                    .map(|h| StoredBlock::new(ExternalHash(h), BlockHash(h)))
                    .collect();
                let stored = KvOperationKind::Stored {
                    parent_hash: None,
                    blocks,
                };
                index.apply(&op(WorkerKey::new(w, 0), stored));
            }
        }
        eprintln!(
            "index_churn: {workers} workers storing {} blocks each, capacity {declared}: {:.1?} ({})",
            chains * 8,
            started.elapsed(),
            filled.map_or("never filled".to_owned(), |t| format!("filled in {t:.1?}"))
        );
        std::hint::black_box(&index);
    }
}

fn main() {
    for chains in [25_000, 100_000] {
        run(chains);
    }
    for chains in [25_000, 125_000] {
        first_excess(chains);
    }
    fleet(16, 25_000, 100_000);
}
