//! The ledger's ranks in a dense slab with a key index, and a column of their loads.
//!
//! A selection reads every candidate rank's load; going through a hash map for each one
//! costs a hash and a probe per candidate. Ranks live at stable slots instead, and a caller
//! that keeps a rank's [`RankSlot`] (the service keeps one per roster row) reads it by
//! index. A slot is reused only after its rank is removed, and a read through a slot
//! checks the key, so a stale slot is noticed and answered through the index instead;
//! unless the caller read the slot under the current [`SlotLayout`], which changes whenever
//! a rank gains or loses a slot: then the slot cannot be stale.
//!
//! What a selection reads of a rank (its key, its three totals and whether any booking is
//! live on it) is also kept in a [`LoadRow`] column beside the slab: 40 contiguous bytes per
//! rank instead of the rank's whole state, two or three cache lines apart from the next
//! one's. Every mutable access goes through [`RankMut`], which rewrites the slot's row when
//! it is dropped, so the column cannot fall behind the state it summarizes.

use std::ops::{Deref, DerefMut};

use kv_types::{DpRank, WorkerId, WorkerKey};
use rustc_hash::FxHashMap;

use crate::RankLoad;
use crate::rank::RankState;

/// Where a registered rank lives in its ledger: a lookup hint, not an identity. It stays
/// valid while the rank is registered; reads through a stale slot fall back to the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankSlot(u32);

/// One assignment of ranks to slots in a ledger. It changes, to a value no ledger of the
/// process has had before, whenever a rank gains or loses a slot, so slots read while the
/// layout was `L` still hold the same ranks while the layout is `L`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotLayout(u64);

impl SlotLayout {
    fn next() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        SlotLayout(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

#[derive(Debug)]
struct Entry {
    key: WorkerKey,
    state: RankState,
}

/// The part of a rank's state a selection reads for every candidate. The key is split into
/// its two integers so that the flags fit in its padding (40 bytes, not 48).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LoadRow {
    worker: u64,
    rank: u32,
    /// The slot holds a rank (a vacant slot's row never matches a key).
    live: bool,
    /// Some booking is live on the rank, so a path may overlap the request's.
    pub(crate) busy: bool,
    prefill_tokens: u64,
    decode_blocks: u64,
    requests: u64,
}

impl LoadRow {
    fn of(key: WorkerKey, state: &RankState) -> Self {
        Self {
            worker: key.worker_id.0,
            rank: key.dp_rank.0,
            live: true,
            busy: state.has_paths(),
            prefill_tokens: state.prefill_tokens,
            decode_blocks: state.decode_blocks(),
            requests: state.requests,
        }
    }

    #[inline(always)]
    pub(crate) fn holds(&self, key: WorkerKey) -> bool {
        self.live && self.worker == key.worker_id.0 && self.rank == key.dp_rank.0
    }

    #[inline(always)]
    pub(crate) fn load(&self) -> RankLoad {
        RankLoad {
            active_prefill_tokens: self.prefill_tokens,
            active_decode_blocks: self.decode_blocks,
            active_requests: self.requests,
        }
    }

    fn key(&self) -> WorkerKey {
        WorkerKey {
            worker_id: WorkerId(self.worker),
            dp_rank: DpRank(self.rank),
        }
    }
}

/// Mutable access to one rank; rewrites the rank's [`LoadRow`] when dropped.
#[derive(Debug)]
pub(crate) struct RankMut<'a> {
    key: WorkerKey,
    state: &'a mut RankState,
    row: &'a mut LoadRow,
}

impl Deref for RankMut<'_> {
    type Target = RankState;

    fn deref(&self) -> &RankState {
        self.state
    }
}

impl DerefMut for RankMut<'_> {
    fn deref_mut(&mut self) -> &mut RankState {
        self.state
    }
}

impl Drop for RankMut<'_> {
    fn drop(&mut self) {
        *self.row = LoadRow::of(self.key, self.state);
    }
}

#[derive(Debug)]
pub(crate) struct RankTable {
    slots: Vec<Option<Entry>>,
    /// `loads[s]` summarizes `slots[s]`; same length.
    loads: Vec<LoadRow>,
    index: FxHashMap<WorkerKey, u32>,
    vacant: Vec<u32>,
    /// Renewed whenever `index` gains or loses a key.
    layout: SlotLayout,
}

impl Default for RankTable {
    fn default() -> Self {
        Self {
            slots: Vec::new(),
            loads: Vec::new(),
            index: FxHashMap::default(),
            vacant: Vec::new(),
            layout: SlotLayout::next(),
        }
    }
}

impl RankTable {
    pub(crate) fn layout(&self) -> SlotLayout {
        self.layout
    }

    /// The load row at a slot read while the layout was the current one, so it holds the
    /// rank it held then: no key check. `None` only for a slot outside the table.
    #[inline(always)]
    pub(crate) fn load_bound(&self, RankSlot(s): RankSlot) -> Option<(&LoadRow, u32)> {
        self.loads.get(s as usize).map(|row| (row, s))
    }

    pub(crate) fn slot(&self, key: WorkerKey) -> Option<RankSlot> {
        self.index.get(&key).map(|&s| RankSlot(s))
    }

    pub(crate) fn contains(&self, key: WorkerKey) -> bool {
        self.index.contains_key(&key)
    }

    pub(crate) fn get(&self, key: WorkerKey) -> Option<&RankState> {
        let &s = self.index.get(&key)?;
        self.slots[s as usize].as_ref().map(|e| &e.state)
    }

    pub(crate) fn get_mut(&mut self, key: WorkerKey) -> Option<RankMut<'_>> {
        let &s = self.index.get(&key)?;
        let e = self.slots.get_mut(s as usize)?.as_mut()?;
        let row = self.loads.get_mut(s as usize)?;
        Some(RankMut {
            key: e.key,
            state: &mut e.state,
            row,
        })
    }

    /// The load row of the rank at `slot` if it still holds `key`, else through the
    /// index; with the slot it was read from, for [`RankTable::state_at`].
    #[inline(always)]
    pub(crate) fn load_at(
        &self,
        slot: Option<RankSlot>,
        key: WorkerKey,
    ) -> Option<(&LoadRow, u32)> {
        if let Some(RankSlot(s)) = slot
            && let Some(row) = self.loads.get(s as usize)
            && row.holds(key)
        {
            return Some((row, s));
        }
        self.load_by_key(key)
    }

    /// Out of line: a selection's candidate loop inlines [`RankTable::load_at`], whose
    /// hint is almost always current.
    #[inline(never)]
    fn load_by_key(&self, key: WorkerKey) -> Option<(&LoadRow, u32)> {
        let &s = self.index.get(&key)?;
        self.loads.get(s as usize).map(|row| (row, s))
    }

    /// The state at a slot [`RankTable::load_at`] returned.
    pub(crate) fn state_at(&self, s: u32) -> Option<&RankState> {
        self.slots.get(s as usize)?.as_ref().map(|e| &e.state)
    }

    pub(crate) fn get_or_insert(&mut self, key: WorkerKey) -> RankMut<'_> {
        let s = match self.index.get(&key) {
            Some(&s) => s,
            None => {
                let s = match self.vacant.pop() {
                    Some(s) => s,
                    None => {
                        self.slots.push(None);
                        self.loads.push(LoadRow::default());
                        (self.slots.len() - 1) as u32
                    }
                };
                self.slots[s as usize] = None;
                self.index.insert(key, s);
                self.layout = SlotLayout::next();
                s
            }
        } as usize;
        // Occupied unless just allocated above; the guard writes the new rank's row.
        let e = self.slots[s].get_or_insert_with(|| Entry {
            key,
            state: RankState::default(),
        });
        RankMut {
            key: e.key,
            state: &mut e.state,
            row: &mut self.loads[s],
        }
    }

    pub(crate) fn retain(&mut self, mut keep: impl FnMut(WorkerKey) -> bool) {
        for (s, slot) in self.slots.iter_mut().enumerate() {
            if let Some(e) = slot
                && !keep(e.key)
            {
                self.index.remove(&e.key);
                *slot = None;
                self.loads[s] = LoadRow::default();
                self.vacant.push(s as u32);
                self.layout = SlotLayout::next();
            }
        }
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (WorkerKey, &RankState)> + '_ {
        self.slots.iter().flatten().map(|e| (e.key, &e.state))
    }

    /// Every live load row with its key (unordered).
    pub(crate) fn load_rows(&self) -> impl Iterator<Item = (WorkerKey, &LoadRow)> + '_ {
        self.loads.iter().filter(|r| r.live).map(|r| (r.key(), r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn requests_at(t: &RankTable, slot: Option<RankSlot>, key: WorkerKey) -> Option<u64> {
        t.load_at(slot, key).map(|(row, _)| row.requests)
    }

    #[test]
    fn a_load_row_is_40_bytes() {
        // The flags sit in the key's padding; the projection reads one row per candidate.
        assert_eq!(std::mem::size_of::<LoadRow>(), 40);
    }

    #[test]
    fn every_mutable_access_rewrites_the_load_row() {
        let (a, b) = (WorkerKey::new(1, 0), WorkerKey::new(1, 1));
        let mut t = RankTable::default();
        {
            let mut r = t.get_or_insert(a);
            r.requests = 2;
            r.prefill_tokens = 40;
            r.add_weight(1.0, 3);
            r.add_weight(0.5, 3);
        }
        t.get_or_insert(b);
        if let Some(mut r) = t.get_mut(b) {
            r.requests = 1;
        }
        let rows: Vec<(WorkerKey, u64, u64, u64, bool)> = {
            let mut v: Vec<_> = t
                .load_rows()
                .map(|(k, r)| {
                    let l = r.load();
                    (
                        k,
                        l.active_prefill_tokens,
                        l.active_decode_blocks,
                        l.active_requests,
                        r.busy,
                    )
                })
                .collect();
            v.sort_by_key(|x| x.0);
            v
        };
        // 3 full blocks plus 3 × 0.5 = 4.5, rounded half away from zero.
        assert_eq!(rows, vec![(a, 40, 5, 2, false), (b, 0, 0, 1, false)]);
        t.retain(|k| k != a);
        assert_eq!(t.load_rows().count(), 1);
        assert!(t.load_at(None, a).is_none());
    }

    #[test]
    fn slots_are_stable_and_reused_only_after_removal() {
        let (a, b, c) = (
            WorkerKey::new(1, 0),
            WorkerKey::new(2, 0),
            WorkerKey::new(3, 0),
        );
        let mut t = RankTable::default();
        t.get_or_insert(a).requests = 1;
        t.get_or_insert(b).requests = 2;
        let sa = t.slot(a);
        let sb = t.slot(b);
        assert_ne!(sa, sb);
        assert_eq!(t.get_or_insert(a).requests, 1);
        assert_eq!(t.slot(a), sa);

        t.retain(|k| k != a);
        assert!(!t.contains(a));
        assert_eq!(requests_at(&t, sa, a), None);
        // `c` takes `a`'s old slot; reading it as `a` must not see `c`.
        t.get_or_insert(c).requests = 3;
        assert_eq!(t.slot(c), sa);
        assert!(t.load_at(sa, a).is_none());
        assert_eq!(requests_at(&t, sa, c), Some(3));
        // A wrong or missing hint still finds the rank by key.
        assert_eq!(requests_at(&t, sa, b), Some(2));
        assert_eq!(requests_at(&t, None, b), Some(2));
        assert_eq!(requests_at(&t, Some(RankSlot(99)), b), Some(2));
        let mut keys: Vec<WorkerKey> = t.iter().map(|(k, _)| k).collect();
        keys.sort();
        assert_eq!(keys, vec![b, c]);
    }

    #[test]
    fn the_layout_changes_exactly_when_a_rank_gains_or_loses_a_slot() {
        let (a, b) = (WorkerKey::new(1, 0), WorkerKey::new(2, 0));
        let mut t = RankTable::default();
        let empty = t.layout();
        assert_ne!(
            RankTable::default().layout(),
            empty,
            "another table, another layout"
        );
        t.get_or_insert(a);
        let one = t.layout();
        assert_ne!(one, empty);
        // Changing a rank's load, or asking for a rank it has, keeps every slot in place.
        t.get_or_insert(a).requests = 4;
        t.retain(|_| true);
        assert_eq!(t.layout(), one);
        t.get_or_insert(b);
        let two = t.layout();
        assert_ne!(two, one);
        t.retain(|k| k != a);
        let removed = t.layout();
        assert_ne!(removed, two);
        // The freed slot taken by the returning rank is a new layout, never an old one.
        t.get_or_insert(a);
        assert!(![empty, one, two, removed].contains(&t.layout()));
        let (sa, sb) = (t.slot(a).map(|s| s.0), t.slot(b).map(|s| s.0));
        let bound = |k, s: Option<u32>| {
            s.and_then(|s| t.load_bound(RankSlot(s)))
                .map(|(r, _)| r.holds(k))
        };
        assert_eq!((bound(a, sa), bound(b, sb)), (Some(true), Some(true)));
        assert!(t.load_bound(RankSlot(99)).is_none());
    }
}
