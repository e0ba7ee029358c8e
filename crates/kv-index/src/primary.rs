//! The device-tier prefix trie of one partition (`spec/indexing.md` §2).

use std::hash::BuildHasher;

use hashbrown::HashTable;
use kv_types::{BlockHash, ExternalHash, StoredBlock, WorkerId, WorkerKey};
use rustc_hash::{FxBuildHasher, FxHashMap};

use crate::capacity::Capacity;
use crate::owners::Owners;

/// Node id of the root (the empty prefix). Never pruned.
const ROOT: u32 = 0;
/// "No node" marker for `first_child` and for free slab entries' `parent`.
const NONE: u32 = u32::MAX;
/// `Node::kids` bit: the first child's owner set equals this node's.
const FC_SAME: u32 = 1 << 31;
/// `Node::kids` bits holding the child count.
const KIDS: u32 = !FC_SAME;

/// One block position of the trie: a prefix of local hashes.
///
/// 48 bytes. The first child is kept inline because most nodes of a real tree are links of
/// a chain: walking a chain then touches only the slab (nodes of one store are allocated
/// next to each other), and only real branch points pay for a hash-map probe.
#[derive(Clone, Debug)]
struct Node {
    local: u64,
    /// Set by the store that created the node (first writer wins).
    external: u64,
    parent: u32,
    first_child: u32,
    /// Child count, plus [`FC_SAME`]: set only while the first child's owner set equals
    /// this node's, so a lookup walking a chain of one owner set never reads owner sets
    /// (for a shared prefix, a 128-slot heap vector per block).
    kids: u32,
    /// Number of per-worker map entries pointing here. A node is only freed when nothing
    /// can reach it any more, so a stale map entry can never alias a reused id.
    refs: u32,
    owners: Owners,
}

impl Node {
    fn new(parent: u32, local: u64, external: u64) -> Self {
        Node {
            local,
            external,
            parent,
            first_child: NONE,
            kids: 0,
            refs: 0,
            owners: Owners::default(),
        }
    }
}

/// Bits cleared by the current apply call's one-slot owner changes, each restorable when
/// the other side of its pair gets the same change (see `PrefixIndex::owners_changed`).
/// Reset at the start of every apply call and whenever a node is freed.
#[derive(Clone, Copy, Debug)]
struct Memo {
    /// `(node, first child)`: `node` changed while equal to its first child.
    own: (u32, u32),
    /// `(parent, node)`: the first child `node` changed while equal to `parent`.
    up: (u32, u32),
}

impl Default for Memo {
    fn default() -> Self {
        Memo {
            own: (NONE, NONE),
            up: (NONE, NONE),
        }
    }
}

#[derive(Debug)]
struct WorkerState {
    key: WorkerKey,
    /// External hash → node, per the spec's per-worker block identity, for the usual case
    /// where the hash is the node's own `external`: only the 4-byte node id is stored and
    /// the key is read from the node (a node with a map entry is never freed, and its
    /// `external` never changes). A quarter of a `HashMap<u64, u32>` entry.
    blocks: HashTable<u32>,
    /// External hash → node where the hash differs from the node's `external` (another
    /// worker created the node under its own hash, or an engine reused a hash). Disjoint
    /// from `blocks`.
    foreign: FxHashMap<ExternalHash, u32>,
    /// Node → the hash this worker last stored it under, for the nodes it maps through
    /// `foreign`: engines that hash the same tokens differently (vLLM without a fixed hash
    /// seed) share nodes, and a match or a dump must name a block by its own worker's hash
    /// (lower-tier anchors, replayable parents). Every entry is also in `foreign`; empty
    /// whenever `foreign` is.
    own_at: FxHashMap<u32, ExternalHash>,
    /// Nodes whose owner set contains this slot (can exceed `blocks.len()` only when an
    /// engine reuses an external hash for a different position).
    owned: u32,
    /// Changes whenever this state gains or loses a block, and is never reused by another
    /// state of the index: an unchanged version means the worker still holds exactly what
    /// it held when the version was read.
    version: u64,
    /// Set once `foreign` may map two hashes to one node (an engine stored a block under
    /// several hashes of its own): evicting a node then scans `foreign` for all of them.
    /// Otherwise a node's only foreign hash is its `own_at` entry.
    aliased: bool,
    /// The declared capacity's bookkeeping, for a worker key that declared one.
    cap: Option<Capacity>,
}

/// A new slot-layout id, never handed out before in this process.
fn next_layout() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

#[inline]
fn ext_hash(ext: u64) -> u64 {
    FxBuildHasher.hash_one(ext)
}

impl WorkerState {
    fn new(key: WorkerKey, version: u64) -> Self {
        WorkerState {
            key,
            blocks: HashTable::new(),
            foreign: FxHashMap::default(),
            own_at: FxHashMap::default(),
            owned: 0,
            version,
            aliased: false,
            cap: None,
        }
    }

    /// The node this worker maps `ext` to.
    #[inline]
    fn get(&self, nodes: &[Node], ext: ExternalHash) -> Option<u32> {
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
    fn insert(&mut self, nodes: &[Node], ext: ExternalHash, node: u32) -> Option<u32> {
        let hash = ext_hash(ext.0);
        let eq = |&id: &u32| nodes[id as usize].external == ext.0;
        if nodes[node as usize].external == ext.0 {
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
            match self
                .blocks
                .entry(hash, eq, |&id| ext_hash(nodes[id as usize].external))
            {
                hashbrown::hash_table::Entry::Occupied(mut e) => {
                    Some(std::mem::replace(e.get_mut(), node))
                }
                hashbrown::hash_table::Entry::Vacant(e) => {
                    e.insert(node);
                    previous
                }
            }
        } else {
            let previous = match self.blocks.find_entry(hash, eq) {
                Ok(e) => Some(e.remove().0),
                Err(_) => None,
            };
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

    /// Drops `node`'s own-hash entry if it is `ext` (whose `foreign` entry just went).
    #[inline]
    fn forget_own(&mut self, node: u32, ext: ExternalHash) {
        if self.own_at.get(&node) == Some(&ext) {
            self.own_at.remove(&node);
        }
    }

    /// The hash this worker names `node` by.
    #[inline]
    fn external_of(&self, nodes: &[Node], node: u32) -> ExternalHash {
        if !self.own_at.is_empty()
            && let Some(&ext) = self.own_at.get(&node)
        {
            return ext;
        }
        ExternalHash(nodes[node as usize].external)
    }

    /// Forgets `ext`; returns the node it mapped to.
    #[inline]
    fn remove(&mut self, nodes: &[Node], ext: ExternalHash) -> Option<u32> {
        if !self.foreign.is_empty()
            && let Some(node) = self.foreign.remove(&ext)
        {
            self.forget_own(node, ext);
            return Some(node);
        }
        match self
            .blocks
            .find_entry(ext_hash(ext.0), |&id| nodes[id as usize].external == ext.0)
        {
            Ok(e) => Some(e.remove().0),
            Err(_) => None,
        }
    }

    /// Forgets every hash this worker maps to `node`; returns how many there were.
    fn unmap(&mut self, nodes: &[Node], node: u32) -> u32 {
        let mut unmapped = 0;
        if let Ok(e) = self
            .blocks
            .find_entry(ext_hash(nodes[node as usize].external), |&id| id == node)
        {
            e.remove();
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
    fn allocated_bytes(&self) -> usize {
        self.cap.as_ref().map_or(0, Capacity::allocated_bytes)
            + self.blocks.allocation_size()
            + self.foreign.capacity() * (std::mem::size_of::<(ExternalHash, u32)>() + 1)
            + self.own_at.capacity() * (std::mem::size_of::<(u32, ExternalHash)>() + 1)
    }
}

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

/// One worker key's prefix match.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct OverlapEntry {
    pub worker: WorkerKey,
    /// Length of the longest query prefix the worker holds contiguously from the root (≥ 1).
    pub matched_blocks: u32,
    /// External hash of the worker's last matched block.
    pub last_external: ExternalHash,
}

/// Caller-owned answer buffer of [`PrefixIndex::find_matches`]: cleared and refilled by
/// every query, so steady-state queries allocate nothing. Workers with no match are absent.
/// Entries are in no particular order.
#[derive(Clone, Debug, Default)]
pub struct OverlapScores {
    entries: Vec<OverlapEntry>,
    /// Scratch: slots still matching at the current depth.
    active: Vec<u32>,
    /// Scratch: primary entries while the side index answers into `entries`.
    spare: Vec<OverlapEntry>,
    /// The index's worker slot of each entry, as the last `find_matches` left them (cleared
    /// by anything that merges other entries in, so never misaligned).
    slots: Vec<u32>,
}

/// Caller-owned answer buffer of [`PrefixIndex::find_depths`]: the matched depth of every
/// worker slot of the index (0 for none), and the worker key of every slot as of the last
/// change of the index's slot layout. Reused across queries; allocation-free once grown.
///
/// A slot is a small integer the index gives a worker key while it holds any block;
/// freed slots are reused. [`SlotDepths::layout`] changes whenever a slot is given or
/// freed, so a caller that maps slots to its own rows rebuilds that map only then.
#[derive(Clone, Debug, Default)]
pub struct SlotDepths {
    depths: Vec<u32>,
    keys: Vec<Option<WorkerKey>>,
    layout: Option<u64>,
    active: Vec<u32>,
}

impl SlotDepths {
    pub fn new() -> Self {
        Self::default()
    }

    /// Matched blocks of the worker in `slot` (0 for an unknown slot).
    #[inline]
    pub fn depth(&self, slot: u32) -> u32 {
        self.depths.get(slot as usize).copied().unwrap_or(0)
    }

    /// The worker key of each slot (`None` for a free one), as of [`SlotDepths::layout`].
    pub fn keys(&self) -> &[Option<WorkerKey>] {
        &self.keys
    }

    /// The index's slot layout these keys describe (`None` before the first query).
    pub fn layout(&self) -> Option<u64> {
        self.layout
    }
}

impl OverlapScores {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn entries(&self) -> &[OverlapEntry] {
        &self.entries
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Matched blocks of `worker` (0 when absent). Linear: meant for tests and small sets.
    pub fn score(&self, worker: WorkerKey) -> u32 {
        self.entry(worker).map_or(0, |e| e.matched_blocks)
    }

    pub fn entry(&self, worker: WorkerKey) -> Option<&OverlapEntry> {
        self.entries.iter().find(|e| e.worker == worker)
    }

    pub fn clear(&mut self) {
        self.entries.clear();
        self.slots.clear();
    }

    /// Worker slots aligned with [`Self::entries`] when they came straight from one
    /// lookup; empty after a merge.
    pub(crate) fn slots(&self) -> &[u32] {
        &self.slots
    }

    /// Merges another score set by per-worker max (the side index of §6). Workers only in
    /// `other` are added.
    pub fn merge_max(&mut self, other: &OverlapScores) {
        self.slots.clear();
        for o in &other.entries {
            match self.entries.iter_mut().find(|e| e.worker == o.worker) {
                Some(e) if e.matched_blocks < o.matched_blocks => *e = *o,
                Some(_) => {}
                None => self.entries.push(*o),
            }
        }
    }

    /// Moves the current entries aside (into the spare buffer) before a second query.
    pub(crate) fn stash(&mut self) {
        self.slots.clear();
        self.spare.clear();
        std::mem::swap(&mut self.entries, &mut self.spare);
    }

    /// Merges the stashed entries back by per-worker max; stashed entries win ties.
    pub(crate) fn merge_stash(&mut self) {
        self.slots.clear();
        for p in self.spare.drain(..) {
            match self.entries.iter_mut().find(|e| e.worker == p.worker) {
                Some(e) if e.matched_blocks <= p.matched_blocks => *e = p,
                Some(_) => {}
                None => self.entries.push(p),
            }
        }
    }

    /// Sorts entries by worker key (deterministic output for tests and responses).
    pub fn sort_by_worker(&mut self) {
        self.entries.sort_unstable_by_key(|e| e.worker);
    }
}

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
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    /// Children other than a node's inline first child, keyed by (parent, local hash).
    branches: FxHashMap<(u32, u64), u32>,
    workers: Vec<Option<WorkerState>>,
    slot_of: FxHashMap<WorkerKey, u32>,
    free_slots: Vec<u32>,
    live_nodes: usize,
    memberships: usize,
    /// Reused buffer of `apply_removed`.
    scratch: Vec<u32>,
    memo: Memo,
    /// The last worker-state version handed out.
    versions: u64,
    /// Changes whenever a slot is given to a worker key or freed (see [`SlotDepths`]);
    /// unique across all indexes of the process, so a buffer used with another index never
    /// mistakes its keys for this one's.
    layout: u64,
    /// Declared capacities (`total_kv_blocks`) per worker key, kept while the key has no
    /// state (before its first store, after a `Cleared`).
    limits: FxHashMap<WorkerKey, u32>,
    /// Blocks evicted because a worker key exceeded its capacity, per key with a capacity.
    evictions: FxHashMap<WorkerKey, u64>,
    /// All capacity evictions of this index, monotonic.
    evicted_total: u64,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl PrefixIndex {
    pub fn new() -> Self {
        PrefixIndex {
            nodes: vec![Node::new(NONE, 0, 0)],
            free_nodes: Vec::new(),
            branches: FxHashMap::default(),
            workers: Vec::new(),
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
        let workers: usize = self
            .workers
            .iter()
            .flatten()
            .map(WorkerState::allocated_bytes)
            .sum();
        self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.free_nodes.capacity() * std::mem::size_of::<u32>()
            + self.branches.capacity() * (std::mem::size_of::<((u32, u64), u32)>() + 1)
            + self.workers.capacity() * std::mem::size_of::<Option<WorkerState>>()
            + self.slot_of.capacity() * (std::mem::size_of::<(WorkerKey, u32)>() + 1)
            + self.free_slots.capacity() * std::mem::size_of::<u32>()
            + heap_owners
            + workers
    }

    /// [`PrefixIndex::allocated_bytes`] in O(worker keys), for scrape-time gauges: the
    /// slab, the child and slot maps and every worker key's maps by capacity, and the heap
    /// owner lists estimated as one `u32` per membership beyond three per node (a bound
    /// that counts only shared nodes; most nodes keep their owners inline).
    pub fn estimated_bytes(&self) -> usize {
        let workers: usize = self
            .workers
            .iter()
            .flatten()
            .map(WorkerState::allocated_bytes)
            .sum();
        let heap_owners =
            self.memberships.saturating_sub(3 * self.live_nodes) * std::mem::size_of::<u32>();
        self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.free_nodes.capacity() * std::mem::size_of::<u32>()
            + self.branches.capacity() * (std::mem::size_of::<((u32, u64), u32)>() + 1)
            + self.workers.capacity() * std::mem::size_of::<Option<WorkerState>>()
            + self.slot_of.capacity() * (std::mem::size_of::<(WorkerKey, u32)>() + 1)
            + self.free_slots.capacity() * std::mem::size_of::<u32>()
            + heap_owners
            + workers
    }

    /// Worker keys that currently have state, in no particular order.
    pub fn worker_keys(&self) -> impl Iterator<Item = WorkerKey> + '_ {
        self.slot_of.keys().copied()
    }

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
        let slot = self.slot_for(worker);
        let mut changed = false;
        let mut gained = 0u32;
        let mut cur = start;
        for block in blocks {
            let (child, gain) = match self.child(cur, block.tokens_hash.0) {
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
                    let c = self.alloc_node(cur, block.tokens_hash.0, block.block_hash.0, slot);
                    (c, true)
                }
            };
            let nodes = &self.nodes;
            let previous = self.workers[slot as usize].as_mut().and_then(|state| {
                if gain && let Some(cap) = &mut state.cap {
                    cap.gained(child, cur);
                }
                state.insert(nodes, block.block_hash, child)
            });
            if previous != Some(child) {
                changed = true;
                self.nodes[child as usize].refs += 1;
                if let Some(old) = previous {
                    self.nodes[old as usize].refs -= 1;
                    self.prune(old);
                }
            }
            cur = child;
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
            match state.remove(&self.nodes, hash) {
                Some(node) => found.push(node),
                None => out.not_found += 1,
            }
        }
        if state.blocks.is_empty() {
            // Resets the tombstones the removes left, which would otherwise cost an
            // in-place rehash (reading every entry's node) on the next fill. Not `clear`:
            // hashbrown's `clear` returns early on an empty table, tombstones and all; a
            // dropped `drain` always resets the control bytes.
            drop(state.blocks.drain());
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
                        cap.lost(parent);
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
        for node in state.blocks.into_iter().chain(state.foreign.into_values()) {
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
                let mut held: Vec<u32> = state.blocks.iter().copied().collect();
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
                    cap.gained(n, nodes[n as usize].parent);
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

    /// The device blocks `worker` holds here (memberships, reachable from the root or not).
    pub fn worker_blocks(&self, worker: WorkerKey) -> u32 {
        self.slot_of
            .get(&worker)
            .and_then(|&s| self.workers[s as usize].as_ref())
            .map_or(0, |s| s.owned)
    }

    /// Whether `worker` holds the block at the end of `path` (the local hashes from the
    /// root), whatever it holds above it.
    pub fn holds(&self, worker: WorkerKey, path: &[BlockHash]) -> bool {
        let Some(&slot) = self.slot_of.get(&worker) else {
            return false;
        };
        let mut node = ROOT;
        for h in path {
            match self.child(node, h.0) {
                Some(c) => node = c,
                None => return false,
            }
        }
        node != ROOT && self.nodes[node as usize].owners.contains(slot)
    }

    /// Evicts `slot`'s blocks while it holds more than its capacity; returns how many.
    /// Also compacts its gain order (the only place it grows is a store, which ends here).
    fn enforce_capacity(&mut self, slot: u32) -> u32 {
        let nodes = &self.nodes;
        let holds = |n: u32| {
            nodes
                .get(n as usize)
                .is_some_and(|x| x.parent != NONE && x.owners.contains(slot))
        };
        let Some(state) = self.workers[slot as usize].as_mut() else {
            return 0;
        };
        let Some(cap) = &mut state.cap else {
            return 0;
        };
        cap.maybe_compact(state.owned, holds);
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
            let holds = |n: u32| {
                nodes
                    .get(n as usize)
                    .is_some_and(|x| x.parent != NONE && x.owners.contains(slot))
            };
            let Some(victim) = cap.victim(holds, |n| nodes[n as usize].parent) else {
                break;
            };
            let parent = nodes[victim as usize].parent;
            cap.lost(parent);
            let unmapped = state.unmap(nodes, victim);
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

    /// The engine hashes along the query's path from the root, as far as the tree has it
    /// (at most `max_len`): the root-aligned chain a KV-transfer hint names. A block is
    /// named by `holder`'s hash where it stored the block under its own, otherwise by the
    /// hash of the store that created the node.
    pub fn root_chain(
        &self,
        query: &[BlockHash],
        max_len: usize,
        holder: Option<WorkerKey>,
        out: &mut Vec<ExternalHash>,
    ) {
        out.clear();
        let state = holder
            .and_then(|k| self.slot_of.get(&k))
            .and_then(|&slot| self.workers[slot as usize].as_ref());
        let mut parent = ROOT;
        for q in query.iter().take(max_len) {
            let Some(node) = self.child(parent, q.0) else {
                break;
            };
            out.push(match state {
                Some(state) => state.external_of(&self.nodes, node),
                None => ExternalHash(self.nodes[node as usize].external),
            });
            parent = node;
        }
    }

    /// Prefix-overlap scores of `query` per worker key (§2.4), written into `out`.
    ///
    /// One walk down the trie; the set of still-matching workers is narrowed at every depth
    /// and the walk stops as soon as it is empty.
    pub fn find_matches(&self, query: &[BlockHash], out: &mut OverlapScores) {
        out.entries.clear();
        out.slots.clear();
        let (entries, slots) = (&mut out.entries, &mut out.slots);
        let (workers, nodes) = (&self.workers, self.nodes.as_slice());
        self.walk(query, &mut out.active, |slot, depth, last| {
            if let Some(state) = workers[slot as usize].as_ref() {
                entries.push(OverlapEntry {
                    worker: state.key,
                    matched_blocks: depth,
                    last_external: state.external_of(nodes, last),
                });
                slots.push(slot);
            }
        });
    }

    /// [`PrefixIndex::find_matches`] as one depth per worker slot: what a caller that reads
    /// every worker's overlap needs, without an entry per worker to build and look up.
    pub fn find_depths(&self, query: &[BlockHash], out: &mut SlotDepths) {
        out.depths.clear();
        out.depths.resize(self.workers.len(), 0);
        if out.layout != Some(self.layout) {
            out.keys.clear();
            out.keys
                .extend(self.workers.iter().map(|w| w.as_ref().map(|s| s.key)));
            out.layout = Some(self.layout);
        }
        let depths = &mut out.depths;
        self.walk(query, &mut out.active, |slot, depth, _| {
            if let Some(d) = depths.get_mut(slot as usize) {
                *d = depth;
            }
        });
    }

    /// The walk of [`PrefixIndex::find_matches`]: calls `matched(slot, depth, last matched
    /// node)` once per worker slot that holds a prefix of `query`, with its longest one.
    /// `active` is scratch.
    #[inline(always)]
    fn walk(
        &self,
        query: &[BlockHash],
        active: &mut Vec<u32>,
        mut matched: impl FnMut(u32, u32, u32),
    ) {
        active.clear();
        let Some(first) = query.first() else {
            return;
        };
        let Some(mut node) = self.child(ROOT, first.0) else {
            return;
        };
        let nodes = self.nodes.as_slice();
        active.extend_from_slice(nodes[node as usize].owners.as_slice());
        if active.is_empty() {
            return;
        }
        let mut depth: u32 = 1;
        // Invariant: `active` is non-empty and a subset of `node`'s owner set.
        let mut i = 1;
        while i < query.len() {
            // A chain stored by one event sits at consecutive ids. Reading the guessed
            // successor by its id (not through `first_child`) gives the CPU an address
            // that does not wait for this node's load, so the walk streams through the
            // slab instead of paying one memory latency per block. Along such a run with
            // one owner set, `active` is unchanged; iterators keep the run free of bounds
            // checks.
            let run = &nodes[node as usize..];
            let mut steps = 0u32;
            for ((n, g), h) in run.iter().zip(&run[1..]).zip(&query[i..]) {
                if n.first_child != node.wrapping_add(steps + 1)
                    || n.kids & FC_SAME == 0
                    || g.local != h.0
                {
                    break;
                }
                steps += 1;
            }
            node += steps;
            depth += steps;
            i += steps as usize;
            let Some(h) = query.get(i) else {
                break;
            };
            i += 1;
            let n = &nodes[node as usize];
            let fc = n.first_child;
            let next = if fc != NONE && nodes[fc as usize].local == h.0 {
                if n.kids & FC_SAME != 0 {
                    // Same owner set as `node`, so `active` is unchanged.
                    node = fc;
                    depth += 1;
                    continue;
                }
                fc
            } else if n.kids & KIDS > u32::from(fc != NONE) {
                match self.branches.get(&(node, h.0)) {
                    Some(&c) => c,
                    None => break,
                }
            } else {
                break;
            };
            let owners = nodes[next as usize].owners.as_slice();
            if owners != active.as_slice() {
                let last = node;
                retain_intersection(active, owners, |slot| matched(slot, depth, last));
                if active.is_empty() {
                    return;
                }
            }
            node = next;
            depth += 1;
        }
        for &slot in active.iter() {
            matched(slot, depth, node);
        }
        active.clear();
    }

    /// Visits the tree as dump runs (§9.1): breadth-first, chains of nodes with identical
    /// owner sets merged into one run, one call per worker covering the run, parents first.
    /// Memberships a worker cannot reach from the root (after a mid-chain removal) are
    /// skipped: they never contribute to a match and would be rejected on replay anyway.
    /// Each worker's blocks and parent carry the hashes it stored them under, so a replay
    /// gives every worker back its own map.
    pub(crate) fn for_each_run(
        &self,
        mut emit: impl FnMut(WorkerKey, Option<ExternalHash>, &[StoredBlock]),
    ) {
        let n = self.nodes.len();
        // Children lists in CSR form, ordered by local hash for a deterministic dump.
        let mut pairs: Vec<(u32, u64, u32)> = Vec::with_capacity(self.live_nodes);
        for (id, node) in self.nodes.iter().enumerate().skip(1) {
            if node.parent != NONE {
                pairs.push((node.parent, node.local, id as u32));
            }
        }
        pairs.sort_unstable();
        let mut offsets = vec![0u32; n + 1];
        for &(p, _, _) in &pairs {
            offsets[p as usize + 1] += 1;
        }
        for i in 0..n {
            offsets[i + 1] += offsets[i];
        }
        let children = |id: u32| {
            let (a, b) = (offsets[id as usize], offsets[id as usize + 1]);
            pairs[a as usize..b as usize].iter().map(|&(_, _, c)| c)
        };

        // (run head, last node of the parent run, slots that reach the parent run).
        let mut queue: std::collections::VecDeque<(u32, Option<u32>, Vec<u32>)> =
            children(ROOT).map(|c| (c, None, Vec::new())).collect();
        let mut blocks: Vec<StoredBlock> = Vec::new();
        let mut run: Vec<u32> = Vec::new();
        let mut own: Vec<StoredBlock> = Vec::new();
        let mut keys: Vec<(WorkerKey, u32)> = Vec::new();
        let nodes = self.nodes.as_slice();
        while let Some((head, parent, parent_reach)) = queue.pop_front() {
            let owners = self.nodes[head as usize].owners.as_slice();
            let reach: Vec<u32> = if parent.is_none() {
                owners.to_vec()
            } else {
                owners
                    .iter()
                    .copied()
                    .filter(|s| parent_reach.binary_search(s).is_ok())
                    .collect()
            };
            blocks.clear();
            run.clear();
            let mut cur = head;
            loop {
                let node = &self.nodes[cur as usize];
                run.push(cur);
                blocks.push(StoredBlock::new(
                    ExternalHash(node.external),
                    BlockHash(node.local),
                ));
                let mut kids = children(cur);
                match (kids.next(), kids.next()) {
                    (Some(only), None) if self.nodes[only as usize].owners.as_slice() == owners => {
                        cur = only;
                    }
                    _ => break,
                }
            }
            keys.clear();
            keys.extend(
                reach
                    .iter()
                    .filter_map(|&s| self.workers[s as usize].as_ref().map(|st| (st.key, s))),
            );
            keys.sort_unstable();
            for &(key, slot) in &keys {
                let Some(state) = self.workers[slot as usize].as_ref() else {
                    continue;
                };
                let parent_ext = parent.map(|p| state.external_of(nodes, p));
                if state.own_at.is_empty() {
                    emit(key, parent_ext, &blocks);
                } else {
                    own.clear();
                    own.extend(run.iter().zip(&blocks).map(|(&id, b)| {
                        StoredBlock::new(state.external_of(nodes, id), b.tokens_hash)
                    }));
                    emit(key, parent_ext, &own);
                }
            }
            if !reach.is_empty() {
                for c in children(cur) {
                    queue.push_back((c, Some(cur), reach.clone()));
                }
            }
        }
    }

    /// The version of `worker`'s state (`None` without one): equal to a version read
    /// earlier exactly when nothing was stored for or removed from `worker` in between.
    pub fn worker_version(&self, worker: WorkerKey) -> Option<u64> {
        let &slot = self.slot_of.get(&worker)?;
        self.workers[slot as usize].as_ref().map(|s| s.version)
    }

    fn slot_for(&mut self, worker: WorkerKey) -> u32 {
        if let Some(&slot) = self.slot_of.get(&worker) {
            return slot;
        }
        self.versions += 1;
        let mut state = WorkerState::new(worker, self.versions);
        state.cap = self.limits.get(&worker).map(|&limit| Capacity::new(limit));
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.workers[slot as usize] = Some(state);
                slot
            }
            None => {
                self.workers.push(Some(state));
                // More than 4 billion worker keys in one partition is not a real case.
                (self.workers.len() - 1) as u32
            }
        };
        self.slot_of.insert(worker, slot);
        self.layout = next_layout();
        slot
    }

    #[inline]
    fn child(&self, parent: u32, local: u64) -> Option<u32> {
        let p = &self.nodes[parent as usize];
        let fc = p.first_child;
        if fc != NONE && self.nodes[fc as usize].local == local {
            return Some(fc);
        }
        if p.kids & KIDS > u32::from(fc != NONE) {
            self.branches.get(&(parent, local)).copied()
        } else {
            None
        }
    }

    /// A new leaf under `parent`, owned by `slot` alone.
    fn alloc_node(&mut self, parent: u32, local: u64, external: u64, slot: u32) -> u32 {
        let mut node = Node::new(parent, local, external);
        node.owners.insert(slot);
        let id = match self.free_nodes.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                // 4 billion nodes would be ~200 GB: not reachable in practice.
                (self.nodes.len() - 1) as u32
            }
        };
        let (p, c) = if (parent as usize) < (id as usize) {
            let (a, b) = self.nodes.split_at_mut(id as usize);
            (&mut a[parent as usize], &b[0])
        } else {
            let (a, b) = self.nodes.split_at_mut(parent as usize);
            (&mut b[0], &a[id as usize])
        };
        p.kids += 1;
        if p.first_child == NONE {
            p.first_child = id;
            if p.owners.same(&c.owners) {
                p.kids |= FC_SAME;
            } else {
                p.kids &= KIDS;
            }
        } else {
            self.branches.insert((parent, local), id);
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
    fn owners_changed(&mut self, node: u32) {
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
    fn prune(&mut self, node: u32) {
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
                self.branches.remove(&(parent, local));
            }
            self.nodes[node as usize] = Node::new(NONE, 0, 0);
            self.free_nodes.push(node);
            self.live_nodes -= 1;
            node = parent;
        }
    }
}

/// Keeps in `active` (sorted) only the slots also in `owners` (sorted), calling `dropped`
/// for every removed slot.
#[inline]
fn retain_intersection(active: &mut Vec<u32>, owners: &[u32], mut dropped: impl FnMut(u32)) {
    // Probing a large owner set (a shared system prompt) per active slot is cheaper than
    // merging through all of it.
    let probe = owners.len() > active.len() * 8;
    let mut keep = 0;
    let mut j = 0;
    for i in 0..active.len() {
        let s = active[i];
        let present = if probe {
            owners.binary_search(&s).is_ok()
        } else {
            while j < owners.len() && owners[j] < s {
                j += 1;
            }
            j < owners.len() && owners[j] == s
        };
        if present {
            active[keep] = s;
            keep += 1;
        } else {
            dropped(s);
        }
    }
    active.truncate(keep);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(pairs: &[(u64, u64)]) -> Vec<StoredBlock> {
        pairs
            .iter()
            .map(|&(l, e)| StoredBlock::new(ExternalHash(e), BlockHash(l)))
            .collect()
    }

    fn q(locals: &[u64]) -> Vec<BlockHash> {
        locals.iter().map(|&l| BlockHash(l)).collect()
    }

    impl PrefixIndex {
        /// Checks the derived state the fast paths rely on.
        fn check_invariants(&self) {
            for (id, n) in self.nodes.iter().enumerate() {
                if n.kids & FC_SAME != 0 {
                    assert_ne!(n.first_child, NONE, "node {id}");
                    let fc = &self.nodes[n.first_child as usize];
                    assert_eq!(n.owners.as_slice(), fc.owners.as_slice(), "node {id}");
                }
            }
            for state in self.workers.iter().flatten() {
                for &id in &state.blocks {
                    let ext = ExternalHash(self.nodes[id as usize].external);
                    assert!(!state.foreign.contains_key(&ext));
                    assert_eq!(state.get(&self.nodes, ext), Some(id));
                }
                for (&ext, &id) in &state.foreign {
                    assert_ne!(self.nodes[id as usize].external, ext.0);
                    assert_eq!(state.get(&self.nodes, ext), Some(id));
                }
                for (&id, &ext) in &state.own_at {
                    assert_eq!(state.foreign.get(&ext), Some(&id));
                }
                let slot = self.slot_of[&state.key];
                if let Some(kids) = state.cap.as_ref().and_then(Capacity::child_counts) {
                    let mut actual: FxHashMap<u32, u32> = FxHashMap::default();
                    for n in self.nodes.iter().skip(1) {
                        if n.parent != NONE && n.owners.contains(slot) {
                            *actual.entry(n.parent).or_insert(0) += 1;
                        }
                    }
                    assert_eq!(kids, &actual, "child counts of {:?}", state.key);
                }
            }
        }
    }

    #[test]
    fn fast_path_state_stays_exact_under_random_ops() {
        // Few locals and externals so that chains share nodes, externals are reused at
        // other positions (the `foreign` map) and removals hit the middle of chains.
        let mut idx = PrefixIndex::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let mut out = OverlapScores::new();
        // Two of the five workers are bounded, so evictions run between the other changes
        // (their owner-set changes must keep the first-child bits exact too).
        idx.set_capacity(WorkerKey::new(0, 0), Some(3));
        idx.set_capacity(WorkerKey::new(1, 0), Some(7));
        for step in 0..3000 {
            let w = WorkerKey::new(next(5), 0);
            match next(10) {
                0..=5 => {
                    let len = 1 + next(6) as usize;
                    let pairs: Vec<(u64, u64)> =
                        (0..len).map(|_| (next(3), 100 + next(12))).collect();
                    let parent = (next(3) == 0).then(|| ExternalHash(100 + next(12)));
                    idx.apply_stored(w, parent, &blocks(&pairs));
                }
                6..=8 => {
                    let hashes: Vec<ExternalHash> = (0..1 + next(4))
                        .map(|_| ExternalHash(100 + next(12)))
                        .collect();
                    idx.apply_removed(w, &hashes);
                }
                _ => {
                    idx.remove_worker_key(w);
                }
            }
            idx.check_invariants();
            assert!(idx.worker_blocks(WorkerKey::new(0, 0)) <= 3, "{step}");
            assert!(idx.worker_blocks(WorkerKey::new(1, 0)) <= 7, "{step}");
            let query: Vec<u64> = (0..1 + next(6)).map(|_| next(3)).collect();
            idx.find_matches(&q(&query), &mut out);
            assert!(
                out.entries().iter().all(|e| e.matched_blocks >= 1),
                "{step}"
            );
        }
        assert!(idx.allocated_bytes() > 0);
        assert!(idx.capacity_evicted_total() > 0);
    }

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

    #[test]
    fn node_is_48_bytes() {
        assert_eq!(std::mem::size_of::<Node>(), 48);
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

    #[test]
    fn branch_children_are_found_after_first_child_is_pruned() {
        let mut idx = PrefixIndex::new();
        let (a, b) = (WorkerKey::new(1, 0), WorkerKey::new(2, 0));
        idx.apply_stored(a, None, &blocks(&[(1, 11), (2, 12)]));
        idx.apply_stored(b, None, &blocks(&[(1, 11), (3, 13)]));
        idx.apply_stored(b, Some(ExternalHash(11)), &blocks(&[(4, 14)]));
        idx.apply_removed(a, &[ExternalHash(12)]);
        let mut out = OverlapScores::new();
        for (query, expect) in [(vec![1, 3], 2), (vec![1, 4], 2), (vec![1, 2], 1)] {
            idx.find_matches(&q(&query), &mut out);
            assert_eq!(out.score(b), expect, "{query:?}");
        }
        idx.apply_stored(a, Some(ExternalHash(11)), &blocks(&[(7, 17)]));
        idx.find_matches(&q(&[1, 7]), &mut out);
        assert_eq!(out.score(a), 2);
        assert_eq!(out.score(b), 1);
    }
}
