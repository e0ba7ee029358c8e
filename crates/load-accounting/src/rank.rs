//! Per-rank state: the prompt-prefix trie of tracking hashes and the running load totals.

use kv_types::SequenceHash;
use std::collections::hash_map::Entry;

use rustc_hash::FxHashMap;

/// Parent index of first-level nodes (the trie root is implicit).
pub(crate) const ROOT: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    parent: u32,
    hash: u64,
    /// Live bookings whose path passes through or ends at this node. A node exists iff
    /// `holders > 0`; "held only by this request" (`scheduling.md` §6.3) is `holders == 1`.
    holders: u32,
    fraction: f64,
}

/// Load of one `(worker, dp_rank)`.
///
/// Weights equal to 1.0 are counted in an integer so the common undecayed case is exact;
/// only decayed weights go through the floating-point sum, which is reset to exactly 0
/// whenever its last term leaves so rounding drift cannot outlive the decayed requests.
#[derive(Debug, Default)]
pub(crate) struct RankState {
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    /// Edge `(parent, hash) -> child`. Keying by parent keeps two different prefixes that
    /// happen to end in the same hash apart, so arbitrary peer-supplied chains are safe.
    children: FxHashMap<(u32, u64), u32>,
    full_blocks: u64,
    frac_sum: f64,
    frac_terms: u64,
    pub(crate) prefill_tokens: u64,
    pub(crate) requests: u64,
}

impl RankState {
    /// `round(prompt_weight + output_weight)`, half away from zero.
    pub(crate) fn decode_blocks(&self) -> u64 {
        // Every selection reads this once per candidate; without decayed terms the sum is
        // the exact integer and the float rounding (a libm call on baseline x86-64) is skipped.
        if self.frac_terms == 0 {
            return self.full_blocks;
        }
        let total = self.full_blocks as f64 + self.frac_sum;
        // Never negative: the fractional sum only holds values in [0, 1] times counts.
        total.round().max(0.0) as u64
    }

    pub(crate) fn add_weight(&mut self, weight: f64, count: u64) {
        if count == 0 {
            return;
        }
        if weight == 1.0 {
            self.full_blocks += count;
        } else {
            self.frac_sum += weight * count as f64;
            self.frac_terms += count;
        }
    }

    pub(crate) fn remove_weight(&mut self, weight: f64, count: u64) {
        if count == 0 {
            return;
        }
        if weight == 1.0 {
            self.full_blocks -= count;
        } else {
            self.frac_terms -= count;
            if self.frac_terms == 0 {
                self.frac_sum = 0.0;
            } else {
                self.frac_sum -= weight * count as f64;
            }
        }
    }

    /// Adds one holder along `path`, creating missing nodes; returns the last node.
    pub(crate) fn insert_path(&mut self, path: &[SequenceHash]) -> u32 {
        let mut cur = ROOT;
        for h in path {
            // One probe per block: a booking inserts its whole prompt path.
            cur = match self.children.entry((cur, h.0)) {
                Entry::Occupied(e) => {
                    let n = *e.get();
                    self.nodes[n as usize].holders += 1;
                    n
                }
                Entry::Vacant(e) => {
                    let node = Node {
                        parent: cur,
                        hash: h.0,
                        holders: 1,
                        fraction: 1.0,
                    };
                    let n = match self.free_nodes.pop() {
                        Some(n) => {
                            self.nodes[n as usize] = node;
                            n
                        }
                        None => {
                            self.nodes.push(node);
                            (self.nodes.len() - 1) as u32
                        }
                    };
                    e.insert(n);
                    self.full_blocks += 1;
                    n
                }
            };
        }
        cur
    }

    /// Removes one holder from the path ending at `last`, dropping nodes nobody holds.
    pub(crate) fn release_path(&mut self, last: u32) {
        let mut n = last;
        while n != ROOT {
            let node = &mut self.nodes[n as usize];
            node.holders -= 1;
            let Node {
                parent,
                hash,
                holders,
                fraction,
            } = *node;
            if holders == 0 {
                self.remove_weight(fraction, 1);
                self.children.remove(&(parent, hash));
                self.free_nodes.push(n);
            }
            n = parent;
        }
    }

    /// Sets the weight of the nodes only this request holds, walking up from `last`.
    pub(crate) fn decay_exclusive_suffix(&mut self, last: u32, fraction: f64) {
        let mut n = last;
        while n != ROOT {
            let node = self.nodes[n as usize];
            if node.holders != 1 {
                break;
            }
            self.remove_weight(node.fraction, 1);
            self.add_weight(fraction, 1);
            self.nodes[n as usize].fraction = fraction;
            n = node.parent;
        }
    }

    /// Length of the longest prefix of `path` that is active on this rank.
    pub(crate) fn overlap_depth(&self, path: &[SequenceHash]) -> usize {
        // Idle ranks are the common case in a large fleet; skip hashing the first edge.
        if self.children.is_empty() {
            return 0;
        }
        let mut cur = ROOT;
        for (i, h) in path.iter().enumerate() {
            match self.children.get(&(cur, h.0)) {
                Some(&n) => cur = n,
                None => return i,
            }
        }
        path.len()
    }

    /// Number of live trie nodes (for tests and invariants).
    #[cfg(test)]
    pub(crate) fn live_nodes(&self) -> usize {
        self.children.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(v: &[u64]) -> Vec<SequenceHash> {
        v.iter().copied().map(SequenceHash).collect()
    }

    #[test]
    fn shared_prefix_is_counted_once() {
        let mut r = RankState::default();
        let a = r.insert_path(&path(&[1, 2, 3]));
        let b = r.insert_path(&path(&[1, 2, 4, 5]));
        assert_eq!(r.decode_blocks(), 5);
        assert_eq!(r.overlap_depth(&path(&[1, 2, 4, 9])), 3);
        r.release_path(a);
        assert_eq!(r.decode_blocks(), 4);
        r.release_path(b);
        assert_eq!(r.decode_blocks(), 0);
        assert_eq!(r.live_nodes(), 0);
    }

    #[test]
    fn same_hash_under_different_parents_stays_distinct() {
        let mut r = RankState::default();
        r.insert_path(&path(&[1, 2]));
        r.insert_path(&path(&[2]));
        assert_eq!(r.decode_blocks(), 3);
        assert_eq!(r.overlap_depth(&path(&[2, 2])), 1);
    }

    #[test]
    fn decay_stops_at_the_first_shared_node() {
        let mut r = RankState::default();
        let a = r.insert_path(&path(&[1, 2, 3, 4]));
        r.insert_path(&path(&[1, 2, 7]));
        r.decay_exclusive_suffix(a, 0.5);
        // Nodes 3 and 4 decay to 0.5; 1 and 2 are shared: 2 + 1 + 1 (node 7) = 4.
        assert_eq!(r.decode_blocks(), 4);
        r.release_path(a);
        assert_eq!(r.decode_blocks(), 3);
        assert_eq!(r.frac_terms, 0);
        assert_eq!(r.frac_sum, 0.0);
    }
}
