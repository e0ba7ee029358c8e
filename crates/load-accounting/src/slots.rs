//! The ledger's ranks in a dense slab with a key index.
//!
//! A selection reads every candidate rank's load; going through a hash map for each one
//! costs a hash and a probe per candidate. Ranks live at stable slots instead, and a caller
//! that keeps a rank's [`RankSlot`] (the service keeps one per roster row) reads it by
//! index. A slot is reused only after its rank is removed, and every read through a slot
//! checks the key, so a stale slot is noticed and answered through the index instead.

use kv_types::WorkerKey;
use rustc_hash::FxHashMap;

use crate::rank::RankState;

/// Where a registered rank lives in its ledger: a lookup hint, not an identity. It stays
/// valid while the rank is registered; reads through a stale slot fall back to the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankSlot(u32);

#[derive(Debug)]
struct Entry {
    key: WorkerKey,
    state: RankState,
}

#[derive(Debug, Default)]
pub(crate) struct RankTable {
    slots: Vec<Option<Entry>>,
    index: FxHashMap<WorkerKey, u32>,
    vacant: Vec<u32>,
}

impl RankTable {
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

    pub(crate) fn get_mut(&mut self, key: WorkerKey) -> Option<&mut RankState> {
        let &s = self.index.get(&key)?;
        self.slots[s as usize].as_mut().map(|e| &mut e.state)
    }

    /// The rank at `slot` if it still holds `key`, else through the index.
    #[inline]
    pub(crate) fn get_at(&self, slot: Option<RankSlot>, key: WorkerKey) -> Option<&RankState> {
        if let Some(RankSlot(s)) = slot
            && let Some(Some(e)) = self.slots.get(s as usize)
            && e.key == key
        {
            return Some(&e.state);
        }
        self.get(key)
    }

    pub(crate) fn get_or_insert(&mut self, key: WorkerKey) -> &mut RankState {
        let s = match self.index.get(&key) {
            Some(&s) => s,
            None => {
                let s = match self.vacant.pop() {
                    Some(s) => s,
                    None => {
                        self.slots.push(None);
                        (self.slots.len() - 1) as u32
                    }
                };
                self.slots[s as usize] = None;
                self.index.insert(key, s);
                s
            }
        };
        // Occupied unless just allocated above.
        let e = self.slots[s as usize].get_or_insert_with(|| Entry {
            key,
            state: RankState::default(),
        });
        &mut e.state
    }

    pub(crate) fn retain(&mut self, mut keep: impl FnMut(WorkerKey) -> bool) {
        for (s, slot) in self.slots.iter_mut().enumerate() {
            if let Some(e) = slot
                && !keep(e.key)
            {
                self.index.remove(&e.key);
                *slot = None;
                self.vacant.push(s as u32);
            }
        }
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (WorkerKey, &RankState)> + '_ {
        self.slots.iter().flatten().map(|e| (e.key, &e.state))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(t.get_at(sa, a).map(|r| r.requests), None);
        // `c` takes `a`'s old slot; reading it as `a` must not see `c`.
        t.get_or_insert(c).requests = 3;
        assert_eq!(t.slot(c), sa);
        assert!(t.get_at(sa, a).is_none());
        assert_eq!(t.get_at(sa, c).map(|r| r.requests), Some(3));
        // A wrong or missing hint still finds the rank by key.
        assert_eq!(t.get_at(sa, b).map(|r| r.requests), Some(2));
        assert_eq!(t.get_at(None, b).map(|r| r.requests), Some(2));
        assert_eq!(t.get_at(Some(RankSlot(99)), b).map(|r| r.requests), Some(2));
        let mut keys: Vec<WorkerKey> = t.iter().map(|(k, _)| k).collect();
        keys.sort();
        assert_eq!(keys, vec![b, c]);
    }
}
