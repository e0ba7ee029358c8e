//! Declared capacities (`total_kv_blocks`): a bounded worker key's blocks beyond its bound
//! are evicted oldest first and leaf first, in the order `crate::capacity` keeps.

use kv_types::WorkerKey;

use super::node::Node;
use super::node::{Memo, NONE};
use super::trie::PrefixIndex;
use crate::capacity::{Capacity, Entry, node_of, tag_of};

/// Whether `slot` still holds the block of gain-order entry `e`: its node is live, held by
/// `slot`, and still the block the entry was made for (a freed node taken by another block
/// has another engine hash).
#[inline]
fn holds_entry(nodes: &[Node], slot: u32, e: Entry) -> bool {
    nodes
        .get(node_of(e) as usize)
        .is_some_and(|x| x.parent != NONE && x.tag() == tag_of(e) && x.owners.contains(slot))
}

impl PrefixIndex {
    /// Declares (`Some`) or withdraws (`None`) the capacity of `worker` in blocks: from now
    /// on it never holds more than `blocks` device blocks here. Blocks beyond it are
    /// evicted at once, and by every later store that would exceed it, oldest first and
    /// leaf-first (a block goes only when the worker holds none of its children), so a
    /// worker's chains never lose a middle block to eviction. Returns the blocks evicted
    /// now. Withdrawing also forgets the key's eviction count.
    pub fn set_capacity(&mut self, worker: WorkerKey, blocks: Option<u32>) -> u32 {
        let slot = self.slot_of.get(&worker).copied();
        let Some(limit) = blocks else {
            self.limits.remove(&worker);
            self.evictions.remove(&worker);
            if let Some(state) = slot.and_then(|s| self.workers[s as usize].as_mut()) {
                state.cap = None;
            }
            return 0;
        };
        self.limits.insert(worker, limit);
        self.evictions.entry(worker).or_insert(0);
        let Some(slot) = slot else {
            return 0;
        };
        let nodes = &self.nodes;
        let Some(state) = self.workers[slot as usize].as_mut() else {
            return 0;
        };
        match &mut state.cap {
            Some(cap) => cap.set_limit(limit),
            None => {
                // Blocks held before the declaration have no known age: id order.
                let mut held: Vec<u32> = state.blocks.iter().map(|e| e.node).collect();
                held.extend(state.foreign.values().copied());
                held.retain(|&n| nodes[n as usize].owners.contains(slot));
                held.sort_unstable();
                held.dedup();
                if held.len() < state.owned as usize {
                    // Blocks held without a hash (an engine reused the hash elsewhere).
                    held = (1..nodes.len() as u32)
                        .filter(|&n| {
                            let node = &nodes[n as usize];
                            node.parent != NONE && node.owners.contains(slot)
                        })
                        .collect();
                }
                let mut cap = Capacity::new(limit);
                for n in held {
                    let node = &nodes[n as usize];
                    cap.gained(n, node.tag(), node.parent);
                }
                state.cap = Some(cap);
            }
        }
        self.enforce_capacity(slot)
    }

    /// The declared capacity of `worker`, if any.
    pub fn capacity(&self, worker: WorkerKey) -> Option<u32> {
        self.limits.get(&worker).copied()
    }

    /// Blocks evicted so far because a worker key exceeded its declared capacity, all keys
    /// together (including keys removed since).
    pub fn capacity_evicted_total(&self) -> u64 {
        self.evicted_total
    }

    /// Blocks evicted so far because `worker` exceeded its declared capacity.
    pub fn capacity_evicted(&self, worker: WorkerKey) -> u64 {
        self.evictions.get(&worker).copied().unwrap_or(0)
    }

    /// Blocks evicted so far per worker key with a declared capacity (0 for one that never
    /// exceeded it), in no particular order.
    pub fn capacity_evictions(&self) -> impl Iterator<Item = (WorkerKey, u64)> + '_ {
        self.evictions.iter().map(|(&k, &n)| (k, n))
    }

    /// Evicts `slot`'s blocks while it holds more than its capacity; returns how many.
    /// Also compacts its gain order (the only place it grows is a store, which ends here).
    pub(super) fn enforce_capacity(&mut self, slot: u32) -> u32 {
        let nodes = &self.nodes;
        let holds = |e: Entry| holds_entry(nodes, slot, e);
        let Some(state) = self.workers[slot as usize].as_mut() else {
            return 0;
        };
        let Some(cap) = &mut state.cap else {
            return 0;
        };
        cap.trim_front(state.owned, holds);
        cap.maybe_compact(state.owned, holds);
        cap.count_ahead(state.owned, holds, |n| nodes[n as usize].parent);
        if state.owned <= cap.limit() {
            return 0;
        }
        // Evictions are a different one-slot delta than the store before them.
        self.memo = Memo::default();
        let mut evicted = 0;
        loop {
            let nodes = &self.nodes;
            let Some(state) = self.workers[slot as usize].as_mut() else {
                break;
            };
            let Some(cap) = &mut state.cap else {
                break;
            };
            if state.owned <= cap.limit() {
                break;
            }
            let holds = |e: Entry| holds_entry(nodes, slot, e);
            let Some(victim) = cap.victim(holds, |n| nodes[n as usize].parent) else {
                break;
            };
            let parent = nodes[victim as usize].parent;
            cap.lost(victim, parent);
            let unmapped = state.unmap(nodes, victim, &mut self.own_log);
            state.owned -= 1;
            let n = &mut self.nodes[victim as usize];
            n.refs -= unmapped;
            n.owners.remove(slot);
            self.memberships -= 1;
            self.owners_changed(victim);
            self.prune(victim);
            evicted += 1;
        }
        if evicted > 0 {
            self.versions += 1;
            if let Some(state) = self.workers[slot as usize].as_mut() {
                state.version = self.versions;
                *self.evictions.entry(state.key).or_insert(0) += u64::from(evicted);
                self.evicted_total += u64::from(evicted);
            }
        }
        evicted
    }
}

#[cfg(test)]
mod tests {
    use kv_types::{ExternalHash, WorkerKey};

    use crate::primary::node::{NONE, ROOT};
    use crate::primary::tests::{blocks, q};
    use crate::{OverlapScores, PrefixIndex, StoreOutcome};

    /// Every block `worker` holds has its parent held too (or is a root child).
    fn assert_prefix_closed(idx: &PrefixIndex, worker: WorkerKey) {
        let slot = idx.slot_of[&worker];
        for (id, n) in idx.nodes.iter().enumerate().skip(1) {
            if n.parent != NONE && n.owners.contains(slot) && n.parent != ROOT {
                let p = &idx.nodes[n.parent as usize];
                assert!(p.owners.contains(slot), "node {id} held without its parent");
            }
        }
    }

    /// A removed block's node is freed and taken by the worker's next store: the new
    /// block is the youngest, whatever the gain-order place of the node's old block.
    #[test]
    fn a_recycled_node_is_evicted_by_its_new_blocks_age() {
        let mut idx = PrefixIndex::new();
        let w = WorkerKey::new(1, 0);
        assert_eq!(idx.set_capacity(w, Some(2)), 0);
        idx.apply_stored(w, None, &blocks(&[(1, 11)]));
        idx.apply_stored(w, None, &blocks(&[(2, 12)]));
        assert_eq!(idx.apply_removed(w, &[ExternalHash(11)]).not_found, 0);
        // Block 3 takes the node block 1 had; block 2 is now the oldest, and block 4
        // takes the worker past its capacity.
        idx.apply_stored(w, None, &blocks(&[(3, 13)]));
        idx.apply_stored(w, None, &blocks(&[(4, 14)]));
        idx.check_invariants();
        assert_eq!(idx.worker_blocks(w), 2);
        let score = |idx: &PrefixIndex, local: u64| {
            let mut out = OverlapScores::new();
            idx.find_matches(&q(&[local]), &mut out);
            out.score(w)
        };
        assert_eq!(score(&idx, 2), 0, "the oldest block was kept");
        assert_eq!(
            (score(&idx, 3), score(&idx, 4)),
            (1, 1),
            "the recycled node's new block was evicted"
        );
        // One more: block 3 is now the oldest.
        idx.apply_stored(w, None, &blocks(&[(5, 15)]));
        assert_eq!((score(&idx, 3), score(&idx, 4), score(&idx, 5)), (0, 1, 1));
        assert_eq!(idx.capacity_evictions().collect::<Vec<_>>(), [(w, 2)]);
    }

    /// A worker filling its capacity store by store, with removals and hashes stored
    /// again on the way, has its child counts built ahead a step per store (exact at every
    /// step, `check_invariants`) and complete before the store that first exceeds the
    /// capacity, which then evicts its oldest chain leaf-first.
    #[test]
    fn the_child_counts_are_built_ahead_of_the_first_eviction() {
        let mut idx = PrefixIndex::new();
        let w = WorkerKey::new(1, 0);
        let limit = 8_000u32;
        assert_eq!(idx.set_capacity(w, Some(limit)), 0);
        let chain = |k: u64| {
            blocks(
                &(0..8)
                    .map(|i| (k * 8 + i + 1, k * 8 + i + 1))
                    .collect::<Vec<_>>(),
            )
        };
        let cap = |idx: &PrefixIndex| {
            let slot = idx.slot_of[&w];
            let state = idx.workers[slot as usize].as_ref().expect("state");
            let c = state.cap.as_ref().expect("capacity");
            (c.counts_ahead().is_some(), c.child_counts().is_some())
        };
        let (mut ahead_stores, mut k) = (0, 0u64);
        while idx.worker_blocks(w) < limit {
            assert_eq!(idx.apply_stored(w, None, &chain(k)), StoreOutcome::Applied);
            // Every seventh store, the chain two before loses its tail, stored again next.
            if k % 7 == 6 {
                let tail: Vec<_> = (5..8)
                    .rev()
                    .map(|i| ExternalHash((k - 2) * 8 + i + 1))
                    .collect();
                idx.apply_removed(w, &tail);
                idx.apply_stored(w, None, &chain(k - 2));
            }
            let (ahead, done) = cap(&idx);
            ahead_stores += u32::from(ahead);
            assert!(!done || idx.worker_blocks(w) * 8 >= limit * 7);
            if ahead && k % 16 == 0 {
                idx.check_invariants();
            }
            k += 1;
        }
        idx.check_invariants();
        assert!(
            ahead_stores >= 4,
            "counted ahead over {ahead_stores} stores"
        );
        assert_eq!(
            cap(&idx),
            (false, true),
            "the counts are ready at the capacity"
        );
        // Past it: chain 0 goes, leaf first.
        idx.apply_stored(w, None, &chain(k));
        idx.check_invariants();
        assert_eq!(idx.capacity_evicted(w), 8);
        assert_prefix_closed(&idx, w);
        let mut out = OverlapScores::new();
        idx.find_matches(&q(&[1]), &mut out);
        assert_eq!(out.score(w), 0, "the oldest chain is gone");
        idx.find_matches(&q(&[9, 10]), &mut out);
        assert_eq!(out.score(w), 2);
    }

    #[test]
    fn capacity_evicts_the_oldest_chain_leaf_first() {
        let mut idx = PrefixIndex::new();
        let w = WorkerKey::new(1, 0);
        assert_eq!(idx.set_capacity(w, Some(4)), 0);
        idx.apply_stored(w, None, &blocks(&[(1, 11), (2, 12), (3, 13)]));
        idx.apply_stored(w, None, &blocks(&[(5, 15), (6, 16)]));
        idx.check_invariants();
        assert_eq!(idx.worker_blocks(w), 4);
        assert_prefix_closed(&idx, w);
        let mut out = OverlapScores::new();
        // The oldest chain lost its leaf; the new one is whole.
        idx.find_matches(&q(&[1, 2, 3]), &mut out);
        assert_eq!(out.score(w), 2);
        idx.find_matches(&q(&[5, 6]), &mut out);
        assert_eq!(out.score(w), 2);
        assert_eq!(idx.capacity_evictions().collect::<Vec<_>>(), [(w, 1)]);
        // The evicted block is forgotten by its hash and its node freed.
        assert_eq!(idx.stats().nodes, 4);
        assert_eq!(idx.apply_removed(w, &[ExternalHash(13)]).not_found, 1);
        // A store under a kept block extends it; the oldest leaf (2) goes first.
        idx.apply_stored(w, Some(ExternalHash(16)), &blocks(&[(7, 17), (8, 18)]));
        idx.check_invariants();
        assert_prefix_closed(&idx, w);
        idx.find_matches(&q(&[1, 2]), &mut out);
        assert_eq!(out.score(w), 0);
        idx.find_matches(&q(&[5, 6, 7, 8]), &mut out);
        assert_eq!(out.score(w), 4);
        assert_eq!(idx.capacity_evictions().collect::<Vec<_>>(), [(w, 3)]);
        assert_eq!(idx.capacity_evicted_total(), 3);
        // One worker: no owner list on the heap, so the estimate is exact.
        assert_eq!(idx.estimated_bytes(), idx.allocated_bytes());
    }

    #[test]
    fn a_store_longer_than_the_capacity_keeps_its_head() {
        let mut idx = PrefixIndex::new();
        let (w, other) = (WorkerKey::new(1, 0), WorkerKey::new(2, 0));
        idx.set_capacity(w, Some(3));
        let chain: Vec<(u64, u64)> = (1..=10).map(|i| (i, 100 + i)).collect();
        idx.apply_stored(other, None, &blocks(&chain));
        idx.apply_stored(w, None, &blocks(&chain));
        idx.check_invariants();
        assert_prefix_closed(&idx, w);
        let mut out = OverlapScores::new();
        idx.find_matches(&q(&(1..=10).collect::<Vec<_>>()), &mut out);
        assert_eq!((out.score(w), out.score(other)), (3, 10));
        assert_eq!(idx.worker_blocks(w), 3);
        assert_eq!(idx.stats().memberships, 13);
    }

    #[test]
    fn a_block_stored_under_two_hashes_leaves_no_mapping_when_evicted() {
        let mut idx = PrefixIndex::new();
        let (a, b) = (WorkerKey::new(1, 0), WorkerKey::new(2, 0));
        idx.apply_stored(a, None, &blocks(&[(1, 11)]));
        // b names the node by two hashes of its own, and by the node's own hash.
        idx.apply_stored(b, None, &blocks(&[(1, 21)]));
        idx.apply_stored(b, None, &blocks(&[(1, 22)]));
        idx.apply_stored(b, None, &blocks(&[(1, 11)]));
        idx.check_invariants();
        idx.set_capacity(b, Some(1));
        idx.apply_stored(b, None, &blocks(&[(2, 23)]));
        idx.check_invariants();
        assert_eq!(idx.worker_blocks(b), 1);
        let removed = idx.apply_removed(b, &[ExternalHash(21), ExternalHash(22), ExternalHash(11)]);
        assert_eq!((removed.removed, removed.not_found), (0, 3));
        assert_eq!(
            idx.apply_stored(b, Some(ExternalHash(21)), &blocks(&[(3, 24)])),
            StoreOutcome::ParentNotFound
        );
        assert!(idx.remove_worker_key(a));
        // Only b's remaining block is left: no node kept alive by a stale hash.
        assert_eq!(idx.stats().nodes, 1);
    }

    #[test]
    fn declaring_a_capacity_below_what_is_held_evicts_at_once() {
        let mut idx = PrefixIndex::new();
        let w = WorkerKey::new(1, 0);
        idx.apply_stored(w, None, &blocks(&[(1, 11), (2, 12), (3, 13)]));
        idx.apply_stored(w, Some(ExternalHash(11)), &blocks(&[(4, 14)]));
        assert_eq!(idx.set_capacity(w, Some(2)), 2);
        idx.check_invariants();
        assert_prefix_closed(&idx, w);
        assert_eq!(idx.worker_blocks(w), 2);
        // Cleared keeps the declaration; withdrawing it forgets the count.
        idx.remove_worker_key(w);
        assert_eq!(idx.capacity(w), Some(2));
        idx.apply_stored(w, None, &blocks(&[(1, 11), (2, 12), (3, 13)]));
        assert_eq!(idx.worker_blocks(w), 2);
        assert_eq!(idx.capacity_evictions().collect::<Vec<_>>(), [(w, 3)]);
        idx.set_capacity(w, None);
        assert_eq!(idx.capacity_evictions().count(), 0);
        idx.apply_stored(w, Some(ExternalHash(12)), &blocks(&[(3, 13), (4, 14)]));
        assert_eq!(idx.worker_blocks(w), 4);
    }

    /// Removals out of gain order make the worker's gain order compact a step per store;
    /// stores, removals and a capacity declared in the middle of a compaction keep the
    /// trie's invariants, and the declaration evicts exactly the oldest blocks held.
    #[test]
    fn a_compaction_spread_over_stores_keeps_the_oldest_first_eviction() {
        let mut idx = PrefixIndex::new();
        let w = WorkerKey::new(1, 0);
        assert_eq!(idx.set_capacity(w, Some(100_000)), 0);
        // Chain k: locals 2k+1 -> 2k+2, engine hashes 1,000 higher.
        let chain = |k: u64| blocks(&[(2 * k + 1, 2 * k + 1001), (2 * k + 2, 2 * k + 1002)]);
        let remove = |idx: &mut PrefixIndex, k: u64| {
            let hashes = [ExternalHash(2 * k + 1002), ExternalHash(2 * k + 1001)];
            assert_eq!(idx.apply_removed(w, &hashes).not_found, 0);
        };
        for k in 0..1_000 {
            assert_eq!(idx.apply_stored(w, None, &chain(k)), StoreOutcome::Applied);
        }
        // Three in four chains go, scattered: 1,500 stale entries for 500 held blocks.
        for k in (0..1_000).filter(|k| k % 4 != 0) {
            remove(&mut idx, k);
        }
        // Stores now compact a step each; more removals come in between.
        let compacting = |idx: &PrefixIndex| {
            let state = idx.workers[idx.slot_of[&w] as usize].as_ref();
            state
                .and_then(|s| s.cap.as_ref())
                .is_some_and(|c| c.compacting())
        };
        let mut running = 0;
        for k in 1_000..1_010 {
            idx.apply_stored(w, None, &chain(k));
            running += usize::from(compacting(&idx));
            idx.check_invariants();
            remove(&mut idx, 12 * (k - 1_000));
        }
        // About 2,000 entries at 256 a store: eight stores, then done.
        assert!(
            running >= 5 && !compacting(&idx),
            "ran over {running} stores"
        );
        let held: Vec<u64> = (0..1_010)
            .filter(|&k| {
                let [a, b] = [2 * k + 1, 2 * k + 2];
                idx.holds(w, &q(&[a, b]))
            })
            .collect();
        assert_eq!(idx.worker_blocks(w) as usize, 2 * held.len());
        // A capacity of 100 blocks keeps the 50 youngest chains whole.
        let evicted = idx.set_capacity(w, Some(100));
        assert_eq!(evicted as usize, 2 * held.len() - 100);
        idx.check_invariants();
        assert_prefix_closed(&idx, w);
        for (i, &k) in held.iter().enumerate() {
            let young = i >= held.len() - 50;
            let [a, b] = [2 * k + 1, 2 * k + 2];
            assert_eq!(idx.holds(w, &q(&[a, b])), young, "chain {k}");
            assert_eq!(idx.holds(w, &q(&[a])), young, "head of chain {k}");
        }
    }
}
