use kv_types::{
    BlockHash, ExternalHash, KvOperation, KvOperationKind, StorageTier, StoredBlock, WorkerKey,
};

pub(crate) fn stored(
    worker: WorkerKey,
    tier: StorageTier,
    parent: Option<u64>,
    pairs: &[(u64, u64)],
) -> KvOperation {
    KvOperation {
        worker,
        tier,
        event_id: 0,
        kind: KvOperationKind::Stored {
            parent_hash: parent.map(ExternalHash),
            blocks: pairs
                .iter()
                .map(|&(l, e)| StoredBlock::new(ExternalHash(e), BlockHash(l)))
                .collect(),
        },
    }
}

pub(crate) fn removed(worker: WorkerKey, hashes: &[u64]) -> KvOperation {
    KvOperation {
        worker,
        tier: StorageTier::Device,
        event_id: 0,
        kind: KvOperationKind::Removed {
            block_hashes: hashes.iter().map(|&h| ExternalHash(h)).collect(),
        },
    }
}

pub(crate) fn cleared(worker: WorkerKey) -> KvOperation {
    KvOperation {
        worker,
        tier: StorageTier::Device,
        event_id: 0,
        kind: KvOperationKind::Cleared,
    }
}

pub(crate) fn q(locals: &[u64]) -> Vec<BlockHash> {
    locals.iter().map(|&l| BlockHash(l)).collect()
}

pub(crate) fn w(id: u64, rank: u32) -> WorkerKey {
    WorkerKey::new(id, rank)
}
