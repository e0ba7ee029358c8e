//! Vectors of decoded events and normalized operations, kept for the next batch.
//!
//! A steady stream would otherwise allocate and free three vectors per `BlockStored` (its
//! token ids and engine hashes as decoded, its blocks as an operation): malloc and free
//! were 6–8 % of an ingesting server's samples (docs/hot-path.md). A listener group keeps
//! one [`Spares`] for all its listeners, which run on its one thread, so it holds about one
//! burst of batches' worth whatever the number of listeners.

use kv_types::{ExternalHash, KvOperation, KvOperationKind, StoredBlock};

/// Vectors kept per kind at most: more than a burst's operations (a listener hands its
/// batches to the sink once 256 operations wait).
const KEPT: usize = 512;
/// A vector with more room than this many bytes is freed, not kept (4,096 token ids, 2,048
/// hashes, about 400 blocks): one huge event must not pin its memory. A group keeps at
/// most 3 × 512 × 16 KiB, and about one burst's worth (a few hundred KiB) in a steady
/// stream.
const MAX_BYTES: usize = 16 << 10;

/// Empty vectors with room, by kind (see the module docs).
#[derive(Debug, Default)]
pub struct Spares {
    ids: Vec<Vec<u32>>,
    hashes: Vec<Vec<ExternalHash>>,
    blocks: Vec<Vec<StoredBlock>>,
}

impl Spares {
    pub(crate) fn ids(&mut self) -> Vec<u32> {
        self.ids.pop().unwrap_or_default()
    }

    pub(crate) fn hashes(&mut self) -> Vec<ExternalHash> {
        self.hashes.pop().unwrap_or_default()
    }

    pub(crate) fn blocks(&mut self) -> Vec<StoredBlock> {
        self.blocks.pop().unwrap_or_default()
    }

    pub(crate) fn keep_ids(&mut self, ids: Vec<u32>) {
        keep(&mut self.ids, ids);
    }

    pub(crate) fn keep_hashes(&mut self, hashes: Vec<ExternalHash>) {
        keep(&mut self.hashes, hashes);
    }

    /// Empties `ops` (once the sink has applied them), keeping their vectors.
    pub fn recycle(&mut self, ops: &mut Vec<KvOperation>) {
        for op in ops.drain(..) {
            match op.kind {
                KvOperationKind::Stored { blocks, .. } => keep(&mut self.blocks, blocks),
                KvOperationKind::Removed { block_hashes } => keep(&mut self.hashes, block_hashes),
                _ => {}
            }
        }
    }

    /// Vectors kept, by kind: token ids, hashes, blocks.
    #[cfg(test)]
    pub(crate) fn kept(&self) -> (usize, usize, usize) {
        (self.ids.len(), self.hashes.len(), self.blocks.len())
    }
}

fn keep<T>(kept: &mut Vec<Vec<T>>, mut v: Vec<T>) {
    let bytes = v.capacity().saturating_mul(std::mem::size_of::<T>());
    if kept.len() < KEPT && bytes > 0 && bytes <= MAX_BYTES {
        v.clear();
        kept.push(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_types::{StorageTier, WorkerKey};

    fn stored(blocks: usize) -> KvOperation {
        KvOperation {
            worker: WorkerKey::new(1, 0),
            tier: StorageTier::Device,
            event_id: 0,
            kind: KvOperationKind::Stored {
                parent_hash: None,
                blocks: vec![StoredBlock::new(ExternalHash(1), kv_types::BlockHash(2)); blocks],
            },
        }
    }

    #[test]
    fn recycled_vectors_come_back_empty_with_their_room() {
        let mut spares = Spares::default();
        let huge = MAX_BYTES / std::mem::size_of::<StoredBlock>() + 1;
        let mut ops = vec![stored(8), stored(0), stored(huge)];
        spares.recycle(&mut ops);
        assert!(ops.is_empty());
        // The empty one has no room to keep; the huge one is freed.
        assert_eq!(spares.kept(), (0, 0, 1));
        let again = spares.blocks();
        assert!(again.is_empty() && again.capacity() >= 8);
        assert_eq!(spares.kept(), (0, 0, 0));
        assert_eq!(spares.blocks().capacity(), 0);
    }

    #[test]
    fn at_most_a_bounded_number_is_kept() {
        let mut spares = Spares::default();
        let mut ops: Vec<KvOperation> = (0..KEPT + 10).map(|_| stored(1)).collect();
        spares.recycle(&mut ops);
        assert_eq!(spares.kept(), (0, 0, KEPT));
    }
}
