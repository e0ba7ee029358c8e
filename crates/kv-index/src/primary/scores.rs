//! The caller-owned answer buffers of a prefix query: per-worker entries
//! ([`OverlapScores`]) or one depth per worker slot ([`SlotDepths`]).

use kv_types::{ExternalHash, WorkerKey};

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
///
/// [`PrefixIndex::find_matches`]: crate::PrefixIndex::find_matches
#[derive(Clone, Debug, Default)]
pub struct OverlapScores {
    pub(super) entries: Vec<OverlapEntry>,
    /// Scratch: slots still matching at the current depth.
    pub(super) active: Vec<u32>,
    /// Scratch: primary entries while the side index answers into `entries`.
    spare: Vec<OverlapEntry>,
    /// The index's worker slot of each entry, as the last `find_matches` left them (cleared
    /// by anything that merges other entries in, so never misaligned).
    pub(super) slots: Vec<u32>,
}

/// Caller-owned answer buffer of [`PrefixIndex::find_depths`]: the matched depth of every
/// worker slot of the index (0 for none), and the worker key of every slot as of the last
/// change of the index's slot layout. Reused across queries; allocation-free once grown.
///
/// A slot is a small integer the index gives a worker key while it holds any block;
/// freed slots are reused. [`SlotDepths::layout`] changes whenever a slot is given or
/// freed, so a caller that maps slots to its own rows rebuilds that map only then.
///
/// [`PrefixIndex::find_depths`]: crate::PrefixIndex::find_depths
#[derive(Clone, Debug, Default)]
pub struct SlotDepths {
    pub(super) depths: Vec<u32>,
    pub(super) keys: Vec<Option<WorkerKey>>,
    pub(super) layout: Option<u64>,
    pub(super) active: Vec<u32>,
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
