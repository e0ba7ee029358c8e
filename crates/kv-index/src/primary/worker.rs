//! One worker key's state in the trie: the maps from its engine's block hashes to nodes
//! (the spec's per-worker block identity), its version, and its capacity bookkeeping.

use kv_types::{ExternalHash, StoredBlock, WorkerKey};

use super::logged::OwnLog;
use super::node::Node;
use crate::capacity::Capacity;
use crate::sharded::{ShardedMap, ShardedTable, hash_bits, table_hash};

#[derive(Debug)]
pub(super) struct WorkerState {
    pub(super) key: WorkerKey,
    /// Its slot in the trie.
    pub(super) slot: u32,
    /// The index's version when the state was made: unique among the states an index
    /// ever made, so a mirror tells a reused slot's new state from the old one.
    pub(super) birth: u64,
    /// External hash → node, per the spec's per-worker block identity, for the usual case
    /// where the hash is the node's own `external`: the node id and 32 bits of the hash
    /// are stored ([`BlockEntry`]) and the key is read from the node (a node with a map
    /// entry is never freed, and its `external` never changes). Half a `HashMap<u64, u32>`
    /// entry. Grows in shards: growing a whole table at once takes milliseconds under the
    /// write lock at a few hundred thousand blocks.
    pub(super) blocks: ShardedTable<BlockEntry>,
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

/// An entry of [`WorkerState::blocks`]: a node and 32 bits of its `external`'s hash.
///
/// The table's hash of an entry is made from these bits alone ([`table_hash`]), so a
/// table that grows or a shard that splits reads no node, and a lookup reads a node only
/// where the bits match: `hashbrown`'s 7-bit tag alone matches a wrong entry on about one
/// lookup in seven, and each such match would read a random node (a cache miss).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct BlockEntry {
    /// [`hash_bits`] of the node's `external`.
    bits: u32,
    pub(super) node: u32,
}

/// Whether `entry` is the entry of `ext` (with `bits` its [`hash_bits`]): the node is read
/// only when the bits agree.
#[inline]
fn is_entry_of(nodes: &[Node], entry: &BlockEntry, bits: u32, ext: ExternalHash) -> bool {
    entry.bits == bits && nodes[entry.node as usize].external == ext.0
}

impl WorkerState {
    pub(super) fn new(key: WorkerKey, slot: u32, version: u64) -> Self {
        WorkerState {
            key,
            slot,
            birth: version,
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
        let bits = hash_bits(ext.0);
        self.blocks
            .find(table_hash(bits), |e| is_entry_of(nodes, e, bits, ext))
            .map(|e| e.node)
    }

    /// Looks up every block of a store in [`Self::blocks`] before the store changes
    /// anything, so that the cache misses of the lookups overlap. The store's inserts then
    /// find their table groups in cache; each of them otherwise waits for its own miss (a
    /// store's loop body is too long for the CPU to run the next block's probe early).
    #[inline]
    ///
    /// The block-table half of [`Self::get`] only: `get`'s `foreign` check first costs this
    /// loop a load per block, which shows in `index_ingest` (docs/hot-path.md, "a store's
    /// block-table probes made up front").
    pub(super) fn warm(&self, nodes: &[Node], blocks: &[StoredBlock]) {
        for block in blocks {
            let ext = block.block_hash;
            let bits = hash_bits(ext.0);
            std::hint::black_box(
                self.blocks
                    .find(table_hash(bits), |e| is_entry_of(nodes, e, bits, ext))
                    .is_some(),
            );
        }
    }

    /// Maps `ext` to `node`; returns the previous node.
    #[inline]
    pub(super) fn insert(
        &mut self,
        nodes: &[Node],
        ext: ExternalHash,
        node: u32,
        log: &mut OwnLog,
    ) -> Option<u32> {
        if nodes[node as usize].external == ext.0 {
            self.insert_own(nodes, ext, node, log)
        } else {
            let bits = hash_bits(ext.0);
            let previous = self
                .blocks
                .remove(table_hash(bits), |e| is_entry_of(nodes, e, bits, ext))
                .map(|e| e.node);
            let moved = self.foreign.insert(ext, node);
            if let Some(old) = moved {
                self.forget_own(old, ext, log);
            }
            log.note(self.slot, node);
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
        log: &mut OwnLog,
    ) -> Option<u32> {
        debug_assert_eq!(nodes[node as usize].external, ext.0);
        let bits = hash_bits(ext.0);
        let previous = if self.foreign.is_empty() {
            None
        } else {
            // The latest store names `node` by the node's own hash. A foreign hash
            // that still maps here is no longer named by `own_at`.
            log.note(self.slot, node);
            self.aliased |= self.own_at.remove(&node).is_some();
            let previous = self.foreign.remove(&ext);
            if let Some(old) = previous {
                self.forget_own(old, ext, log);
            }
            previous
        };
        self.blocks
            .insert(
                table_hash(bits),
                BlockEntry { bits, node },
                |e| is_entry_of(nodes, e, bits, ext),
                |e| table_hash(e.bits),
            )
            .map(|e| e.node)
            .or(previous)
    }

    /// Drops `node`'s own-hash entry if it is `ext` (whose `foreign` entry just went).
    #[inline]
    fn forget_own(&mut self, node: u32, ext: ExternalHash, log: &mut OwnLog) {
        if self.own_at.get(&node) == Some(&ext) {
            log.note(self.slot, node);
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
    pub(super) fn remove(
        &mut self,
        nodes: &[Node],
        ext: ExternalHash,
        log: &mut OwnLog,
    ) -> Option<u32> {
        if !self.foreign.is_empty()
            && let Some(node) = self.foreign.remove(&ext)
        {
            self.forget_own(node, ext, log);
            return Some(node);
        }
        let bits = hash_bits(ext.0);
        self.blocks
            .remove(table_hash(bits), |e| is_entry_of(nodes, e, bits, ext))
            .map(|e| e.node)
    }

    /// Forgets every hash this worker maps to `node`; returns how many there were.
    pub(super) fn unmap(&mut self, nodes: &[Node], node: u32, log: &mut OwnLog) -> u32 {
        let mut unmapped = 0;
        if self
            .blocks
            .remove(table_hash(hash_bits(nodes[node as usize].external)), |e| {
                e.node == node
            })
            .is_some()
        {
            unmapped += 1;
        }
        if self.foreign.is_empty() {
            return unmapped;
        }
        log.note(self.slot, node);
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
    use std::collections::HashMap;

    use kv_types::{ExternalHash, WorkerKey};

    use super::WorkerState;
    use crate::primary::logged::OwnLog;
    use crate::primary::node::{NONE, Node};
    use crate::primary::tests::{blocks, colliding, q};
    use crate::sharded::hash_bits;
    use crate::{OverlapScores, PrefixIndex, PrefixIndexStats, StoreOutcome};

    /// A worker state holding `exts` (each the `external` of its own node) and the nodes,
    /// checked against a plain map as it goes.
    fn filled(exts: &[u64]) -> (WorkerState, Vec<Node>) {
        let mut nodes = vec![Node::new(NONE, 0, 0)];
        nodes.extend(exts.iter().map(|&e| Node::new(0, e, e)));
        let mut state = WorkerState::new(WorkerKey::new(1, 0), 0, 1);
        for (i, &e) in exts.iter().enumerate() {
            let node = i as u32 + 1;
            assert_eq!(
                state.insert_own(&nodes, ExternalHash(e), node, &mut OwnLog::default()),
                None
            );
        }
        (state, nodes)
    }

    /// Every hash of `model` maps to its node, and the table holds nothing else.
    /// The model of [`filled`]: block `exts[i]` maps to node `i + 1`.
    fn numbered(exts: &[u64]) -> HashMap<u64, u32> {
        exts.iter()
            .enumerate()
            .map(|(i, &e)| (e, i as u32 + 1))
            .collect()
    }

    fn check(state: &WorkerState, nodes: &[Node], model: &HashMap<u64, u32>) {
        for (&e, &node) in model {
            assert_eq!(state.get(nodes, ExternalHash(e)), Some(node), "{e:#x}");
        }
        let mut held: Vec<u32> = state.blocks.iter().map(|e| e.node).collect();
        held.sort_unstable();
        let mut expected: Vec<u32> = model.values().copied().collect();
        expected.sort_unstable();
        assert_eq!(held, expected);
    }

    #[test]
    fn blocks_whose_hash_bits_collide_are_told_apart_by_their_nodes() {
        let same = colliding(0x5eed, 1_500);
        assert!(same.iter().all(|&e| hash_bits(e) == hash_bits(same[0])));
        // More colliding entries than a shard holds, among ordinary ones that make the
        // table split: the colliding shard stops splitting and grows as a plain table.
        let mut exts = same[..1_000].to_vec();
        exts.extend((1..20_000u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
        let (mut state, nodes) = filled(&exts);
        let mut model: HashMap<u64, u32> = numbered(&exts);
        check(&state, &nodes, &model);
        for &absent in &same[1_000..] {
            assert_eq!(state.get(&nodes, ExternalHash(absent)), None);
            assert_eq!(
                state.remove(&nodes, ExternalHash(absent), &mut OwnLog::default()),
                None
            );
        }
        // Storing a colliding hash again replaces its own entry only.
        assert_eq!(
            state.insert_own(&nodes, ExternalHash(same[7]), 8, &mut OwnLog::default()),
            Some(8)
        );
        for &e in same[..1_000].iter().step_by(3) {
            let node = model.remove(&e);
            assert_eq!(
                state.remove(&nodes, ExternalHash(e), &mut OwnLog::default()),
                node
            );
        }
        check(&state, &nodes, &model);
    }

    #[test]
    fn growing_and_splitting_keeps_every_block() {
        let exts: Vec<u64> = (1..=150_000u64)
            .map(|i| i.wrapping_mul(0xA076_1D64_78BD_642F))
            .collect();
        let (state, nodes) = filled(&exts[..3_584]);
        assert_eq!(state.blocks.shard_buckets().count(), 0, "one small table");
        let model: HashMap<u64, u32> = numbered(&exts[..3_584]);
        check(&state, &nodes, &model);
        let (state, nodes) = filled(&exts);
        assert!(
            state.blocks.shard_buckets().count() > 256,
            "split many times"
        );
        let model: HashMap<u64, u32> = numbered(&exts);
        check(&state, &nodes, &model);
        // Eight bytes per entry and a control byte per bucket, at a load of 7/16 to 7/8.
        let per_entry = state.blocks.allocation_size() as f64 / exts.len() as f64;
        assert!(
            (9.0 * 8.0 / 7.0..=13.0 * 16.0 / 7.0 + 0.5).contains(&per_entry),
            "{per_entry}"
        );
        assert!(per_entry >= 13.0 * 8.0 / 7.0, "{per_entry}");
    }

    #[test]
    fn removed_and_unmapped_blocks_are_gone_and_the_rest_stay() {
        let exts: Vec<u64> = (1..=10_000u64)
            .map(|i| i.wrapping_mul(0xE703_7ED1_A0B4_28DB))
            .collect();
        let (mut state, nodes) = filled(&exts);
        let mut model: HashMap<u64, u32> = numbered(&exts);
        for (i, &e) in exts.iter().enumerate() {
            let node = i as u32 + 1;
            match i % 3 {
                0 => assert_eq!(
                    state.remove(&nodes, ExternalHash(e), &mut OwnLog::default()),
                    Some(node)
                ),
                1 => assert_eq!(state.unmap(&nodes, node, &mut OwnLog::default()), 1),
                _ => continue,
            }
            model.remove(&e);
            assert_eq!(state.get(&nodes, ExternalHash(e)), None);
            assert_eq!(
                state.remove(&nodes, ExternalHash(e), &mut OwnLog::default()),
                None
            );
            assert_eq!(state.unmap(&nodes, node, &mut OwnLog::default()), 0);
        }
        check(&state, &nodes, &model);
        for &e in model.keys() {
            assert!(
                state
                    .remove(&nodes, ExternalHash(e), &mut OwnLog::default())
                    .is_some()
            );
        }
        assert!(state.blocks.is_empty());
    }

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
