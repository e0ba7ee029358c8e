//! Shared workload of the kv-index benches: the Mooncake conversation trace
//! (`shared/data/conversation_trace.jsonl`), each 512-token `hash_id` re-chunked into
//! `512 / block_size` blocks that inherit the prefix chain, requests assigned round-robin
//! to 128 workers.

#![allow(dead_code, unreachable_pub)]

use kv_types::{
    BlockHash, ExternalHash, KvOperation, KvOperationKind, StorageTier, StoredBlock, WorkerKey,
};

pub const WORKERS: u64 = 128;
const TRACE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shared/data/conversation_trace.jsonl"
);

/// `hash_ids` of every request, in trace order. Empty when the data file is absent.
pub fn load_trace() -> Vec<Vec<u64>> {
    let Ok(text) = std::fs::read_to_string(TRACE) else {
        eprintln!("trace {TRACE} not found: benches run on an empty workload");
        return Vec::new();
    };
    text.lines()
        .filter_map(|line| {
            let start = line.find("\"hash_ids\"")?;
            let open = start + line[start..].find('[')?;
            let close = open + line[open..].find(']')?;
            Some(
                line[open + 1..close]
                    .split(',')
                    .filter_map(|s| s.trim().parse::<u64>().ok())
                    .collect(),
            )
        })
        .collect()
}

/// A well-mixed hash of `x`: the first draw of the pickers' generator seeded with it.
fn mix(x: u64) -> u64 {
    selection_policy::PickRng::seeded(x).next_u64()
}

/// Local hashes of a request's blocks at `block_size` (hash ids are chained, so a
/// (hash id, sub-block) pair identifies its whole prefix).
pub fn locals(hash_ids: &[u64], block_size: u32) -> Vec<BlockHash> {
    let per = u64::from(512 / block_size);
    hash_ids
        .iter()
        .flat_map(|&h| (0..per).map(move |j| BlockHash(mix(h * 64 + j))))
        .collect()
}

/// The engine's external hash of a local hash (one chain ↔ one external chain).
pub fn external(local: BlockHash) -> ExternalHash {
    ExternalHash(mix(local.0 ^ 0x5555))
}

pub fn store_op(worker: WorkerKey, locals: &[BlockHash]) -> KvOperation {
    KvOperation {
        worker,
        tier: StorageTier::Device,
        event_id: 0,
        kind: KvOperationKind::Stored {
            parent_hash: None,
            blocks: locals
                .iter()
                .map(|&l| StoredBlock::new(external(l), l))
                .collect(),
        },
    }
}

pub fn remove_op(worker: WorkerKey, locals: &[BlockHash]) -> KvOperation {
    KvOperation {
        worker,
        tier: StorageTier::Device,
        event_id: 0,
        kind: KvOperationKind::Removed {
            block_hashes: locals.iter().map(|&l| external(l)).collect(),
        },
    }
}

/// Stores every request of `trace` on worker `(i + offset) % 128`.
pub fn build(index: &mut kv_index::KvIndex, trace: &[Vec<u64>], block_size: u32, offset: u64) {
    for (i, ids) in trace.iter().enumerate() {
        let worker = WorkerKey::new((i as u64 + offset) % WORKERS, 0);
        index.apply(&store_op(worker, &locals(ids, block_size)));
    }
}

/// 4k-token prompts (the first 8 hash ids of requests that have 8), as local hashes.
pub fn prompts_4k(trace: &[Vec<u64>], block_size: u32, n: usize) -> Vec<Vec<BlockHash>> {
    trace
        .iter()
        .filter(|ids| ids.len() >= 8)
        .take(n)
        .map(|ids| locals(&ids[..8], block_size))
        .collect()
}
