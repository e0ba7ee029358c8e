//! One worker key's state in the trie: the maps from its engine's block hashes to nodes
//! (the spec's per-worker block identity), its version, and its capacity bookkeeping.

use std::hash::BuildHasher;

use kv_types::{ExternalHash, WorkerKey};
use rustc_hash::FxBuildHasher;

use super::node::Node;
use crate::capacity::Capacity;
use crate::sharded::{ShardedMap, ShardedTable};

#[derive(Debug)]
pub(super) struct WorkerState {
    pub(super) key: WorkerKey,
    /// External hash → node, per the spec's per-worker block identity, for the usual case
    /// where the hash is the node's own `external`: only the 4-byte node id is stored and
    /// the key is read from the node (a node with a map entry is never freed, and its
    /// `external` never changes). A quarter of a `HashMap<u64, u32>` entry. Grows in
    /// shards: growing a whole table re-reads every entry's node, milliseconds under the
    /// write lock at a few hundred thousand blocks.
    pub(super) blocks: ShardedTable<u32>,
    /// External hash → node where the hash differs from the node's `external` (another
    /// worker created the node under its own hash, or an engine reused a hash). Disjoint
    /// from `blocks`.
    pub(super) foreign: ShardedMap<ExternalHash, u32>,
    /// Node → the hash this worker last stored it under, for the nodes it maps through
    /// `foreign`: engines that hash the same tokens differently (vLLM without a fixed hash
    /// seed) share nodes, and a match or a dump must name a block by its own worker's hash
    /// (lower-tier anchors, replayable parents). Every entry is also in `foreign`; empty
    /// whenever `foreign` is.
    pub(super) own_at: ShardedMap<u32, ExternalHash>,
    /// Nodes whose owner set contains this slot (can exceed `blocks.len()` only when an
    /// engine reuses an external hash for a different position).
    pub(super) owned: u32,
    /// Changes whenever this state gains or loses a block, and is never reused by another
    /// state of the index: an unchanged version means the worker still holds exactly what
    /// it held when the version was read.
    pub(super) version: u64,
    /// Set once `foreign` may map two hashes to one node (an engine stored a block under
    /// several hashes of its own): evicting a node then scans `foreign` for all of them.
    /// Otherwise a node's only foreign hash is its `own_at` entry.
    aliased: bool,
    /// The declared capacity's bookkeeping, for a worker key that declared one.
    pub(super) cap: Option<Capacity>,
}

#[inline]
fn ext_hash(ext: u64) -> u64 {
    FxBuildHasher.hash_one(ext)
}

impl WorkerState {
    pub(super) fn new(key: WorkerKey, version: u64) -> Self {
        WorkerState {
            key,
            blocks: ShardedTable::new(),
            foreign: ShardedMap::default(),
            own_at: ShardedMap::default(),
            owned: 0,
            version,
            aliased: false,
            cap: None,
        }
    }

    /// The node this worker maps `ext` to.
    #[inline]
    pub(super) fn get(&self, nodes: &[Node], ext: ExternalHash) -> Option<u32> {
        if !self.foreign.is_empty()
            && let Some(&node) = self.foreign.get(&ext)
        {
            return Some(node);
        }
        self.blocks
            .find(ext_hash(ext.0), |&id| nodes[id as usize].external == ext.0)
            .copied()
    }

    /// Maps `ext` to `node`; returns the previous node.
    #[inline]
    pub(super) fn insert(&mut self, nodes: &[Node], ext: ExternalHash, node: u32) -> Option<u32> {
        if nodes[node as usize].external == ext.0 {
            self.insert_own(nodes, ext, node)
        } else {
            let hash = ext_hash(ext.0);
            let eq = |&id: &u32| nodes[id as usize].external == ext.0;
            let previous = self.blocks.remove(hash, eq);
            let moved = self.foreign.insert(ext, node);
            if let Some(old) = moved {
                self.forget_own(old, ext);
            }
            self.aliased |= self
                .own_at
                .insert(node, ext)
                .is_some_and(|prev| prev != ext);
            moved.or(previous)
        }
    }

    /// [`Self::insert`] for a `node` whose `external` is `ext`, which the caller knows
    /// without reading the node (it just created it).
    #[inline]
    pub(super) fn insert_own(
        &mut self,
        nodes: &[Node],
        ext: ExternalHash,
        node: u32,
    ) -> Option<u32> {
        debug_assert_eq!(nodes[node as usize].external, ext.0);
        let hash = ext_hash(ext.0);
        let eq = |&id: &u32| nodes[id as usize].external == ext.0;
        let previous = if self.foreign.is_empty() {
            None
        } else {
            // The latest store names `node` by the node's own hash. A foreign hash
            // that still maps here is no longer named by `own_at`.
            self.aliased |= self.own_at.remove(&node).is_some();
            let previous = self.foreign.remove(&ext);
            if let Some(old) = previous {
                self.forget_own(old, ext);
            }
            previous
        };
        self.blocks
            .insert(hash, node, eq, |&id| ext_hash(nodes[id as usize].external))
            .or(previous)
    }

    /// Drops `node`'s own-hash entry if it is `ext` (whose `foreign` entry just went).
    #[inline]
    fn forget_own(&mut self, node: u32, ext: ExternalHash) {
        if self.own_at.get(&node) == Some(&ext) {
            self.own_at.remove(&node);
        }
    }

    /// The hash this worker names `node` by.
    #[inline]
    pub(super) fn external_of(&self, nodes: &[Node], node: u32) -> ExternalHash {
        if !self.own_at.is_empty()
            && let Some(&ext) = self.own_at.get(&node)
        {
            return ext;
        }
        ExternalHash(nodes[node as usize].external)
    }

    /// Forgets `ext`; returns the node it mapped to.
    #[inline]
    pub(super) fn remove(&mut self, nodes: &[Node], ext: ExternalHash) -> Option<u32> {
        if !self.foreign.is_empty()
            && let Some(node) = self.foreign.remove(&ext)
        {
            self.forget_own(node, ext);
            return Some(node);
        }
        self.blocks
            .remove(ext_hash(ext.0), |&id| nodes[id as usize].external == ext.0)
    }

    /// Forgets every hash this worker maps to `node`; returns how many there were.
    pub(super) fn unmap(&mut self, nodes: &[Node], node: u32) -> u32 {
        let mut unmapped = 0;
        if self
            .blocks
            .remove(ext_hash(nodes[node as usize].external), |&id| id == node)
            .is_some()
        {
            unmapped += 1;
        }
        if self.foreign.is_empty() {
            return unmapped;
        }
        if let Some(ext) = self.own_at.remove(&node)
            && self.foreign.get(&ext) == Some(&node)
        {
            self.foreign.remove(&ext);
            unmapped += 1;
        }
        if self.aliased {
            self.foreign.retain(|_, n| {
                let keep = *n != node;
                unmapped += u32::from(!keep);
                keep
            });
        }
        unmapped
    }

    /// Bytes allocated by the maps.
    pub(super) fn allocated_bytes(&self) -> usize {
        self.cap.as_ref().map_or(0, Capacity::allocated_bytes)
            + self.blocks.allocation_size()
            + self.foreign.allocation_size()
            + self.own_at.allocation_size()
    }
}

#[cfg(test)]
mod tests {
    use kv_types::{ExternalHash, WorkerKey};

    use crate::primary::tests::{blocks, q};
    use crate::{OverlapScores, PrefixIndex, PrefixIndexStats, StoreOutcome};

    #[test]
    fn workers_hashing_the_same_tokens_differently_keep_their_own_hashes() {
        // vLLM without a fixed hash seed: same tokens, different engine hashes per worker.
        let mut idx = PrefixIndex::new();
        let (a, b) = (WorkerKey::new(1, 0), WorkerKey::new(2, 0));
        idx.apply_stored(a, None, &blocks(&[(1, 11), (2, 12), (3, 13)]));
        idx.apply_stored(b, None, &blocks(&[(1, 21), (2, 22)]));
        idx.apply_stored(b, Some(ExternalHash(22)), &blocks(&[(3, 23), (4, 24)]));
        idx.check_invariants();
        assert_eq!(idx.stats().nodes, 4, "the tokens share nodes");
        let mut out = OverlapScores::new();
        idx.find_matches(&q(&[1, 2, 3, 4]), &mut out);
        let last =
            |out: &OverlapScores, w| out.entry(w).map(|e| (e.matched_blocks, e.last_external.0));
        assert_eq!(last(&out, a), Some((3, 13)));
        assert_eq!(last(&out, b), Some((4, 24)));
        idx.find_matches(&q(&[1, 2]), &mut out);
        assert_eq!(last(&out, b), Some((2, 22)));

        let mut chain = Vec::new();
        idx.root_chain(&q(&[1, 2, 3]), 3, Some(b), &mut chain);
        assert_eq!(chain, [21, 22, 23].map(ExternalHash));
        idx.root_chain(&q(&[1, 2, 3]), 3, None, &mut chain);
        assert_eq!(chain, [11, 12, 13].map(ExternalHash));

        // The dump names each worker's blocks and parents by its own hashes, so a replay
        // restores both maps: b's later removal by its own hash then works on the copy.
        let mut runs = Vec::new();
        idx.for_each_run(|w, parent, blocks| {
            let hashes: Vec<u64> = blocks.iter().map(|b| b.block_hash.0).collect();
            runs.push((w, parent.map(|p| p.0), hashes));
        });
        assert_eq!(
            runs,
            [
                (a, None, vec![11, 12, 13]),
                (b, None, vec![21, 22, 23]),
                (b, Some(23), vec![24]),
            ]
        );
        let mut copy = PrefixIndex::new();
        idx.for_each_run(|w, parent, blocks| {
            assert_eq!(copy.apply_stored(w, parent, blocks), StoreOutcome::Applied);
        });
        copy.check_invariants();
        for index in [&mut idx, &mut copy] {
            let removed = index.apply_removed(b, &[ExternalHash(22)]);
            assert_eq!((removed.removed, removed.not_found), (1, 0));
            index.find_matches(&q(&[1, 2, 3, 4]), &mut out);
            assert_eq!((out.score(a), out.score(b)), (3, 1));
            assert_eq!(last(&out, b), Some((1, 21)));
            index.check_invariants();
        }

        // Storing a block again under the node's own hash names it by that one.
        idx.apply_stored(b, Some(ExternalHash(21)), &blocks(&[(2, 12)]));
        idx.check_invariants();
        idx.find_matches(&q(&[1, 2]), &mut out);
        assert_eq!(last(&out, b), Some((2, 12)));
        assert!(idx.remove_worker_key(b) && idx.remove_worker_key(a));
        assert_eq!(idx.stats(), PrefixIndexStats::default());
    }
}
