//! The trie's storage: the node slab, the child links, the worker slots, and the structural
//! upkeep every change goes through (allocation, first-child bits, pruning). The write path,
//! the queries, the capacity evictions and the dump are further `impl PrefixIndex` blocks in
//! the sibling files.

use kv_types::WorkerKey;
use rustc_hash::FxHashMap;

use super::logged::{Branches, Logged, OwnLog};
use super::node::{FC_SAME, KIDS, Memo, NONE, Node, ROOT};
use super::worker::WorkerState;
use crate::capacity::Capacity;

/// Size figures of a [`PrefixIndex`].
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct PrefixIndexStats {
    /// Live trie nodes (without the root).
    pub nodes: usize,
    /// (worker key, node) memberships.
    pub memberships: usize,
    /// Worker keys with state.
    pub workers: usize,
}

/// The exact per-block prefix index of one partition's device tier.
///
/// Single-writer: wrap it (see [`crate::SharedKvIndex`]) to share it between tasks.
#[derive(Debug)]
pub struct PrefixIndex {
    pub(super) nodes: Logged<Node>,
    pub(super) free_nodes: Vec<u32>,
    /// Children other than a node's inline first child, keyed by (parent, local hash).
    /// Grows in shards, so no store moves the whole map under the write lock.
    pub(super) branches: Branches,
    pub(super) workers: Logged<Option<WorkerState>>,
    /// Own-hash changes of the worker states, for a mirror (see `logged.rs`).
    pub(super) own_log: OwnLog,
    pub(super) slot_of: FxHashMap<WorkerKey, u32>,
    pub(super) free_slots: Vec<u32>,
    pub(super) live_nodes: usize,
    pub(super) memberships: usize,
    /// Reused buffer of `apply_removed`.
    pub(super) scratch: Vec<u32>,
    pub(super) memo: Memo,
    /// The last worker-state version handed out.
    pub(super) versions: u64,
    /// Changes whenever a slot is given to a worker key or freed (see [`SlotDepths`]);
    /// unique across all indexes of the process, so a buffer used with another index never
    /// mistakes its keys for this one's.
    ///
    /// [`SlotDepths`]: crate::SlotDepths
    pub(super) layout: u64,
    /// Declared capacities (`total_kv_blocks`) per worker key, kept while the key has no
    /// state (before its first store, after a `Cleared`).
    pub(super) limits: FxHashMap<WorkerKey, u32>,
    /// Blocks evicted because a worker key exceeded its capacity, per key with a capacity.
    pub(super) evictions: FxHashMap<WorkerKey, u64>,
    /// All capacity evictions of this index, monotonic.
    pub(super) evicted_total: u64,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new()
    }
}

/// A new slot-layout id, never handed out before in this process.
pub(super) fn next_layout() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl PrefixIndex {
    pub fn new() -> Self {
        PrefixIndex {
            nodes: Logged::new(vec![Node::new(NONE, 0, 0)]),
            free_nodes: Vec::new(),
            branches: Branches::default(),
            workers: Logged::new(Vec::new()),
            own_log: OwnLog::default(),
            slot_of: FxHashMap::default(),
            free_slots: Vec::new(),
            live_nodes: 0,
            memberships: 0,
            scratch: Vec::new(),
            memo: Memo::default(),
            versions: 0,
            layout: next_layout(),
            limits: FxHashMap::default(),
            evictions: FxHashMap::default(),
            evicted_total: 0,
        }
    }

    pub fn stats(&self) -> PrefixIndexStats {
        PrefixIndexStats {
            nodes: self.live_nodes,
            memberships: self.memberships,
            workers: self.slot_of.len(),
        }
    }

    /// Bytes allocated by the index (slab, maps, owner vectors, per-worker maps), by
    /// capacity; allocator overhead is not included. O(nodes): a diagnostic, not for hot
    /// paths.
    pub fn allocated_bytes(&self) -> usize {
        let heap_owners: usize = self.nodes.iter().map(|n| n.owners.heap_bytes()).sum();
        self.structure_bytes() + heap_owners
    }

    /// The slab, the child and slot maps and every worker key's state, by capacity: all of
    /// the index but the owner lists nodes keep on the heap.
    fn structure_bytes(&self) -> usize {
        let workers: usize = self
            .workers
            .iter()
            .flatten()
            .map(WorkerState::allocated_bytes)
            .sum();
        self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.free_nodes.capacity() * std::mem::size_of::<u32>()
            + self.branches.allocation_size()
            + self.workers.capacity() * std::mem::size_of::<Option<WorkerState>>()
            + self.slot_of.capacity() * (std::mem::size_of::<(WorkerKey, u32)>() + 1)
            + self.free_slots.capacity() * std::mem::size_of::<u32>()
            + workers
    }

    /// [`PrefixIndex::allocated_bytes`] in O(worker keys), for scrape-time gauges: the
    /// slab, the child and slot maps and every worker key's maps by capacity, and the heap
    /// owner lists estimated as one `u32` per membership beyond three per node (a bound
    /// that counts only shared nodes; most nodes keep their owners inline).
    pub fn estimated_bytes(&self) -> usize {
        let heap_owners =
            self.memberships.saturating_sub(3 * self.live_nodes) * std::mem::size_of::<u32>();
        self.structure_bytes() + heap_owners
    }

    /// Worker keys that currently have state, in no particular order.
    pub fn worker_keys(&self) -> impl Iterator<Item = WorkerKey> + '_ {
        self.slot_of.keys().copied()
    }

    /// The device blocks `worker` holds here (memberships, reachable from the root or not).
    pub fn worker_blocks(&self, worker: WorkerKey) -> u32 {
        self.slot_of
            .get(&worker)
            .and_then(|&s| self.workers[s as usize].as_ref())
            .map_or(0, |s| s.owned)
    }

    /// The version of `worker`'s state (`None` without one): equal to a version read
    /// earlier exactly when nothing was stored for or removed from `worker` in between.
    pub fn worker_version(&self, worker: WorkerKey) -> Option<u64> {
        let &slot = self.slot_of.get(&worker)?;
        self.workers[slot as usize].as_ref().map(|s| s.version)
    }

    pub(super) fn slot_for(&mut self, worker: WorkerKey) -> u32 {
        if let Some(&slot) = self.slot_of.get(&worker) {
            return slot;
        }
        self.versions += 1;
        let slot = self
            .free_slots
            .pop()
            .unwrap_or_else(|| self.workers.push(None));
        let mut state = WorkerState::new(worker, slot, self.versions);
        state.cap = self.limits.get(&worker).map(|&limit| Capacity::new(limit));
        self.workers[slot as usize] = Some(state);
        self.slot_of.insert(worker, slot);
        self.layout = next_layout();
        slot
    }

    #[inline]
    pub(super) fn child(&self, parent: u32, local: u64) -> Option<u32> {
        let p = &self.nodes[parent as usize];
        let fc = p.first_child;
        if fc != NONE && self.nodes[fc as usize].local == local {
            return Some(fc);
        }
        if p.kids & KIDS > u32::from(fc != NONE) {
            self.branches.get(&self.nodes, parent, local)
        } else {
            None
        }
    }

    /// A new leaf under `parent`, owned by `slot` alone, and with one map entry pointing
    /// at it (`refs` 1): the caller's, which maps the block's own hash to it next.
    ///
    /// `parent_new` says that `parent` is itself a leaf the current apply call created for
    /// `slot` (owned by it alone, no children): the new node is then its first child, with
    /// the same owner set, and the link is written without reading either node back. The
    /// store loop creates most nodes so, each under the one before, and a read of a node
    /// written a moment ago waits for every store before it, the cache misses of the
    /// map inserts among them.
    pub(super) fn alloc_node(
        &mut self,
        parent: u32,
        parent_new: bool,
        local: u64,
        external: u64,
        slot: u32,
    ) -> u32 {
        let mut node = Node::new(parent, local, external);
        node.owners.insert(slot);
        node.refs = 1;
        let id = match self.free_nodes.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => self.nodes.push(node),
        };
        if parent_new {
            let p = &mut self.nodes[parent as usize];
            p.first_child = id;
            p.kids = 1 | FC_SAME;
            self.live_nodes += 1;
            return id;
        }
        let (p, c) = self.nodes.pair_mut(parent as usize, id as usize);
        p.kids += 1;
        if p.first_child == NONE {
            p.first_child = id;
            if p.owners.same(&c.owners) {
                p.kids |= FC_SAME;
            } else {
                p.kids &= KIDS;
            }
        } else {
            self.branches.insert(parent, local, id);
        }
        self.live_nodes += 1;
        id
    }

    /// Recomputes the [`FC_SAME`] bit of `node`.
    #[inline]
    fn refresh_same(&mut self, node: u32) {
        let n = &self.nodes[node as usize];
        let same =
            n.first_child != NONE && n.owners.same(&self.nodes[n.first_child as usize].owners);
        let n = &mut self.nodes[node as usize];
        n.kids = (n.kids & KIDS) | if same { FC_SAME } else { 0 };
    }

    /// Keeps the [`FC_SAME`] bits that compare `node`'s owner set exact after it changed.
    ///
    /// Every change within one apply call is the same one-slot delta (one worker's slot,
    /// added by a store, removed by a remove), and the same delta applied to two equal
    /// sets keeps them equal. So a bit cleared because one side of a pair changed is set
    /// again, without reading either set, when the other side changes next ([`Memo`]):
    /// along a chain that one worker joins or leaves, no owner set is compared (for a
    /// shared prefix, two 512-byte heap vectors per block).
    #[inline]
    pub(super) fn owners_changed(&mut self, node: u32) {
        let (own_memo, up_memo) = (self.memo.own, self.memo.up);
        let n = &mut self.nodes[node as usize];
        let fc = n.first_child;
        if n.kids & FC_SAME != 0 {
            // Equal before a one-slot change means different now: no need to read the
            // child (a cache miss in the apply loops).
            n.kids &= KIDS;
            self.memo.own = (node, fc);
        } else if fc != NONE {
            if up_memo == (node, fc) {
                n.kids |= FC_SAME;
                self.memo.up = (NONE, NONE);
            } else {
                self.refresh_same(node);
            }
        }
        let parent = self.nodes[node as usize].parent;
        if parent == NONE {
            return;
        }
        let p = &mut self.nodes[parent as usize];
        if p.first_child != node {
            return;
        }
        if p.kids & FC_SAME != 0 {
            p.kids &= KIDS;
            self.memo.up = (parent, node);
        } else if own_memo == (parent, node) {
            p.kids |= FC_SAME;
            self.memo.own = (NONE, NONE);
        } else {
            self.refresh_same(parent);
        }
    }

    /// Frees `node` and then its ancestors while they have no owners, no map references
    /// and no children.
    #[inline]
    pub(super) fn prune(&mut self, node: u32) {
        if self.prunable(node) {
            self.prune_from(node);
        }
    }

    #[inline]
    fn prunable(&self, node: u32) -> bool {
        let n = &self.nodes[node as usize];
        node != ROOT && n.parent != NONE && n.refs == 0 && n.kids & KIDS == 0 && n.owners.is_empty()
    }

    fn prune_from(&mut self, mut node: u32) {
        // A freed id may be reused by a later allocation: no memo may name it.
        self.memo = Memo::default();
        loop {
            if !self.prunable(node) {
                return;
            }
            let n = &self.nodes[node as usize];
            let (parent, local) = (n.parent, n.local);
            let p = &mut self.nodes[parent as usize];
            p.kids -= 1;
            if p.first_child == node {
                p.first_child = NONE;
                p.kids &= KIDS;
            } else {
                self.branches.remove(parent, local, node);
            }
            self.nodes[node as usize] = Node::new(NONE, 0, 0);
            self.free_nodes.push(node);
            self.live_nodes -= 1;
            node = parent;
        }
    }
}

#[cfg(test)]
mod tests {
    use kv_types::{ExternalHash, WorkerKey};

    use crate::primary::tests::{blocks, q};
    use crate::{OverlapScores, PrefixIndex, PrefixIndexStats};

    #[test]
    fn chain_joined_and_left_in_either_order_keeps_same_bits_exact() {
        let mut idx = PrefixIndex::new();
        let (a, b) = (WorkerKey::new(1, 0), WorkerKey::new(2, 0));
        let chain: Vec<(u64, u64)> = (1..=6).map(|i| (i, 10 + i)).collect();
        idx.apply_stored(a, None, &blocks(&chain));
        let root_first: Vec<ExternalHash> = (1..=6).map(|i| ExternalHash(10 + i)).collect();
        let leaf_first: Vec<ExternalHash> = root_first.iter().rev().copied().collect();
        let mut out = OverlapScores::new();
        for order in [&root_first, &leaf_first] {
            // `b` joins the whole chain, then a prefix, then leaves in `order`.
            idx.apply_stored(b, None, &blocks(&chain));
            idx.check_invariants();
            idx.apply_removed(b, &order[..2]);
            idx.check_invariants();
            idx.apply_removed(b, order);
            idx.check_invariants();
            idx.apply_stored(b, None, &blocks(&chain[..3]));
            idx.check_invariants();
            idx.find_matches(&q(&[1, 2, 3, 4, 5, 6]), &mut out);
            assert_eq!((out.score(a), out.score(b)), (6, 3));
            idx.apply_removed(b, order);
            idx.check_invariants();
        }
        assert_eq!(idx.stats().memberships, 6);
    }

    #[test]
    fn pruning_frees_and_reuses_nodes() {
        let mut idx = PrefixIndex::new();
        let w = WorkerKey::new(1, 0);
        idx.apply_stored(w, None, &blocks(&[(1, 11), (2, 12), (3, 13)]));
        assert_eq!(idx.stats().nodes, 3);
        idx.apply_removed(w, &[ExternalHash(13), ExternalHash(12)]);
        assert_eq!(idx.stats().nodes, 1);
        idx.apply_stored(w, Some(ExternalHash(11)), &blocks(&[(5, 15)]));
        assert_eq!(idx.stats().nodes, 2);
        assert_eq!(idx.nodes.len(), 4, "freed ids are reused");
        let mut out = OverlapScores::new();
        idx.find_matches(&q(&[1, 5]), &mut out);
        assert_eq!(out.score(w), 2);
        assert!(idx.remove_worker_key(w));
        assert_eq!(idx.stats(), PrefixIndexStats::default());
    }
}
