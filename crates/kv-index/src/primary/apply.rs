//! The write path of the trie: the `Stored`, `Removed` and `Cleared` operations
//! (`spec/indexing.md` §2.1–§2.3) and the removal of a whole worker.

use kv_types::{ExternalHash, StoredBlock, WorkerId, WorkerKey};

use super::node::{Memo, NONE, ROOT};
use super::trie::{PrefixIndex, next_layout};
use crate::capacity::Capacity;

/// Result of applying one `Stored` to the primary.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum StoreOutcome {
    /// At least one block was added or moved.
    Applied,
    /// Every block was already held at the same place (`duplicate_store` warning).
    Duplicate,
    /// No blocks: nothing to do.
    Empty,
    /// The parent hash is unknown to this worker or no longer owned: nothing applied.
    ParentNotFound,
}

/// Result of applying one `Removed`.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct RemoveOutcome {
    /// Hashes that were known to the worker and are now forgotten.
    pub removed: u32,
    /// Hashes the worker did not have (`block_not_found`), skipped.
    pub not_found: u32,
}

impl PrefixIndex {
    /// Applies `Stored(worker, parent_hash, blocks)` (§2.1).
    pub fn apply_stored(
        &mut self,
        worker: WorkerKey,
        parent_hash: Option<ExternalHash>,
        blocks: &[StoredBlock],
    ) -> StoreOutcome {
        if blocks.is_empty() {
            return StoreOutcome::Empty;
        }
        self.memo = Memo::default();
        let start = match parent_hash {
            None => ROOT,
            Some(parent) => {
                let found = self.slot_of.get(&worker).and_then(|&slot| {
                    let state = self.workers[slot as usize].as_ref()?;
                    let node = state.get(&self.nodes, parent)?;
                    self.nodes[node as usize]
                        .owners
                        .contains(slot)
                        .then_some(node)
                });
                match found {
                    Some(node) => node,
                    None => return StoreOutcome::ParentNotFound,
                }
            }
        };
        // The first block's child lookup (a child-map probe where the chain branches off)
        // goes before the block-table probes of `warm`, which do not wait for it, so
        // their cache misses overlap with its.
        let mut first = Some(self.child(start, blocks[0].tokens_hash.0));
        let slot = self.slot_for(worker);
        if let Some(state) = self.workers[slot as usize].as_ref() {
            state.warm(&self.nodes, blocks);
        }
        let mut changed = false;
        let mut gained = 0u32;
        let mut cur = start;
        // Whether `cur` is a leaf this call created: owned by `slot` alone, no children
        // but the ones this loop adds. Its child is then known to be new, and nothing of it
        // is read back (see `alloc_node`).
        let mut cur_new = false;
        for block in blocks {
            let existing = match first.take() {
                Some(existing) => existing,
                None if cur_new => None,
                None => self.child(cur, block.tokens_hash.0),
            };
            let (child, gain) = match existing {
                Some(c) => {
                    let gain = self.nodes[c as usize].owners.insert(slot);
                    if gain {
                        gained += 1;
                        self.owners_changed(c);
                    }
                    (c, gain)
                }
                None => {
                    // Created owned: no owner-set change to propagate.
                    gained += 1;
                    let c = self.alloc_node(
                        cur,
                        cur_new,
                        block.tokens_hash.0,
                        block.block_hash.0,
                        slot,
                    );
                    (c, true)
                }
            };
            let child_new = existing.is_none();
            let (nodes, log) = (&self.nodes, &mut self.own_log);
            let previous = self.workers[slot as usize].as_mut().and_then(|state| {
                if gain && let Some(cap) = &mut state.cap {
                    // A new node's tag is its block's: not read back from the node.
                    let tag = if child_new {
                        block.block_hash.0 as u32
                    } else {
                        nodes[child as usize].tag()
                    };
                    cap.gained(child, tag, cur);
                }
                if child_new {
                    // A new node's `external` is this block's hash.
                    state.insert_own(nodes, block.block_hash, child, log)
                } else {
                    state.insert(nodes, block.block_hash, child, log)
                }
            });
            if previous != Some(child) {
                changed = true;
                if !child_new {
                    // A new node counts this entry already (`alloc_node`).
                    self.nodes[child as usize].refs += 1;
                }
                if let Some(old) = previous {
                    self.nodes[old as usize].refs -= 1;
                    self.prune(old);
                }
            }
            cur = child;
            cur_new = child_new;
        }
        if gained > 0 {
            changed = true;
            self.memberships += gained as usize;
            if let Some(state) = self.workers[slot as usize].as_mut() {
                state.owned += gained;
            }
        }
        if changed {
            self.versions += 1;
            if let Some(state) = self.workers[slot as usize].as_mut() {
                state.version = self.versions;
            }
            if gained > 0 {
                self.enforce_capacity(slot);
            }
        }
        if changed {
            StoreOutcome::Applied
        } else {
            StoreOutcome::Duplicate
        }
    }

    /// Applies `Removed(worker, hashes)` (§2.2): each hash independently, unknown skipped.
    pub fn apply_removed(&mut self, worker: WorkerKey, hashes: &[ExternalHash]) -> RemoveOutcome {
        let mut out = RemoveOutcome::default();
        let Some(&slot) = self.slot_of.get(&worker) else {
            out.not_found = hashes.len() as u32;
            return out;
        };
        let Some(state) = self.workers[slot as usize].as_mut() else {
            out.not_found = hashes.len() as u32;
            return out;
        };
        // Two passes: the map probes are independent of each other, so the CPU overlaps
        // their cache misses instead of serializing them behind each node's update. Map
        // entries only point at nodes with `refs > 0`, which the second pass is the first
        // to prune, so the order of effects is that of one pass.
        let mut found = std::mem::take(&mut self.scratch);
        found.clear();
        self.memo = Memo::default();
        for &hash in hashes {
            match state.remove(&self.nodes, hash, &mut self.own_log) {
                Some(node) => found.push(node),
                None => out.not_found += 1,
            }
        }
        if state.blocks.is_empty() {
            // Frees the shards with the tombstones the removes left, which would otherwise
            // cost in-place rehashes (reading every entry's node) on the next fill.
            state.blocks.clear();
        }
        out.removed = found.len() as u32;
        let counting = state.cap.as_ref().is_some_and(Capacity::counting);
        let mut lost = 0;
        for &node in &found {
            let n = &mut self.nodes[node as usize];
            n.refs -= 1;
            if n.owners.remove(slot) {
                lost += 1;
                if counting {
                    let parent = n.parent;
                    if let Some(cap) = self.workers[slot as usize]
                        .as_mut()
                        .and_then(|s| s.cap.as_mut())
                    {
                        cap.lost(node, parent);
                    }
                }
                self.owners_changed(node);
            }
            self.prune(node);
        }
        self.memberships -= lost as usize;
        self.versions += 1;
        if let Some(state) = self.workers[slot as usize].as_mut() {
            state.owned -= lost;
            if out.removed > 0 || lost > 0 {
                state.version = self.versions;
            }
            if let Some(cap) = &mut state.cap {
                if state.owned == 0 {
                    cap.clear();
                } else {
                    cap.relax(state.owned);
                }
            }
        }
        self.scratch = found;
        out
    }

    /// `Cleared(worker)` / remove one rank: forgets everything of that worker key.
    /// Returns whether the worker key had any state.
    pub fn remove_worker_key(&mut self, worker: WorkerKey) -> bool {
        let Some(slot) = self.slot_of.remove(&worker) else {
            return false;
        };
        let Some(state) = self.workers[slot as usize].take() else {
            return false;
        };
        self.memo = Memo::default();
        let mut owned = state.owned;
        for node in (state.blocks.into_iter().map(|e| e.node)).chain(state.foreign.into_values()) {
            let n = &mut self.nodes[node as usize];
            n.refs -= 1;
            if n.owners.remove(slot) {
                owned -= 1;
                self.memberships -= 1;
                self.owners_changed(node);
            }
            self.prune(node);
        }
        if owned > 0 {
            // Ownership without a map entry only exists after an engine reused an external
            // hash at another position; find the rest by a full scan (rare path).
            for id in 1..self.nodes.len() {
                let n = &mut self.nodes[id];
                if n.parent != NONE && n.owners.remove(slot) {
                    self.memberships -= 1;
                    self.owners_changed(id as u32);
                    self.prune(id as u32);
                }
            }
        }
        self.free_slots.push(slot);
        self.layout = next_layout();
        true
    }

    /// Removes every rank of `worker_id`, with their declared capacities and eviction
    /// counts. Returns the removed keys' count.
    pub fn remove_worker_id(&mut self, worker_id: WorkerId) -> usize {
        if !self.limits.is_empty() {
            self.limits.retain(|k, _| k.worker_id != worker_id);
            self.evictions.retain(|k, _| k.worker_id != worker_id);
        }
        let keys: Vec<WorkerKey> = self
            .slot_of
            .keys()
            .filter(|k| k.worker_id == worker_id)
            .copied()
            .collect();
        for key in &keys {
            self.remove_worker_key(*key);
        }
        keys.len()
    }
}

#[cfg(test)]
mod tests {
    use kv_types::{ExternalHash, WorkerKey};

    use crate::primary::tests::{blocks, q};
    use crate::{OverlapScores, PrefixIndex, PrefixIndexStats, StoreOutcome};

    #[test]
    fn external_hash_reused_elsewhere_is_fully_cleared() {
        let mut idx = PrefixIndex::new();
        let w = WorkerKey::new(1, 0);
        idx.apply_stored(w, None, &blocks(&[(1, 11)]));
        // Same external hash at a different position: the map moves, ownership stays.
        idx.apply_stored(w, None, &blocks(&[(2, 11)]));
        assert_eq!(idx.stats().memberships, 2);
        idx.remove_worker_key(w);
        assert_eq!(idx.stats(), PrefixIndexStats::default());
    }

    #[test]
    fn store_whose_remap_prunes_its_own_path_recreates_the_node() {
        let mut idx = PrefixIndex::new();
        let w = WorkerKey::new(1, 0);
        idx.apply_stored(w, None, &blocks(&[(1, 11), (2, 12), (3, 13)]));
        // Ext 14 also maps to the third node, then that node and the second lose `w`.
        idx.apply_stored(w, None, &blocks(&[(1, 11), (2, 12), (3, 14)]));
        idx.apply_removed(w, &[ExternalHash(13), ExternalHash(12)]);
        // Moving 14 to the first node frees the third and then the second node, which the
        // same store's next block (2, 99) steps into: it must be created again (a store
        // that looked its path up before changing anything would write into a freed node).
        let outcome = idx.apply_stored(w, None, &blocks(&[(1, 14), (2, 99)]));
        assert_eq!(outcome, StoreOutcome::Applied);
        idx.check_invariants();
        let mut out = OverlapScores::new();
        idx.find_matches(&q(&[1, 2, 3]), &mut out);
        assert_eq!(out.score(w), 2);
        assert_eq!(idx.stats().nodes, 2);
        assert!(idx.remove_worker_key(w));
        assert_eq!(idx.stats(), PrefixIndexStats::default());
    }
}
