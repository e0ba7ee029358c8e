//! What the tests of every file of the trie share (building stores and queries, checking
//! the derived state the fast paths rely on), and the test of the whole trie under random
//! operations.

use kv_types::{BlockHash, ExternalHash, StoredBlock, WorkerKey};
use rustc_hash::FxHashMap;

use super::node::{FC_SAME, NONE};
use super::{OverlapScores, PrefixIndex};
use crate::capacity::Capacity;

pub(super) fn blocks(pairs: &[(u64, u64)]) -> Vec<StoredBlock> {
    pairs
        .iter()
        .map(|&(l, e)| StoredBlock::new(ExternalHash(e), BlockHash(l)))
        .collect()
}

pub(super) fn q(locals: &[u64]) -> Vec<BlockHash> {
    locals.iter().map(|&l| BlockHash(l)).collect()
}

/// `n` keys from `start` whose [`hash_bits`] are all equal: steps of the inverse of the
/// factor add one to the product, which leaves its high half alone while the low half
/// does not carry.
///
/// [`hash_bits`]: crate::sharded::hash_bits
pub(super) fn colliding(start: u64, n: u64) -> Vec<u64> {
    use crate::sharded::BITS_FACTOR;
    let mut inverse = BITS_FACTOR;
    for _ in 0..6 {
        inverse = inverse.wrapping_mul(2u64.wrapping_sub(BITS_FACTOR.wrapping_mul(inverse)));
    }
    assert_eq!(BITS_FACTOR.wrapping_mul(inverse), 1);
    let base = start.wrapping_mul(BITS_FACTOR) & !0xFFFF_FFFF;
    let first = base.wrapping_mul(inverse);
    (0..n)
        .map(|i| first.wrapping_add(i.wrapping_mul(inverse)))
        .collect()
}

impl PrefixIndex {
    /// Checks the derived state the fast paths rely on.
    pub(super) fn check_invariants(&self) {
        for (id, n) in self.nodes.iter().enumerate() {
            if n.kids & FC_SAME != 0 {
                assert_ne!(n.first_child, NONE, "node {id}");
                let fc = &self.nodes[n.first_child as usize];
                assert_eq!(n.owners.as_slice(), fc.owners.as_slice(), "node {id}");
            }
        }
        for state in self.workers.iter().flatten() {
            for id in state.blocks.iter().map(|e| e.node) {
                let ext = ExternalHash(self.nodes[id as usize].external);
                assert!(!state.foreign.contains_key(&ext));
                assert_eq!(state.get(&self.nodes, ext), Some(id));
            }
            for (&ext, &id) in state.foreign.iter() {
                assert_ne!(self.nodes[id as usize].external, ext.0);
                assert_eq!(state.get(&self.nodes, ext), Some(id));
            }
            for (&id, &ext) in state.own_at.iter() {
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
            if let Some((kids, counted)) = state.cap.as_ref().and_then(Capacity::counts_ahead) {
                // A count ahead counts held nodes only, each under its parent.
                let mut mine: FxHashMap<u32, u32> = FxHashMap::default();
                for &c in counted {
                    let n = &self.nodes[c as usize];
                    assert!(n.parent != NONE && n.owners.contains(slot), "{c} counted");
                    *mine.entry(n.parent).or_insert(0) += 1;
                }
                assert_eq!(kids, &mine, "counts ahead of {:?}", state.key);
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
                let pairs: Vec<(u64, u64)> = (0..len).map(|_| (next(3), 100 + next(12))).collect();
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

/// Enough chains that the worker maps and the child map split into many shards, with
/// foreign hashes on a second worker, then half of the leaves removed: every map stays
/// exact.
#[test]
fn maps_split_into_shards_stay_exact() {
    let mut idx = PrefixIndex::new();
    let (a, b) = (WorkerKey::new(1, 0), WorkerKey::new(2, 0));
    let chains = 4_000u64;
    for c in 0..chains {
        // Two blocks per chain, every chain a child of the root: 4,000 branches.
        let chain = [
            (c * 2 + 1, 1_000_000 + c * 2),
            (c * 2 + 2, 1_000_001 + c * 2),
        ];
        idx.apply_stored(a, None, &blocks(&chain));
        // `b` hashes the same tokens differently: every entry is foreign.
        let other = chain.map(|(l, e)| (l, e + 10_000_000));
        idx.apply_stored(b, None, &blocks(&other));
    }
    idx.check_invariants();
    assert_eq!(idx.stats().nodes, 2 * chains as usize);
    assert_eq!(idx.estimated_bytes(), idx.allocated_bytes());
    let leaves = |offset: u64| -> Vec<ExternalHash> {
        (0..chains)
            .step_by(2)
            .map(|c| ExternalHash(1_000_001 + c * 2 + offset))
            .collect()
    };
    assert_eq!(idx.apply_removed(a, &leaves(0)).removed, 2_000);
    assert_eq!(idx.apply_removed(b, &leaves(10_000_000)).removed, 2_000);
    idx.check_invariants();
    assert_eq!(idx.stats().nodes, chains as usize * 3 / 2);
    let mut out = OverlapScores::new();
    for c in [0, 1, 1_337, 3_999] {
        idx.find_matches(&q(&[c * 2 + 1, c * 2 + 2]), &mut out);
        let whole = if c % 2 == 0 { 1 } else { 2 };
        assert_eq!((out.score(a), out.score(b)), (whole, whole), "chain {c}");
    }
    assert_eq!(idx.estimated_bytes(), idx.allocated_bytes());
    assert!(idx.remove_worker_key(a) && idx.remove_worker_key(b));
    assert_eq!(idx.stats(), super::PrefixIndexStats::default());
}
