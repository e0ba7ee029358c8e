//! The stream of `cargo xtask bench ingest`'s default workload as index operations, for
//! the benches that apply it without decoding, sockets or locks (`index_ingest`, and
//! `ingest_instructions` under callgrind).
//!
//! 16 workers; each stores 4 shared prefix chains of 8 blocks, then 977 batches of 32
//! events of 8 fresh blocks, a third of the events below a prefix, the others from the
//! root; the batches of the workers interleave as the listeners apply them. The shape
//! (hash layout, parents) mirrors `xtask/src/ingest_workload.rs`; the local hashes are
//! a mix of the engine hashes instead of the hashes of token ids.

use kv_index::{IndexCell, IndexCopies, KvIndex};
use kv_types::{
    BlockHash, ExternalHash, KvOperation, KvOperationKind, StorageTier, StoredBlock, WorkerKey,
};

pub const WORKERS: u64 = 16;
pub const BATCHES: u64 = 977;
pub const EVENTS: u64 = 32;
pub const BLOCKS: u64 = 8;
const PREFIXES: u64 = 4;
const PREFIX_BLOCKS: u64 = 8;
/// `total_kv_blocks` of every worker in `cell_two_copies_capacity`: `bench ingest`'s
/// default, four times what a worker stores.
pub const DECLARED_CAPACITY: u32 = 1_000_000;

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
pub fn stream() -> Vec<Vec<KvOperation>> {
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

/// Blocks of the stream's batches (the prefixes' 512 stored before them not counted).
pub const STREAM_BLOCKS: u64 = WORKERS * BATCHES * EVENTS * BLOCKS;

/// An empty index of the stream's block size: what `bench ingest`'s server starts with.
pub fn empty_index() -> KvIndex {
    KvIndex::with_block_size(16)
}

/// An empty index whose every worker declares [`DECLARED_CAPACITY`] blocks
/// (`total_kv_blocks`, as `bench ingest` registers them), which it never reaches: the
/// gain order the capacity bound keeps on top.
pub fn bounded_index() -> KvIndex {
    let mut index = empty_index();
    for w in 0..WORKERS {
        index.set_capacity(WorkerKey::new(w, 0), Some(DECLARED_CAPACITY));
    }
    index
}

/// A partition as `bench ingest`'s server holds it by default: the index and its mirror,
/// every worker with its declared capacity.
pub fn server_cell() -> IndexCell {
    IndexCell::new(IndexCopies::Two, None, bounded_index)
}

#[cfg(test)]
mod tests {
    use kv_types::KvOperationKind;

    #[test]
    fn the_stream_has_the_bench_shape() {
        let batches = super::stream();
        let stored = |op: &kv_types::KvOperation| match &op.kind {
            KvOperationKind::Stored { blocks, .. } => blocks.len() as u64,
            _ => 0,
        };
        let (prefixes, rest) = batches.split_at(super::WORKERS as usize);
        let prefix_blocks: u64 = prefixes.iter().flatten().map(stored).sum();
        let blocks: u64 = rest.iter().flatten().map(stored).sum();
        assert_eq!((prefix_blocks, blocks), (512, super::STREAM_BLOCKS));
        let below = rest
            .iter()
            .flatten()
            .filter(|op| {
                matches!(
                    &op.kind,
                    KvOperationKind::Stored {
                        parent_hash: Some(_),
                        ..
                    }
                )
            })
            .count() as u64;
        // Every third event of a worker's stream (`g % 3 == 2`) hangs below a prefix.
        assert_eq!(below, super::WORKERS * (super::BATCHES * super::EVENTS / 3));
    }
}
