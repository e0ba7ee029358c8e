//! A mirror: a copy of a trie that answers every lookup as its source does, kept equal by
//! copying what each of the source's writes touched (noted by `logged.rs`) rather than by
//! applying the write again.
//!
//! A write's cost is mostly in what only writes read: the per-worker hash maps that find a
//! block's node, the capacity bookkeeping, the walk that finds where a chain goes. A
//! mirror has none of it. It copies the nodes the write changed, replays the child-map
//! changes in order, and copies the changed worker slots' lookup state (key, counts and
//! own-hash entries). Its worker states have empty hash maps, so it answers lookups
//! (matches, depths, hint chains, `holds`, `stats`) and nothing that needs the maps
//! (dumps, byte figures, capacities): those are read from the source.

use super::node::{NONE, Node};
use super::trie::PrefixIndex;
use super::worker::WorkerState;

impl PrefixIndex {
    /// Starts noting what writes change, for [`PrefixIndex::mirror_changes`]; forgets what
    /// was noted before. Returns `false` when the previous log was never turned off (a
    /// write panicked while noting): a mirror then needs [`PrefixIndex::mirror_all`].
    pub(crate) fn log_on(&mut self) -> bool {
        let clean = !self.own_log.is_on();
        self.nodes.log_on();
        self.workers.log_on();
        self.branches.log_on();
        self.own_log.log_on();
        clean
    }

    /// Stops noting changes (what was noted stays readable). Returns whether the log was
    /// on: `false` means the index was replaced since [`PrefixIndex::log_on`].
    pub(crate) fn log_off(&mut self) -> bool {
        let was_on = self.own_log.is_on();
        self.nodes.log_off();
        self.workers.log_off();
        self.branches.log_off();
        self.own_log.log_off();
        was_on
    }

    /// Makes this mirror answer lookups as `src` does, given that it did before the changes
    /// `src` noted since its last [`PrefixIndex::log_on`].
    pub(crate) fn mirror_changes(&mut self, src: &PrefixIndex) {
        // Nodes added since the log was turned on are copied once, in order; the ones before
        // it were equal, and the log names those that changed.
        let known = src.nodes.base();
        debug_assert_eq!(
            self.nodes.len(),
            known,
            "a mirror out of step with its source"
        );
        self.nodes.resize_with(known, || Node::new(NONE, 0, 0));
        self.nodes.extend_from_slice(&src.nodes.items()[known..]);
        for &id in src.nodes.touched() {
            self.nodes[id as usize].copy_from(&src.nodes[id as usize]);
        }
        self.branches.replay(src.branches.changes());
        let known = src.workers.base();
        self.workers.resize_with(src.workers.len(), || None);
        for &slot in src.workers.touched() {
            self.mirror_slot(src, slot);
        }
        for slot in known..src.workers.len() {
            self.mirror_slot(src, slot as u32);
        }
        for &(slot, node) in src.own_log.changes() {
            let Some(theirs) = src.workers[slot as usize].as_ref() else {
                continue;
            };
            let Some(mine) = self.workers[slot as usize].as_mut() else {
                continue;
            };
            match theirs.own_at.get(&node) {
                Some(&ext) => {
                    mine.own_at.insert(node, ext);
                }
                None => {
                    mine.own_at.remove(&node);
                }
            }
        }
        self.mirror_counts(src);
    }

    /// Makes this mirror answer lookups as `src` does, whatever it held (O(`src`)).
    pub(crate) fn mirror_all(&mut self, src: &PrefixIndex) {
        self.nodes
            .resize_with(src.nodes.len(), || Node::new(NONE, 0, 0));
        for (id, node) in src.nodes.iter().enumerate() {
            self.nodes[id].copy_from(node);
        }
        self.branches.copy_all_from(&src.branches);
        self.workers.resize_with(0, || None);
        self.workers.resize_with(src.workers.len(), || None);
        self.slot_of.clear();
        for slot in 0..src.workers.len() as u32 {
            self.mirror_slot(src, slot);
        }
        self.mirror_counts(src);
    }

    /// Copies `slot`'s lookup state from `src`: its counts, or all of it when the slot now
    /// holds another state than the mirror's (made, freed or reused since).
    fn mirror_slot(&mut self, src: &PrefixIndex, slot: u32) {
        let theirs = src.workers[slot as usize].as_ref();
        if let (Some(mine), Some(theirs)) = (self.workers[slot as usize].as_mut(), theirs)
            && mine.birth == theirs.birth
        {
            mine.owned = theirs.owned;
            mine.version = theirs.version;
            return;
        }
        if let Some(old) = self.workers[slot as usize].take()
            && self.slot_of.get(&old.key) == Some(&slot)
        {
            self.slot_of.remove(&old.key);
        }
        if let Some(theirs) = theirs {
            let mut mine = WorkerState::new(theirs.key, slot, theirs.birth);
            mine.owned = theirs.owned;
            mine.version = theirs.version;
            mine.own_at.clone_from(&theirs.own_at);
            self.workers[slot as usize] = Some(mine);
            self.slot_of.insert(theirs.key, slot);
        }
    }

    fn mirror_counts(&mut self, src: &PrefixIndex) {
        self.live_nodes = src.live_nodes;
        self.memberships = src.memberships;
        self.versions = src.versions;
        self.layout = src.layout;
        self.evicted_total = src.evicted_total;
    }
}
