//! The read queries of the trie: prefix matches per worker key or per slot (§2.4), the
//! root-aligned hash chain of a KV-transfer hint, and whether a worker holds a block.

use kv_types::{BlockHash, ExternalHash, WorkerKey};

use super::node::{FC_SAME, KIDS, NONE, ROOT};
use super::scores::{OverlapEntry, OverlapScores, SlotDepths};
use super::trie::PrefixIndex;

impl PrefixIndex {
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
        let (workers, nodes) = (&self.workers, self.nodes.items());
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
        let nodes = self.nodes.items();
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
                match self.branches.get(nodes, node, h.0) {
                    Some(c) => c,
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
    use kv_types::{ExternalHash, WorkerKey};

    use crate::primary::tests::{blocks, q};
    use crate::{OverlapScores, PrefixIndex};

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
