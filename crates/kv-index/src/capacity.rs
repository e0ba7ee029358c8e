//! The bookkeeping behind a worker key's declared capacity (`total_kv_blocks`): which of
//! its blocks to evict when it holds more than the capacity, oldest first and leaf-first.
//!
//! An engine cannot cache more blocks than it has, so blocks beyond its capacity are state
//! whose `Removed` event was lost; without a bound they stay in the index for as long as
//! the worker lives. The trie ([`crate::PrefixIndex`]) owns the blocks and does the
//! eviction; this module only decides the order, from node ids and the few facts about
//! them the trie passes in (is a node still held by this worker, what is its parent).
//!
//! # Cost while nothing is evicted
//! One `VecDeque` push of an 8-byte entry per block the worker gains, and an occasional
//! compaction that drops entries of blocks it no longer holds, run a bounded step per
//! store so that no store pauses the index for the whole order. Nothing per lost block.
//!
//! # Leaf-first
//! Evicting a block that still has a child held by the same worker would cut that child's
//! chain off (a hole no engine leaves), so only blocks without such a child are evicted.
//! Knowing that needs the worker's child count per block, which the trie cannot give
//! cheaply (branch children sit in a hash map keyed by child). The counts are therefore
//! built from the gain order as the worker nears its capacity, kept exact from then on by
//! every gain and loss, and dropped again once the worker is well below its capacity (its
//! removals arrive again), so only a worker that is losing removals pays a hash update per
//! block.
//!
//! # Counting ahead
//! Counting a whole gain order at once took 78 ms at a million blocks, inside the store
//! that first took the worker past its capacity: every lookup of a one-copy index waited
//! for it. The count therefore starts once the worker holds seven eighths of its capacity
//! and looks at a bounded number of entries per store ([`Capacity::count_ahead`]): at
//! least [`COMPACT_PER_CALL`], and sixteen per block gained since the last step, so it
//! ends before the last eighth is filled even when the order holds twice the capacity.
//! Meanwhile every gain is counted at once and every loss of a counted block uncounts it,
//! and a set of the counted nodes keeps a block that appears twice in the order (lost and
//! gained again) from counting twice. Only a capacity lowered below the held blocks, or a
//! single store of more than an eighth of the capacity, reaches an eviction before the
//! count ends (or starts); that eviction counts the rest at once ([`Capacity::count_now`]).
//!
//! # Stale ids
//! A block the worker loses stays in the gain order until it reaches the front or the order
//! is compacted. Its node may be freed and taken at once by another block (the trie reuses
//! freed nodes first), even one of this worker, so an id alone cannot say whether the
//! block is still held: each entry carries a tag of its block beside the node id (the low
//! half of the node's engine hash), and an entry whose node has another tag is stale. The
//! front loses its stale entries a few per store ([`Capacity::trim_front`]), which keeps a
//! worker whose engine removes its oldest blocks, the usual case, at about one entry per
//! held block without compacting, so no store pauses the index for a whole compaction.
//!
//! # Order
//! Candidates come from the front of the gain order (oldest first). A candidate that still
//! has a child of this worker is put on a stack and retried before the next candidate, so
//! the oldest chain is evicted from its leaf back to its root (children are gained after
//! their parents, hence lie after them in the order) before anything younger.

use std::collections::VecDeque;

use rustc_hash::{FxHashMap, FxHashSet};

/// One gained block: its node id in the low half, its tag (the low half of the node's
/// engine hash) in the high half.
pub(crate) type Entry = u64;

/// The entry of `node` holding the block tagged `tag`.
#[inline]
pub(crate) fn entry(node: u32, tag: u32) -> Entry {
    (u64::from(tag) << 32) | u64::from(node)
}

/// The node of an entry.
#[inline]
pub(crate) fn node_of(e: Entry) -> u32 {
    e as u32
}

/// The tag of an entry.
#[inline]
pub(crate) fn tag_of(e: Entry) -> u32 {
    (e >> 32) as u32
}

/// Stale entries [`Capacity::trim_front`] drops at most per call.
const TRIM_PER_CALL: usize = 16;

/// Gain order, held candidates and (while evicting) child counts of one worker key.
#[derive(Debug, Clone)]
pub(crate) struct Capacity {
    limit: u32,
    /// While a compaction runs: the entries it kept so far, which come before `order`.
    /// Empty otherwise.
    fresh: VecDeque<Entry>,
    /// Entries in the order the worker gained them (after `fresh`). May hold entries of
    /// blocks it no longer holds (skipped when met) and, after a block was lost and gained
    /// again, an entry twice.
    order: VecDeque<Entry>,
    /// Entries at the front of `order` the running compaction has still to look at; 0
    /// when none runs.
    to_scan: usize,
    /// The running compaction also drops repeated entries: the ones it kept so far.
    seen: Option<FxHashSet<Entry>>,
    /// Candidates taken from `order` that had a child of this worker when met; retried
    /// from the top.
    held: Vec<Entry>,
    /// Per node, the number of its children this worker holds (absent = 0). `Some` only
    /// while the worker evicts; exact whenever `Some`.
    kids: Option<FxHashMap<u32, u32>>,
    /// The count of `kids` in progress, while the worker nears its capacity.
    ahead: Option<Box<Counting>>,
}

/// A count of the worker's children per node, built a step per store ahead of its first
/// eviction (see "Counting ahead" above). No compaction runs meanwhile, so `order` only
/// loses entries at its front.
#[derive(Debug, Clone, Default)]
struct Counting {
    /// Per node, its children among `counted`.
    kids: FxHashMap<u32, u32>,
    /// The nodes counted so far: those of the entries looked at that were held then, and
    /// every node gained since the count started, less the ones lost since.
    counted: FxHashSet<u32>,
    /// Index in `order` of the next entry to look at.
    next: usize,
    /// Entries from `next` on still to look at: the ones `order` held when the count
    /// started, less those trimmed from its front before they were looked at.
    left: usize,
    /// Blocks gained since the last step: the next step looks at sixteen entries per block.
    gained: usize,
}

impl Counting {
    /// Counts `node`, a child of `parent`, unless it is counted already.
    #[inline]
    fn count(&mut self, node: u32, parent: u32) {
        if self.counted.insert(node) {
            add_child(&mut self.kids, parent);
        }
    }
}

/// Adds one child of `parent` to `kids`.
#[inline]
fn add_child(kids: &mut FxHashMap<u32, u32>, parent: u32) {
    *kids.entry(parent).or_insert(0) += 1;
}

/// Takes one child of `parent` off `kids`.
#[inline]
fn uncount(kids: &mut FxHashMap<u32, u32>, parent: u32) {
    if let Some(n) = kids.get_mut(&parent) {
        *n -= 1;
        if *n == 0 {
            kids.remove(&parent);
        }
    }
}

/// Ids kept in the gain order beyond twice the held blocks before it is compacted.
const SLACK: usize = 64;

/// Entries a running compaction looks at per store ([`Capacity::maybe_compact`]): a store
/// gains at most a piece's blocks, so the compaction keeps ahead of the gains, and no store
/// pauses the index for more than this many node reads.
const COMPACT_PER_CALL: usize = 256;

impl Capacity {
    pub(crate) fn new(limit: u32) -> Self {
        Capacity {
            limit,
            fresh: VecDeque::new(),
            order: VecDeque::new(),
            to_scan: 0,
            seen: None,
            held: Vec::new(),
            kids: None,
            ahead: None,
        }
    }

    /// The declared number of blocks.
    pub(crate) fn limit(&self) -> u32 {
        self.limit
    }

    pub(crate) fn set_limit(&mut self, limit: u32) {
        self.limit = limit;
    }

    /// The worker gained `node` (holding the block tagged `tag`), a child of `parent`.
    #[inline(always)]
    pub(crate) fn gained(&mut self, node: u32, tag: u32, parent: u32) {
        self.order.push_back(entry(node, tag));
        if let Some(kids) = &mut self.kids {
            add_child(kids, parent);
        } else if let Some(ahead) = &mut self.ahead {
            ahead.gained += 1;
            ahead.count(node, parent);
        }
    }

    /// Whether losses must be reported through [`Capacity::lost`] (only while evicting or
    /// counting ahead of it).
    #[inline]
    pub(crate) fn counting(&self) -> bool {
        self.kids.is_some() || self.ahead.is_some()
    }

    /// The worker lost `node`, a child of `parent`.
    #[inline]
    pub(crate) fn lost(&mut self, node: u32, parent: u32) {
        if let Some(kids) = &mut self.kids {
            uncount(kids, parent);
        } else if let Some(ahead) = &mut self.ahead
            && ahead.counted.remove(&node)
        {
            uncount(&mut ahead.kids, parent);
        }
    }

    /// Once the worker holds seven eighths of its capacity (`held` blocks), counts its
    /// children per node a bounded step per call, so that the counts are ready when it
    /// first exceeds the capacity (see "Counting ahead" above). Called after every store.
    pub(crate) fn count_ahead(
        &mut self,
        held: u32,
        holds: impl Fn(Entry) -> bool,
        parent: impl Fn(u32) -> u32,
    ) {
        if self.kids.is_some() {
            return;
        }
        if self.ahead.is_none() {
            if self.to_scan > 0 || u64::from(held) * 8 < u64::from(self.limit) * 7 {
                return;
            }
            self.start_count(&holds, &parent);
        }
        self.count_step(&holds, &parent, None);
    }

    /// Starts a count of the children per node (no compaction running): the held
    /// candidates, few, at once, and the gain order a step at a time from its front.
    fn start_count(&mut self, holds: &impl Fn(Entry) -> bool, parent: &impl Fn(u32) -> u32) {
        let mut ahead = Box::new(Counting {
            left: self.order.len(),
            ..Counting::default()
        });
        for &e in self.held.iter().filter(|&&e| holds(e)) {
            ahead.count(node_of(e), parent(node_of(e)));
        }
        self.ahead = Some(ahead);
    }

    /// Makes the child counts exact now: ends the count ahead, or counts the whole gain
    /// order when none runs (an eviction that came before seven eighths of the capacity
    /// were ever held, or right after a lowered capacity).
    fn count_now(&mut self, holds: &impl Fn(Entry) -> bool, parent: &impl Fn(u32) -> u32) {
        if self.ahead.is_none() {
            self.finish_compaction(holds);
            self.start_count(holds, parent);
        }
        self.count_step(holds, parent, Some(usize::MAX));
    }

    /// Looks at the next entries of the count ahead: `budget` of them, or by default
    /// [`COMPACT_PER_CALL`] and sixteen per block gained since the last step. Ends the count
    /// when none is left, making its counts the exact `kids`.
    fn count_step(
        &mut self,
        holds: &impl Fn(Entry) -> bool,
        parent: &impl Fn(u32) -> u32,
        budget: Option<usize>,
    ) {
        let Some(ahead) = &mut self.ahead else {
            return;
        };
        let budget = budget.unwrap_or(COMPACT_PER_CALL.max(ahead.gained.saturating_mul(16)));
        ahead.gained = 0;
        let end = ahead.next + ahead.left.min(budget);
        for &e in self.order.range(ahead.next..end) {
            if holds(e) {
                ahead.count(node_of(e), parent(node_of(e)));
            }
        }
        ahead.left -= end - ahead.next;
        ahead.next = end;
        if ahead.left == 0 {
            self.kids = self.ahead.take().map(|a| a.kids);
        }
    }

    /// Drops the child counts once the worker holds at most three quarters of its capacity
    /// (`held` blocks): its removals arrive again, so its gains and losses go back to
    /// costing nothing here. Rebuilding them takes at least a quarter of the capacity in
    /// new gains, so the rebuilds cost O(1) per gain.
    pub(crate) fn relax(&mut self, held: u32) {
        if u64::from(held) * 4 <= u64::from(self.limit) * 3 {
            self.kids = None;
            self.ahead = None;
        }
    }

    /// Entries kept: the gain order (a running compaction's kept part included) and the
    /// held candidates.
    pub(crate) fn len(&self) -> usize {
        self.fresh.len() + self.order.len() + self.held.len()
    }

    /// The oldest entry of the gain order.
    fn front(&self) -> Option<Entry> {
        self.fresh.front().or(self.order.front()).copied()
    }

    /// Takes the oldest entry of the gain order.
    fn pop_front(&mut self) -> Option<Entry> {
        let e = pop_front(
            &mut self.fresh,
            &mut self.order,
            &mut self.to_scan,
            &mut self.seen,
        )?;
        if let Some(ahead) = &mut self.ahead {
            // The entry was looked at already, or never will be.
            if ahead.next > 0 {
                ahead.next -= 1;
            } else {
                ahead.left = ahead.left.saturating_sub(1);
            }
        }
        Some(e)
    }

    /// Drops stale entries from the front of the gain order, at most [`TRIM_PER_CALL`],
    /// while it holds more entries than the worker holds blocks (`held`).
    pub(crate) fn trim_front(&mut self, held: u32, holds: impl Fn(Entry) -> bool) {
        for _ in 0..TRIM_PER_CALL {
            if self.len() <= held as usize {
                return;
            }
            match self.front() {
                Some(e) if !holds(e) => {
                    self.pop_front();
                }
                _ => return,
            }
        }
    }

    /// Compacts the gain order, a step per call, once stale entries outnumber the held
    /// blocks (`held`): keeps the entries that `holds`, in order. A compaction looks at
    /// [`COMPACT_PER_CALL`] entries per call, so a large worker's compaction never pauses
    /// the index for long (a whole one costs about 16 ns per entry, 2 ms at 62,500 blocks,
    /// and would run inside one write section). One that leaves more than a quarter of `held` in excess
    /// (repeats: blocks lost and gained again meanwhile) is followed by one that also
    /// keeps only the first of repeated entries. Amortized O(1) per gain.
    pub(crate) fn maybe_compact(&mut self, held: u32, holds: impl Fn(Entry) -> bool) {
        if self.to_scan == 0 {
            // A count ahead reads `order` by position; it ends within a few stores.
            if self.len() <= 2 * held as usize + SLACK || self.ahead.is_some() {
                return;
            }
            self.start_compaction(&holds, false);
        }
        // Every held node has an entry, so a large excess left is repeats.
        if self.compact_step(&holds, COMPACT_PER_CALL)
            && self.seen.take().is_none()
            && self.len() > held as usize + held as usize / 4 + SLACK
        {
            self.start_compaction(&holds, true);
        }
    }

    /// Starts a compaction of `order` (the held candidates, few, are compacted at once).
    fn start_compaction(&mut self, holds: &impl Fn(Entry) -> bool, dedup: bool) {
        self.held.retain(|&e| holds(e));
        self.seen = dedup.then(|| {
            let mut seen = FxHashSet::default();
            self.held.retain(|&e| seen.insert(e));
            seen
        });
        self.to_scan = self.order.len();
        // Allocated now, touched a step at a time: growing by doubling would copy the kept
        // entries and fault in the new buffer's pages inside one store (about 5 ms at
        // 800,000 entries). The buffers swap at the end, so later compactions reuse them.
        self.fresh.reserve(self.to_scan + self.to_scan / 8);
    }

    /// Looks at up to `budget` entries of the running compaction; finishes it when none is
    /// left to look at, and then returns true (`seen` still tells whether it dropped
    /// repeats).
    fn compact_step(&mut self, holds: &impl Fn(Entry) -> bool, budget: usize) -> bool {
        for _ in 0..budget {
            if self.to_scan == 0 {
                break;
            }
            let Some(e) = self.order.pop_front() else {
                self.to_scan = 0;
                break;
            };
            self.to_scan -= 1;
            let keep = holds(e) && self.seen.as_mut().is_none_or(|seen| seen.insert(e));
            if keep {
                self.fresh.push_back(e);
            }
        }
        if self.to_scan > 0 {
            return false;
        }
        // Done: the kept entries, then those gained meanwhile.
        self.fresh.append(&mut self.order);
        std::mem::swap(&mut self.fresh, &mut self.order);
        true
    }

    /// Runs the compaction in progress, if any, to its end.
    fn finish_compaction(&mut self, holds: &impl Fn(Entry) -> bool) {
        if self.to_scan > 0 {
            self.compact_step(holds, usize::MAX);
            self.seen = None;
        }
    }

    /// Forgets the gain order: the worker holds nothing any more.
    pub(crate) fn clear(&mut self) {
        self.fresh.clear();
        self.order.clear();
        self.to_scan = 0;
        self.seen = None;
        self.held.clear();
        self.kids = None;
        self.ahead = None;
    }

    /// The node of the next block to evict: the oldest candidate without a child of this
    /// worker. `holds(entry)` says whether the worker still holds the entry's block,
    /// `parent(node)` gives a node's parent. `None` only when the worker holds nothing
    /// this bookkeeping knows of.
    pub(crate) fn victim(
        &mut self,
        holds: impl Fn(Entry) -> bool,
        parent: impl Fn(u32) -> u32,
    ) -> Option<u32> {
        if self.kids.is_none() {
            self.count_now(&holds, &parent);
        }
        let kids = self.kids.as_ref()?;
        let leaf = |e: Entry| !kids.contains_key(&node_of(e));
        loop {
            if let Some(&top) = self.held.last() {
                if !holds(top) {
                    self.held.pop();
                    continue;
                }
                if leaf(top) {
                    self.held.pop();
                    return Some(node_of(top));
                }
            }
            // Not `self.pop_front()`: `kids` borrows `self`.
            match pop_front(
                &mut self.fresh,
                &mut self.order,
                &mut self.to_scan,
                &mut self.seen,
            ) {
                Some(e) if !holds(e) => {}
                Some(e) if leaf(e) => return Some(node_of(e)),
                Some(e) => self.held.push(e),
                None => break,
            }
        }
        // Every candidate is held and the top one still has a child: the child was gained
        // earlier than its parent (the parent was lost and gained again). Any held leaf
        // will do; the deepest-held candidates are the youngest.
        self.held.retain(|&e| holds(e));
        let i = self.held.iter().rposition(|&e| leaf(e))?;
        Some(node_of(self.held.remove(i)))
    }

    /// Whether a compaction is running (for tests of the trie).
    #[cfg(test)]
    pub(crate) fn compacting(&self) -> bool {
        self.to_scan > 0
    }

    /// The child counts, while evicting (for the trie's invariant checks).
    #[cfg(test)]
    pub(crate) fn child_counts(&self) -> Option<&FxHashMap<u32, u32>> {
        self.kids.as_ref()
    }

    /// The count ahead in progress: its counts and the nodes they count (for the trie's
    /// invariant checks).
    #[cfg(test)]
    pub(crate) fn counts_ahead(&self) -> Option<(&FxHashMap<u32, u32>, &FxHashSet<u32>)> {
        self.ahead.as_ref().map(|a| (&a.kids, &a.counted))
    }

    /// Bytes allocated by this bookkeeping.
    pub(crate) fn allocated_bytes(&self) -> usize {
        (self.fresh.capacity() + self.order.capacity()) * std::mem::size_of::<Entry>()
            + self.held.capacity() * std::mem::size_of::<Entry>()
            + self.kids.as_ref().map_or(0, |k| {
                k.capacity() * (std::mem::size_of::<(u32, u32)>() + 1)
            })
            + self.ahead.as_ref().map_or(0, |a| {
                a.kids.capacity() * (std::mem::size_of::<(u32, u32)>() + 1)
                    + a.counted.capacity() * (std::mem::size_of::<u32>() + 1)
            })
    }
}

/// [`Capacity::pop_front`] on the fields it takes: the oldest entry of `fresh` (a running
/// compaction's kept entries), else of `order`, where it is one fewer for the compaction
/// to look at.
fn pop_front(
    fresh: &mut VecDeque<Entry>,
    order: &mut VecDeque<Entry>,
    to_scan: &mut usize,
    seen: &mut Option<FxHashSet<Entry>>,
) -> Option<Entry> {
    if let Some(e) = fresh.pop_front() {
        return Some(e);
    }
    let e = order.pop_front()?;
    *to_scan = to_scan.saturating_sub(1);
    if *to_scan == 0 {
        *seen = None;
    }
    Some(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tree given as `parent[node]`; `held` marks the worker's blocks.
    struct Tree {
        parent: Vec<u32>,
        held: Vec<bool>,
    }

    impl Tree {
        /// Nodes `1..=n` in chains of `len` under the root 0 (`len*k + 1 ..= len*k + len`),
        /// none held yet.
        fn chains(n: usize, len: u32) -> Self {
            let parent = (0..=n as u32)
                .map(|i| if i == 0 || i % len == 1 { 0 } else { i - 1 })
                .collect();
            Tree {
                parent,
                held: vec![false; n + 1],
            }
        }

        /// Evicts through `cap` until nothing is held, returning the order.
        fn drain(&mut self, cap: &mut Capacity) -> Vec<u32> {
            let mut out = Vec::new();
            loop {
                let (held, parent) = (&self.held, &self.parent);
                let Some(v) = cap.victim(|e| held[node_of(e) as usize], |n| parent[n as usize])
                else {
                    break;
                };
                assert!(self.held[v as usize], "evicted {v} twice");
                let has_held_child =
                    (0..self.parent.len()).any(|c| self.held[c] && self.parent[c] == v);
                assert!(!has_held_child, "{v} evicted before its child");
                self.held[v as usize] = false;
                cap.lost(v, self.parent[v as usize]);
                out.push(v);
            }
            out
        }
    }

    #[test]
    fn oldest_chain_goes_leaf_first_then_the_next() {
        // 0 is the root; chain 1-2-3 then chain 4-5, both under the root, then 6 under 2.
        let mut tree = Tree {
            parent: vec![0, 0, 1, 2, 0, 4, 2],
            held: vec![false, true, true, true, true, true, true],
        };
        let mut cap = Capacity::new(2);
        for n in 1..=6 {
            cap.gained(n, 0, tree.parent[n as usize]);
        }
        // 3 (the leaf of the oldest chain), then 2 waits for 6, which is younger than 4-5.
        assert_eq!(tree.drain(&mut cap), [3, 5, 4, 6, 2, 1]);
    }

    #[test]
    fn stale_and_repeated_ids_are_skipped_and_compacted() {
        let mut tree = Tree {
            parent: vec![0, 0, 1],
            held: vec![false, true, true],
        };
        let mut cap = Capacity::new(1);
        for _ in 0..100 {
            cap.gained(1, 0, 0);
            cap.gained(2, 0, 1);
        }
        // A compaction of the 200 entries in steps (all live, so it keeps them all), then
        // one that drops repeats.
        let holds = |e: Entry| tree.held[node_of(e) as usize];
        cap.maybe_compact(2, holds);
        assert!(cap.to_scan > 0 && cap.len() == 200, "a compaction runs");
        for _ in 0..7 {
            cap.maybe_compact(2, holds);
        }
        assert_eq!((cap.len(), cap.to_scan), (2, 0));
        assert_eq!(tree.drain(&mut cap), [2, 1]);
    }

    /// Evicting while a compaction is half done (it pops the kept part first, then what the
    /// compaction has not looked at yet) takes the blocks in the order a whole compaction
    /// gives.
    #[test]
    fn a_compaction_spread_over_stores_evicts_in_the_order_of_one_done_at_once() {
        // 300 chains `2k+1` -> `2k+2` under the root; two in three are lost afterwards.
        let n = 600usize;
        let mut parent = vec![0u32; n + 1];
        for k in 0..300u32 {
            parent[2 * k as usize + 2] = 2 * k + 1;
        }
        let mut held = vec![true; n + 1];
        held[0] = false;
        let build = |held: &[bool], parent: &[u32]| {
            let mut cap = Capacity::new(10);
            for i in 1..=n as u32 {
                cap.gained(i, 0, parent[i as usize]);
            }
            // Counting from the start, so the evictions below pop a running compaction.
            cap.count_now(&|e| held[node_of(e) as usize], &|x| parent[x as usize]);
            cap
        };
        let (mut spread, mut whole) = (build(&held, &parent), build(&held, &parent));
        for k in (0..300usize).filter(|k| k % 3 != 0) {
            for node in [2 * k + 2, 2 * k + 1] {
                held[node] = false;
                spread.lost(node as u32, parent[node]);
                whole.lost(node as u32, parent[node]);
            }
        }
        let holds = |e: Entry| held[node_of(e) as usize];
        spread.maybe_compact(200, holds);
        assert!(spread.to_scan > 0, "a compaction runs");
        whole.maybe_compact(200, holds);
        whole.finish_compaction(&holds);
        assert_eq!((whole.to_scan, whole.len()), (0, 200));
        let mut tree = Tree { parent, held };
        let mut copy = Tree {
            parent: tree.parent.clone(),
            held: tree.held.clone(),
        };
        let order = tree.drain(&mut spread);
        assert_eq!(order.len(), 200);
        assert_eq!(order, copy.drain(&mut whole));
    }

    #[test]
    fn a_parent_gained_after_its_child_is_still_evicted_after_it() {
        // 2 under 1; 1 was lost and gained again, so it comes after 2 in the order.
        let mut tree = Tree {
            parent: vec![0, 0, 1],
            held: vec![false, true, true],
        };
        let mut cap = Capacity::new(1);
        cap.gained(2, 0, 1);
        cap.gained(1, 0, 0);
        assert_eq!(tree.drain(&mut cap), [2, 1]);
    }

    #[test]
    fn counts_are_dropped_well_below_the_limit() {
        let mut cap = Capacity::new(4);
        let held = [false, true, true];
        cap.gained(1, 0, 0);
        cap.gained(2, 0, 1);
        assert_eq!(
            cap.victim(|e| held[node_of(e) as usize], |n| n.saturating_sub(1)),
            Some(2)
        );
        assert!(cap.counting());
        cap.relax(4);
        assert!(cap.counting());
        cap.relax(3);
        assert!(!cap.counting());
    }

    #[test]
    fn a_reused_node_is_not_its_old_block_and_the_front_loses_stale_entries() {
        // Node 1 held block A (tag 7), was lost and freed, and now holds block B (tag 9),
        // gained after node 2: 2 is the oldest block held.
        let tags = [0u32, 9, 5];
        let held = [false, true, true];
        let holds = |e: Entry| held[node_of(e) as usize] && tags[node_of(e) as usize] == tag_of(e);
        let mut cap = Capacity::new(1);
        cap.gained(1, 7, 0);
        cap.gained(2, 5, 0);
        cap.gained(1, 9, 0);
        cap.trim_front(2, holds);
        assert_eq!(cap.len(), 2, "the stale entry of block A left the front");
        assert_eq!(cap.victim(holds, |_| 0), Some(2));
        // Trimming stops at a live entry and at as many entries as held blocks.
        let mut cap = Capacity::new(1);
        cap.gained(2, 5, 0);
        cap.gained(1, 7, 0);
        cap.gained(1, 9, 0);
        cap.trim_front(2, holds);
        assert_eq!(cap.len(), 3, "a live entry at the front stops it");
        let mut cap = Capacity::new(1);
        for _ in 0..(2 * TRIM_PER_CALL) {
            cap.gained(1, 7, 0);
        }
        cap.gained(2, 5, 0);
        cap.trim_front(1, holds);
        assert_eq!(cap.len(), TRIM_PER_CALL + 1, "at most TRIM_PER_CALL a call");
        cap.trim_front(1, holds);
        assert_eq!(cap.len(), 1);
    }

    /// Counts per node of the held children in `tree`.
    fn truth(tree: &Tree) -> FxHashMap<u32, u32> {
        let mut kids = FxHashMap::default();
        for (c, &p) in tree.parent.iter().enumerate().skip(1) {
            if tree.held[c] {
                *kids.entry(p).or_insert(0) += 1;
            }
        }
        kids
    }

    /// A count ahead of the first eviction, run while blocks are gained, lost, gained again
    /// (so the order names them twice) and trimmed from the front, ends with the counts a
    /// count from scratch gives, and starts only at seven eighths of the capacity.
    #[test]
    fn counting_ahead_ends_with_the_counts_of_a_count_from_scratch() {
        // Chains of 4 under the root: node 4k+1 .. 4k+4.
        let n = 4_000usize;
        let mut tree = Tree::chains(n, 4);
        let mut cap = Capacity::new(4_000);
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut rand = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let mut held = 0u32;
        let mut started_at = None;
        let (mut lost_while_counting, mut steps) = (0u32, 0u32);
        let mut oldest = VecDeque::new();
        for round in 0..3_000u32 {
            // Gain the next free chain, leaf last.
            let k = rand(1_000) as usize;
            oldest.push_back(k);
            for c in 4 * k + 1..=4 * k + 4 {
                if !tree.held[c] {
                    tree.held[c] = true;
                    held += 1;
                    cap.gained(c as u32, 0, tree.parent[c]);
                }
            }
            // Lose a random chain from its leaf (some were never held).
            // Rarely until the count starts (so that it does), often while it runs, and
            // then the oldest gained, so that the front of the order goes stale and is
            // trimmed while the count reads it.
            let counting = cap.counts_ahead().is_some();
            if round % if counting { 2 } else { 16 } == 0 {
                let k = match counting {
                    true => oldest.pop_front().unwrap_or(0),
                    false => rand(1_000) as usize,
                };
                for c in (4 * k + 1..=4 * k + 4).rev() {
                    if tree.held[c] {
                        tree.held[c] = false;
                        held -= 1;
                        cap.lost(c as u32, tree.parent[c]);
                        lost_while_counting += u32::from(counting);
                    }
                }
            }
            let (h, p) = (&tree.held, &tree.parent);
            let holds = |e: Entry| h[node_of(e) as usize];
            cap.trim_front(held, holds);
            cap.count_ahead(held, holds, |c| p[c as usize]);
            if let Some((kids, counted)) = cap.counts_ahead() {
                started_at.get_or_insert(held);
                steps += 1;
                assert!(counted.iter().all(|&c| tree.held[c as usize]));
                let mut mine = FxHashMap::default();
                for &c in counted {
                    *mine.entry(tree.parent[c as usize]).or_insert(0) += 1;
                }
                assert_eq!(kids, &mine);
            }
            if let Some(kids) = cap.child_counts() {
                assert_eq!(kids, &truth(&tree), "round {round}");
            }
        }
        let started = started_at.expect("the count started");
        assert!(started >= 3_500, "started at {started} of 4,000");
        assert!(
            steps >= 5 && lost_while_counting >= 8,
            "{steps} steps, {lost_while_counting} lost meanwhile"
        );
        assert!(cap.child_counts().is_some(), "the count ended");
    }

    /// A worker that fills its capacity store by store has its counts before the first
    /// eviction, which then builds nothing.
    #[test]
    fn the_counts_are_ready_before_the_capacity_is_reached() {
        let n = 2_048usize;
        let mut tree = Tree::chains(n, 8);
        let mut cap = Capacity::new(n as u32);
        for chain in 0..n / 8 {
            for c in chain * 8 + 1..=chain * 8 + 8 {
                tree.held[c] = true;
                cap.gained(c as u32, 0, tree.parent[c]);
            }
            let (h, p) = (&tree.held, &tree.parent);
            cap.count_ahead(
                (chain as u32 + 1) * 8,
                |e| h[node_of(e) as usize],
                |c| p[c as usize],
            );
        }
        assert_eq!(cap.child_counts(), Some(&truth(&tree)));
        assert_eq!(tree.drain(&mut cap)[..3], [8, 7, 6]);
    }
}
