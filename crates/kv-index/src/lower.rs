//! A lower-tier continuation index (host_pinned, disk, external; `spec/indexing.md` §4).
//!
//! Not a prefix tree: each edge `(parent external hash or none, local hash)` leads to one
//! child external hash, so a walk can continue exactly where the device prefix stopped.

use kv_types::{BlockHash, ExternalHash, StoredBlock, WorkerId, WorkerKey};
use rustc_hash::FxHashMap;

type EdgeKey = (Option<ExternalHash>, BlockHash);

#[derive(Clone, Debug)]
struct Edge {
    child: ExternalHash,
    /// Sorted.
    owners: Vec<WorkerKey>,
}

/// One lower tier's index. Single-writer like [`crate::PrefixIndex`].
#[derive(Debug, Default)]
pub struct LowerTierIndex {
    edges: FxHashMap<EdgeKey, Edge>,
    workers: FxHashMap<WorkerKey, FxHashMap<ExternalHash, EdgeKey>>,
    /// Whether changed edges are noted, for a mirror ([`LowerTierIndex::mirror_changes`]).
    logging: bool,
    /// Edges changed while `logging`, repeats included.
    touched: Vec<EdgeKey>,
}

impl LowerTierIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of (worker key, edge) memberships.
    pub fn memberships(&self) -> usize {
        self.workers.values().map(|m| m.len()).sum()
    }

    /// Bytes allocated by the maps (by capacity) and owner lists (by length), in
    /// O(worker keys).
    pub fn estimated_bytes(&self) -> usize {
        let per_worker: usize = self
            .workers
            .values()
            .map(|m| m.capacity() * (std::mem::size_of::<(ExternalHash, EdgeKey)>() + 1))
            .sum();
        self.edges.capacity() * (std::mem::size_of::<(EdgeKey, Edge)>() + 1)
            + self.workers.capacity()
                * (std::mem::size_of::<(WorkerKey, FxHashMap<ExternalHash, EdgeKey>)>() + 1)
            + per_worker
            + self.memberships() * std::mem::size_of::<WorkerKey>()
    }

    /// Applies a store (§4.2); no parent-existence check. Returns the blocks applied
    /// before the first conflict (a different key for a known hash, or an edge whose
    /// child is a different hash: first writer wins).
    pub fn apply_stored(
        &mut self,
        worker: WorkerKey,
        parent_hash: Option<ExternalHash>,
        blocks: &[StoredBlock],
    ) -> usize {
        if blocks.is_empty() {
            return 0;
        }
        let map = self.workers.entry(worker).or_default();
        let mut parent = parent_hash;
        let mut applied = 0;
        for block in blocks {
            let key = (parent, block.tokens_hash);
            if map.get(&block.block_hash).is_some_and(|k| *k != key) {
                break;
            }
            if self.logging {
                self.touched.push(key);
            }
            let edge = self.edges.entry(key).or_insert_with(|| Edge {
                child: block.block_hash,
                owners: Vec::new(),
            });
            if edge.child != block.block_hash {
                break;
            }
            if let Err(pos) = edge.owners.binary_search(&worker) {
                edge.owners.insert(pos, worker);
            }
            map.insert(block.block_hash, key);
            parent = Some(block.block_hash);
            applied += 1;
        }
        if map.is_empty() {
            self.workers.remove(&worker);
        }
        applied
    }

    /// Applies a remove (§4.2): unknown hashes are ignored. Returns the removed count.
    pub fn apply_removed(&mut self, worker: WorkerKey, hashes: &[ExternalHash]) -> usize {
        let Some(map) = self.workers.get_mut(&worker) else {
            return 0;
        };
        let mut removed = 0;
        for hash in hashes {
            if let Some(key) = map.remove(hash) {
                removed += 1;
                if self.logging {
                    self.touched.push(key);
                }
                drop_owner(&mut self.edges, key, worker);
            }
        }
        if map.is_empty() {
            self.workers.remove(&worker);
        }
        removed
    }

    /// Forgets every edge ownership of `worker`.
    pub fn remove_worker_key(&mut self, worker: WorkerKey) -> bool {
        let Some(map) = self.workers.remove(&worker) else {
            return false;
        };
        for (_, key) in map {
            if self.logging {
                self.touched.push(key);
            }
            drop_owner(&mut self.edges, key, worker);
        }
        true
    }

    /// Starts noting changed edges; forgets those noted before.
    pub(crate) fn log_on(&mut self) {
        self.logging = true;
        self.touched.clear();
    }

    pub(crate) fn log_off(&mut self) {
        self.logging = false;
    }

    /// Makes this mirror's edges (all a lookup reads) equal to `src`'s, given that they were
    /// before the changes `src` noted. A mirror keeps no per-worker maps: its membership
    /// and byte figures are not the source's.
    pub(crate) fn mirror_changes(&mut self, src: &LowerTierIndex) {
        for key in &src.touched {
            match src.edges.get(key) {
                Some(edge) => match self.edges.get_mut(key) {
                    Some(mine) => mine.clone_from(edge),
                    None => {
                        self.edges.insert(*key, edge.clone());
                    }
                },
                None => {
                    self.edges.remove(key);
                }
            }
        }
    }

    /// Makes this mirror's edges equal to `src`'s, whatever they were (O(`src`)).
    pub(crate) fn mirror_all(&mut self, src: &LowerTierIndex) {
        self.edges.clone_from(&src.edges);
        self.workers.clear();
    }

    /// Removes every rank of `worker_id`.
    pub fn remove_worker_id(&mut self, worker_id: WorkerId) {
        let keys: Vec<WorkerKey> = self
            .workers
            .keys()
            .filter(|k| k.worker_id == worker_id)
            .copied()
            .collect();
        for key in keys {
            self.remove_worker_key(key);
        }
    }

    /// The child reached from `anchor` by `local` if `worker` owns that edge.
    #[inline]
    pub(crate) fn owned_child(
        &self,
        worker: WorkerKey,
        anchor: Option<ExternalHash>,
        local: BlockHash,
    ) -> Option<ExternalHash> {
        let edge = self.edges.get(&(anchor, local))?;
        edge.owners
            .binary_search(&worker)
            .is_ok()
            .then_some(edge.child)
    }

    /// The child reached from `anchor` by `local`, whoever owns the edge.
    pub(crate) fn child(
        &self,
        anchor: Option<ExternalHash>,
        local: BlockHash,
    ) -> Option<ExternalHash> {
        self.edges.get(&(anchor, local)).map(|e| e.child)
    }

    /// Owners of the root edge `(none, local)`.
    pub(crate) fn root_owners(&self, local: BlockHash) -> &[WorkerKey] {
        self.edges
            .get(&(None, local))
            .map_or(&[], |e| e.owners.as_slice())
    }

    /// Every (worker, parent, block) membership, sorted for a deterministic dump.
    pub(crate) fn memberships_sorted(&self) -> Vec<(WorkerKey, Option<ExternalHash>, StoredBlock)> {
        let mut out: Vec<_> = self
            .workers
            .iter()
            .flat_map(|(&worker, map)| {
                map.iter().map(move |(&child, &(parent, local))| {
                    (worker, parent, StoredBlock::new(child, local))
                })
            })
            .collect();
        out.sort_unstable_by_key(|(w, p, b)| (*w, *p, b.tokens_hash, b.block_hash));
        out
    }
}

fn drop_owner(edges: &mut FxHashMap<EdgeKey, Edge>, key: EdgeKey, worker: WorkerKey) {
    if let Some(edge) = edges.get_mut(&key) {
        if let Ok(pos) = edge.owners.binary_search(&worker) {
            edge.owners.remove(pos);
        }
        if edge.owners.is_empty() {
            edges.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(l: u64, e: u64) -> StoredBlock {
        StoredBlock::new(ExternalHash(e), BlockHash(l))
    }

    #[test]
    fn first_writer_wins_and_stops_the_event() {
        let mut t = LowerTierIndex::new();
        let (w1, w2) = (WorkerKey::new(1, 0), WorkerKey::new(2, 0));
        assert_eq!(t.apply_stored(w1, None, &[b(1, 11), b(2, 12)]), 2);
        // Same edge (none, 1) with another child hash: nothing of this event applies.
        assert_eq!(t.apply_stored(w2, None, &[b(1, 99), b(2, 12)]), 0);
        assert_eq!(t.apply_stored(w2, None, &[b(1, 11)]), 1);
        assert_eq!(t.root_owners(BlockHash(1)), &[w1, w2]);
        assert_eq!(
            t.owned_child(w1, Some(ExternalHash(11)), BlockHash(2)),
            Some(ExternalHash(12))
        );
        assert_eq!(
            t.owned_child(w2, Some(ExternalHash(11)), BlockHash(2)),
            None
        );
        assert_eq!(t.apply_removed(w1, &[ExternalHash(12), ExternalHash(5)]), 1);
        assert!(t.remove_worker_key(w2));
        t.remove_worker_id(WorkerId(1));
        assert!(t.edges.is_empty());
        assert!(t.workers.is_empty());
    }

    #[test]
    fn parent_need_not_exist_and_duplicates_are_idempotent() {
        let mut t = LowerTierIndex::new();
        let w = WorkerKey::new(3, 1);
        assert_eq!(t.apply_stored(w, Some(ExternalHash(7)), &[b(4, 44)]), 1);
        assert_eq!(t.apply_stored(w, Some(ExternalHash(7)), &[b(4, 44)]), 1);
        assert_eq!(t.memberships(), 1);
    }
}
