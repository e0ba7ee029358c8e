//! Per-rank state: the prompt-prefix trie of tracking hashes and the running load totals.
//!
//! The trie is path-compressed: a segment holds a run of hashes that every booking holding
//! its first block holds entirely (no booking ends and no path branches inside a segment),
//! so one holder count and one weight fraction per segment describe each of its blocks.
//! Booking a 256-block prompt is then one copy of the run and one edge probe per segment
//! boundary instead of one hash-map probe per block.

use std::collections::hash_map::Entry;

use kv_types::SequenceHash;
use rustc_hash::FxHashMap;

/// Largest run buffer (in hashes, 32 KiB) a rank keeps as its spare.
const SPARE_RUN_CAPACITY: usize = 4096;

/// Parent of first-level segments (the trie root is implicit); also the handle of an empty
/// path.
pub(crate) const ROOT: u32 = u32::MAX;

#[derive(Debug, Clone, Default)]
struct Segment {
    /// The run, never empty while live; emptied (buffer freed) when the slot is free.
    hashes: Vec<SequenceHash>,
    parent: u32,
    /// Live bookings whose path passes through or ends in this segment: the holders of each
    /// of its blocks. A segment is live iff `holders > 0`; "held only by this request"
    /// (`scheduling.md` §6.3) is `holders == 1`.
    holders: u32,
    /// Live bookings whose path ends exactly at the end of this segment.
    ends: u32,
    /// Number of live child segments and the XOR of their ids: with one child, `child_xor`
    /// is that child, which is all merging needs (no child list to maintain).
    children: u32,
    child_xor: u32,
    fraction: f64,
}

/// Load of one `(worker, dp_rank)`.
///
/// Weights equal to 1.0 are counted in an integer so the common undecayed case is exact;
/// only decayed weights go through the floating-point sum, which is reset to exactly 0
/// whenever its last term leaves so rounding drift cannot outlive the decayed requests.
///
/// A booking's handle is the id of the segment its path ends in. Ids are stable while the
/// booking lives: a split keeps the id on the tail (where paths ending in the segment end),
/// and a merge only removes a segment no booking ends in.
#[derive(Debug, Default)]
pub(crate) struct RankState {
    segments: Vec<Segment>,
    free_segments: Vec<u32>,
    /// The run buffer of the last freed segment, kept for the next new leaf: a rank that
    /// books and frees prompts in turn reuses one buffer instead of allocating and freeing
    /// a run per booking. At most one per rank, of at most [`SPARE_RUN_CAPACITY`] hashes.
    spare_run: Vec<SequenceHash>,
    /// Edge `(parent, first hash of the child) -> child`. Keying by parent keeps two
    /// different prefixes that happen to end in the same hash apart, so arbitrary
    /// peer-supplied chains are safe. One entry per live segment.
    children: FxHashMap<(u32, u64), u32>,
    full_blocks: u64,
    frac_sum: f64,
    frac_terms: u64,
    pub(crate) prefill_tokens: u64,
    pub(crate) requests: u64,
}

/// A free slot id (reused or appended); its content is overwritten by the caller.
fn take_slot(segments: &mut Vec<Segment>, free: &mut Vec<u32>) -> u32 {
    free.pop().unwrap_or_else(|| {
        segments.push(Segment::default());
        (segments.len() - 1) as u32
    })
}

/// Length of the common prefix of `a` and `b`.
fn common_prefix(a: &[SequenceHash], b: &[SequenceHash]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    // Branch once per 8 blocks on an OR of XORs (vectorizes); the usual outcome on a
    // long shared run is "all equal".
    const CHUNK: usize = 8;
    let mut i = 0;
    for (ca, cb) in a.chunks_exact(CHUNK).zip(b.chunks_exact(CHUNK)) {
        let diff = ca
            .iter()
            .zip(cb)
            .fold(0u64, |acc, (x, y)| acc | (x.0 ^ y.0));
        if diff != 0 {
            break;
        }
        i += CHUNK;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
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

    fn seg(&self, id: u32) -> &Segment {
        &self.segments[id as usize]
    }

    fn seg_mut(&mut self, id: u32) -> &mut Segment {
        &mut self.segments[id as usize]
    }

    fn alloc(&mut self, segment: Segment) -> u32 {
        let id = take_slot(&mut self.segments, &mut self.free_segments);
        self.segments[id as usize] = segment;
        id
    }

    fn free(&mut self, id: u32) {
        // The run's buffer goes back to the allocator, but for one spare per rank: a rank's
        // memory follows its live bookings.
        let run = std::mem::take(&mut self.segments[id as usize]).hashes;
        if run.capacity() <= SPARE_RUN_CAPACITY && run.capacity() > self.spare_run.capacity() {
            self.spare_run = run;
        }
        self.free_segments.push(id);
    }

    /// A buffer holding `run`: the spare one when it is large enough.
    fn run_buffer(&mut self, run: &[SequenceHash]) -> Vec<SequenceHash> {
        if self.spare_run.capacity() >= run.len() {
            let mut buffer = std::mem::take(&mut self.spare_run);
            buffer.clear();
            buffer.extend_from_slice(run);
            buffer
        } else {
            run.to_vec()
        }
    }

    /// Records `old` -> `new` in `parent`'s child set (`old` or `new` may be `ROOT` for
    /// "none").
    fn relink(&mut self, parent: u32, old: u32, new: u32) {
        if parent == ROOT {
            return;
        }
        let p = self.seg_mut(parent);
        if old != ROOT {
            p.children -= 1;
            p.child_xor ^= old;
        }
        if new != ROOT {
            p.children += 1;
            p.child_xor ^= new;
        }
    }

    /// Fills slot `id` with a segment holding `run` for one booking ending in it, under
    /// `parent`; the caller inserts the edge.
    fn fill_leaf(&mut self, id: u32, parent: u32, run: &[SequenceHash]) {
        let hashes = self.run_buffer(run);
        self.segments[id as usize] = Segment {
            hashes,
            parent,
            holders: 1,
            ends: 1,
            children: 0,
            child_xor: 0,
            fraction: 1.0,
        };
        self.relink(parent, ROOT, id);
        self.add_weight(1.0, run.len() as u64);
    }

    /// Splits `id` after its first `at` blocks: the head becomes a new segment (returned),
    /// the tail keeps `id` so handles of bookings ending in it and edges to its children
    /// stay valid. The caller re-points the edge that led to `id` at the head.
    fn split(&mut self, id: u32, at: usize) -> u32 {
        let s = self.seg_mut(id);
        let head_hashes = s.hashes[..at].to_vec();
        s.hashes.drain(..at);
        let tail_first = s.hashes[0].0;
        let (parent, holders, fraction) = (s.parent, s.holders, s.fraction);
        let head = self.alloc(Segment {
            hashes: head_hashes,
            parent,
            holders,
            ends: 0,
            children: 1,
            child_xor: id,
            fraction,
        });
        self.seg_mut(id).parent = head;
        self.relink(parent, id, head);
        self.children.insert((head, tail_first), id);
        head
    }

    /// Adds one holder along `path`, creating and splitting segments as needed; returns the
    /// handle of the path (the segment it ends in, `ROOT` for an empty path).
    pub(crate) fn insert_path(&mut self, path: &[SequenceHash]) -> u32 {
        let mut cur = ROOT;
        let mut i = 0;
        while i < path.len() {
            let rest = &path[i..];
            // One probe per segment boundary; within a segment the run is compared in bulk.
            let child = match self.children.entry((cur, rest[0].0)) {
                Entry::Occupied(e) => *e.get(),
                Entry::Vacant(e) => {
                    let id = take_slot(&mut self.segments, &mut self.free_segments);
                    e.insert(id);
                    self.fill_leaf(id, cur, rest);
                    return id;
                }
            };
            let s = self.seg(child);
            let seg_len = s.hashes.len();
            let m = common_prefix(&s.hashes, rest);
            i += m;
            if m == seg_len {
                let s = self.seg_mut(child);
                s.holders += 1;
                if i == path.len() {
                    s.ends += 1;
                    return child;
                }
                cur = child;
                continue;
            }
            // The path leaves (or stops inside) this run: split it where it does.
            let first = s.hashes[0].0;
            let parent = s.parent;
            let head = self.split(child, m);
            if let Some(e) = self.children.get_mut(&(parent, first)) {
                *e = head;
            }
            let h = self.seg_mut(head);
            h.holders += 1;
            if i == path.len() {
                h.ends += 1;
                return head;
            }
            let leaf = take_slot(&mut self.segments, &mut self.free_segments);
            self.children.insert((head, path[i].0), leaf);
            self.fill_leaf(leaf, head, &path[i..]);
            return leaf;
        }
        ROOT
    }

    /// Absorbs `id` into its only child when nothing tells them apart (no booking ends in
    /// `id`, same weight), so runs stay long after the bookings that cut them leave.
    fn merge_into_child(&mut self, id: u32) {
        let s = self.seg(id);
        if s.ends != 0 || s.children != 1 {
            return;
        }
        let child = s.child_xor;
        if self.seg(child).fraction != s.fraction {
            return;
        }
        let (parent, first) = (s.parent, s.hashes[0].0);
        let mut run = std::mem::take(&mut self.seg_mut(id).hashes);
        let c = self.seg_mut(child);
        let child_first = c.hashes[0].0;
        run.extend_from_slice(&c.hashes);
        c.hashes = run;
        c.parent = parent;
        self.children.remove(&(id, child_first));
        if let Some(e) = self.children.get_mut(&(parent, first)) {
            *e = child;
        }
        self.relink(parent, id, child);
        self.free(id);
    }

    /// Removes one holder from the path of handle `last`, dropping segments nobody holds.
    pub(crate) fn release_path(&mut self, last: u32) {
        if last == ROOT {
            return;
        }
        self.seg_mut(last).ends -= 1;
        let mut n = last;
        while n != ROOT {
            let s = self.seg_mut(n);
            s.holders -= 1;
            let parent = s.parent;
            if s.holders == 0 {
                // Holders count every child's holders, so a dead segment has no live child.
                let (fraction, len, first) = (s.fraction, s.hashes.len(), s.hashes[0].0);
                self.remove_weight(fraction, len as u64);
                self.children.remove(&(parent, first));
                self.relink(parent, n, ROOT);
                self.free(n);
            } else {
                self.merge_into_child(n);
            }
            n = parent;
        }
    }

    /// Sets the weight of the segments only this request holds, walking up from `last`.
    pub(crate) fn decay_exclusive_suffix(&mut self, last: u32, fraction: f64) {
        let mut n = last;
        while n != ROOT {
            let s = self.seg(n);
            if s.holders != 1 {
                break;
            }
            let (old, len, parent) = (s.fraction, s.hashes.len() as u64, s.parent);
            self.remove_weight(old, len);
            self.add_weight(fraction, len);
            self.seg_mut(n).fraction = fraction;
            if n != last {
                // Its only child (the segment below) has just been given the same weight.
                self.merge_into_child(n);
            }
            n = parent;
        }
    }

    /// Whether any booking's path is live on this rank.
    pub(crate) fn has_paths(&self) -> bool {
        !self.children.is_empty()
    }

    /// Length of the longest prefix of `path` that is active on this rank.
    #[inline]
    pub(crate) fn overlap_depth(&self, path: &[SequenceHash]) -> usize {
        // Idle ranks are the common case in a large fleet; skip hashing the first edge (and
        // the call: this check is inlined into the per-candidate loop).
        if self.children.is_empty() {
            return 0;
        }
        self.walk_depth(path)
    }

    fn walk_depth(&self, path: &[SequenceHash]) -> usize {
        let mut cur = ROOT;
        let mut i = 0;
        while i < path.len() {
            let Some(&child) = self.children.get(&(cur, path[i].0)) else {
                return i;
            };
            let run = &self.seg(child).hashes;
            let m = common_prefix(run, &path[i..]);
            i += m;
            if m < run.len() {
                return i;
            }
            cur = child;
        }
        path.len()
    }

    /// Number of live segments (for tests and invariants).
    #[cfg(test)]
    pub(crate) fn live_segments(&self) -> usize {
        self.children.len()
    }

    /// Number of live prompt blocks, i.e. of distinct active prefixes (for tests).
    #[cfg(test)]
    pub(crate) fn live_blocks(&self) -> usize {
        self.children
            .values()
            .map(|&id| self.seg(id).hashes.len())
            .sum()
    }

    /// Checks every structural invariant; panics on the first violation (for tests).
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        let mut holders_below = vec![0u32; self.segments.len()];
        let mut child_count = vec![0u32; self.segments.len()];
        let mut child_xor = vec![0u32; self.segments.len()];
        let (mut full, mut terms) = (0u64, 0u64);
        for (&(parent, first), &id) in &self.children {
            let s = self.seg(id);
            assert!(s.holders > 0, "live segment {id} without holders");
            assert_eq!(s.parent, parent, "edge parent of {id}");
            assert_eq!(
                s.hashes.first().map(|h| h.0),
                Some(first),
                "edge key of {id}"
            );
            if parent != ROOT {
                let p = parent as usize;
                holders_below[p] += s.holders;
                child_count[p] += 1;
                child_xor[p] ^= id;
                assert!(self.seg(parent).holders > 0, "dead parent of {id}");
            }
            if s.fraction == 1.0 {
                full += s.hashes.len() as u64;
            } else {
                terms += s.hashes.len() as u64;
            }
        }
        for &id in self.children.values() {
            let s = self.seg(id);
            let i = id as usize;
            assert_eq!(s.holders, s.ends + holders_below[i], "holders of {id}");
            assert_eq!(s.children, child_count[i], "child count of {id}");
            assert_eq!(s.child_xor, child_xor[i], "child xor of {id}");
        }
        assert_eq!(full, self.full_blocks, "full blocks");
        assert_eq!(terms, self.frac_terms, "decayed blocks");
        assert_eq!(
            self.children.len() + self.free_segments.len(),
            self.segments.len(),
            "slots are live or free"
        );
        for &id in &self.free_segments {
            let s = self.seg(id);
            assert!(
                s.holders == 0 && s.hashes.capacity() == 0,
                "free slot {id} holds memory"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn path(v: &[u64]) -> Vec<SequenceHash> {
        v.iter().copied().map(SequenceHash).collect()
    }

    /// Prompt weight as an exact sum (the tests only use dyadic fractions).
    fn weight(r: &RankState) -> f64 {
        r.full_blocks as f64 + r.frac_sum
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
        assert_eq!(r.live_blocks(), 0);
        r.check_invariants();
    }

    #[test]
    fn same_hash_under_different_parents_stays_distinct() {
        let mut r = RankState::default();
        r.insert_path(&path(&[1, 2]));
        r.insert_path(&path(&[2]));
        assert_eq!(r.decode_blocks(), 3);
        assert_eq!(r.overlap_depth(&path(&[2, 2])), 1);
        r.check_invariants();
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
        r.check_invariants();
    }

    #[test]
    fn a_long_path_is_one_segment_and_diverging_paths_split_it() {
        let mut r = RankState::default();
        let long: Vec<u64> = (0..256).collect();
        let a = r.insert_path(&path(&long));
        assert_eq!((r.live_segments(), r.live_blocks()), (1, 256));
        let mut other = long[..100].to_vec();
        other.extend([1_000, 1_001]);
        let b = r.insert_path(&path(&other));
        // [0, 100) shared, then [100, 256) and [1000, 1002).
        assert_eq!((r.live_segments(), r.live_blocks()), (3, 258));
        assert_eq!(r.decode_blocks(), 258);
        assert_eq!(r.overlap_depth(&path(&long)), 256);
        assert_eq!(r.overlap_depth(&path(&other)), 102);
        assert_eq!(r.overlap_depth(&path(&long[..50])), 50);
        let mut probe = long[..150].to_vec();
        probe.push(7);
        assert_eq!(
            r.overlap_depth(&probe.iter().copied().map(SequenceHash).collect::<Vec<_>>()),
            150
        );
        r.check_invariants();
        // Diverging at the very first block: a new first-level segment, no split.
        let c = r.insert_path(&path(&[5_000, 1, 2]));
        assert_eq!((r.live_segments(), r.live_blocks()), (4, 261));
        r.release_path(b);
        r.check_invariants();
        // The shared head merged back into the remaining run.
        assert_eq!((r.live_segments(), r.live_blocks()), (2, 259));
        r.release_path(a);
        r.release_path(c);
        assert_eq!(
            (r.live_segments(), r.live_blocks(), r.decode_blocks()),
            (0, 0, 0)
        );
        r.check_invariants();
    }

    #[test]
    fn a_path_that_is_a_prefix_of_another_splits_where_it_ends() {
        for shorter_first in [false, true] {
            let mut r = RankState::default();
            let (long, short) = (path(&[1, 2, 3, 4, 5, 6, 7, 8, 9]), path(&[1, 2, 3, 4]));
            let (a, b) = if shorter_first {
                let b = r.insert_path(&short);
                (r.insert_path(&long), b)
            } else {
                let a = r.insert_path(&long);
                (a, r.insert_path(&short))
            };
            assert_eq!((r.live_segments(), r.live_blocks()), (2, 9));
            assert_eq!(r.decode_blocks(), 9);
            r.check_invariants();
            // The same path twice shares everything, including the end.
            let b2 = r.insert_path(&short);
            assert_eq!(b2, b);
            assert_eq!((r.live_segments(), r.decode_blocks()), (2, 9));
            r.release_path(b2);
            r.release_path(b);
            r.check_invariants();
            assert_eq!((r.live_segments(), r.live_blocks()), (1, 9));
            assert_eq!(r.overlap_depth(&short), 4);
            r.release_path(a);
            assert_eq!((r.live_segments(), r.decode_blocks()), (0, 0));
            r.check_invariants();
        }
    }

    #[test]
    fn repeated_hashes_and_paths_ending_mid_run() {
        let mut r = RankState::default();
        let a = r.insert_path(&path(&[2, 2, 2]));
        let b = r.insert_path(&path(&[2]));
        let c = r.insert_path(&path(&[2, 2, 2, 2]));
        let d = r.insert_path(&path(&[2, 2]));
        assert_eq!(r.decode_blocks(), 4);
        assert_eq!(r.live_segments(), 4);
        assert_eq!(r.overlap_depth(&path(&[2, 2, 2, 2, 2])), 4);
        r.check_invariants();
        for h in [c, a, d, b] {
            r.release_path(h);
            r.check_invariants();
        }
        assert_eq!(r.live_segments(), 0);
    }

    #[test]
    fn decay_of_a_suffix_inside_a_run_splits_by_holders_not_by_weight() {
        let mut r = RankState::default();
        let a = r.insert_path(&path(&[1, 2, 3, 4]));
        let b = r.insert_path(&path(&[1, 2]));
        // [1, 2] has two holders, [3, 4] one: only the tail of the original run decays.
        r.decay_exclusive_suffix(a, 0.5);
        assert_eq!(weight(&r), 3.0);
        assert_eq!(r.frac_terms, 2);
        // A request ending inside a shared run holds nothing alone.
        r.decay_exclusive_suffix(b, 0.25);
        assert_eq!(weight(&r), 3.0);
        r.check_invariants();
        r.release_path(b);
        // [1, 2] at 1.0 and [3, 4] at 0.5 stay apart: one weight per segment.
        assert_eq!((r.live_segments(), weight(&r)), (2, 3.0));
        r.check_invariants();
        // A second decay covers both and they merge again.
        r.decay_exclusive_suffix(a, 0.25);
        assert_eq!((r.live_segments(), weight(&r)), (1, 1.0));
        assert_eq!(r.frac_terms, 4);
        r.check_invariants();
        // A new booking through a decayed run keeps its weight; its own blocks weigh 1.0.
        let c = r.insert_path(&path(&[1, 2, 9]));
        assert_eq!(weight(&r), 2.0);
        r.check_invariants();
        r.release_path(a);
        assert_eq!(weight(&r), 1.5);
        r.release_path(c);
        assert_eq!((r.frac_terms, r.frac_sum, r.full_blocks), (0, 0.0, 0));
        r.check_invariants();
    }

    #[test]
    fn every_release_order_leaves_consistent_state_and_nothing_behind() {
        let paths = [
            path(&[1, 2, 3, 4, 5]),
            path(&[1, 2, 3]),
            path(&[1, 2, 6, 7]),
            path(&[1, 2, 3, 4, 5, 8]),
        ];
        let mut orders = Vec::new();
        for a in 0..4 {
            for b in (0..4).filter(|&b| b != a) {
                for c in (0..4).filter(|&c| c != a && c != b) {
                    orders.push([a, b, c, 6 - a - b - c]);
                }
            }
        }
        assert_eq!(orders.len(), 24);
        for order in orders {
            let mut r = RankState::default();
            let handles: Vec<u32> = paths.iter().map(|p| r.insert_path(p)).collect();
            r.decay_exclusive_suffix(handles[3], 0.5);
            assert_eq!(r.live_blocks(), 8);
            let mut live: Vec<usize> = (0..paths.len()).collect();
            for &i in &order {
                r.release_path(handles[i]);
                live.retain(|&l| l != i);
                r.check_invariants();
                let mut prefixes: Vec<&[SequenceHash]> = live
                    .iter()
                    .flat_map(|&l| {
                        let p = &paths[l];
                        (1..=p.len()).map(move |n| &p[..n])
                    })
                    .collect();
                prefixes.sort();
                prefixes.dedup();
                assert_eq!(r.live_blocks(), prefixes.len(), "{order:?}");
            }
            assert_eq!((r.live_segments(), r.decode_blocks()), (0, 0), "{order:?}");
            assert_eq!((r.frac_terms, r.frac_sum), (0, 0.0), "{order:?}");
        }
    }

    #[test]
    fn an_empty_path_holds_nothing() {
        let mut r = RankState::default();
        let h = r.insert_path(&[]);
        assert_eq!(h, ROOT);
        assert_eq!(r.overlap_depth(&path(&[1])), 0);
        r.decay_exclusive_suffix(h, 0.5);
        r.release_path(h);
        assert_eq!((r.live_segments(), r.decode_blocks()), (0, 0));
    }

    /// The naive model: every booking's path, every distinct prefix counted once.
    #[derive(Debug, Default)]
    struct Naive {
        live: Vec<(usize, Vec<u64>)>,
        fractions: HashMap<Vec<u64>, f64>,
    }

    impl Naive {
        fn holders(&self, prefix: &[u64]) -> usize {
            self.live
                .iter()
                .filter(|(_, p)| p.starts_with(prefix))
                .count()
        }

        fn prefixes(&self) -> Vec<&[u64]> {
            let mut v: Vec<&[u64]> = self
                .live
                .iter()
                .flat_map(|(_, p)| (1..=p.len()).map(move |n| &p[..n]))
                .collect();
            v.sort();
            v.dedup();
            v
        }

        fn weight(&self) -> f64 {
            self.prefixes()
                .iter()
                .map(|p| self.fractions.get(*p).copied().unwrap_or(1.0))
                .sum()
        }

        fn overlap(&self, probe: &[u64]) -> usize {
            (0..=probe.len())
                .rev()
                .find(|&l| l == 0 || self.holders(&probe[..l]) > 0)
                .unwrap_or(0)
        }
    }

    #[derive(Debug, Clone)]
    enum RankOp {
        Insert(Vec<u64>),
        Release(usize),
        Decay(usize, f64),
        Probe(Vec<u64>),
    }

    fn rank_op() -> impl Strategy<Value = RankOp> {
        let p = || prop::collection::vec(0u64..3, 0..9);
        prop_oneof![
            4 => p().prop_map(RankOp::Insert),
            3 => any::<usize>().prop_map(RankOp::Release),
            2 => (any::<usize>(), prop::sample::select(vec![0.0, 0.25, 0.5, 0.75, 1.0]))
                .prop_map(|(i, f)| RankOp::Decay(i, f)),
            2 => p().prop_map(RankOp::Probe),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn rank_state_matches_the_naive_prefix_model(
            ops in prop::collection::vec(rank_op(), 1..60),
        ) {
            let mut r = RankState::default();
            let mut model = Naive::default();
            let mut handles: HashMap<usize, u32> = HashMap::new();
            let mut next = 0usize;
            for op in ops {
                match op {
                    RankOp::Insert(p) => {
                        handles.insert(next, r.insert_path(&path(&p)));
                        model.live.push((next, p));
                        next += 1;
                    }
                    RankOp::Release(i) if !model.live.is_empty() => {
                        let (b, _) = model.live.remove(i % model.live.len());
                        r.release_path(handles[&b]);
                        let fractions = std::mem::take(&mut model.fractions);
                        model.fractions =
                            fractions.into_iter().filter(|(p, _)| model.holders(p) > 0).collect();
                    }
                    RankOp::Decay(i, f) if !model.live.is_empty() => {
                        let (b, p) = model.live[i % model.live.len()].clone();
                        r.decay_exclusive_suffix(handles[&b], f);
                        for n in (1..=p.len()).rev() {
                            if model.holders(&p[..n]) != 1 {
                                break;
                            }
                            model.fractions.insert(p[..n].to_vec(), f);
                        }
                    }
                    RankOp::Probe(p) => {
                        prop_assert_eq!(r.overlap_depth(&path(&p)), model.overlap(&p));
                    }
                    RankOp::Release(_) | RankOp::Decay(..) => {}
                }
                r.check_invariants();
                let want = model.weight();
                prop_assert_eq!(weight(&r), want);
                prop_assert_eq!(r.decode_blocks(), want.round() as u64);
                prop_assert_eq!(r.live_blocks(), model.prefixes().len());
                prop_assert!(r.live_segments() <= r.live_blocks());
                for (_, p) in &model.live {
                    prop_assert_eq!(r.overlap_depth(&path(p)), p.len());
                }
            }
            for (b, _) in std::mem::take(&mut model.live) {
                r.release_path(handles[&b]);
            }
            r.check_invariants();
            prop_assert_eq!((r.live_segments(), r.decode_blocks(), r.frac_terms), (0, 0, 0));
        }
    }
}
