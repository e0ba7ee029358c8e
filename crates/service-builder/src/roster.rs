//! The schedulable workers of one partition as an immutable snapshot.
//!
//! A selection reads the snapshot once and walks every candidate rank, so the rank rows are
//! laid out flat at catalog commit (rare) instead of being derived from the worker records on
//! every selection (hot): each row carries what the candidate table needs, and a key map lets
//! the index's hits, which arrive in no particular order, land on their rows without a sort.

use std::collections::BTreeMap;
use std::ops::Deref;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kv_index::{KvIndex, SlotDepths, TierHits, TieredMatches};
use kv_types::BlockHash;
use kv_types::WorkerKey;
use load_accounting::{Ledger, RankSlot, SlotLayout};
use rustc_hash::FxHashMap;
use selection_policy::Capacity;

use crate::catalog::WorkerRequest;

/// A worker as the partition's scheduler sees it. Shared between successive rosters, so a
/// catalog change copies pointers rather than every worker record.
#[derive(Clone, Debug)]
pub(crate) struct WorkerEntry {
    pub(crate) record: Arc<WorkerRequest>,
}

/// One candidate rank.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RosterRow {
    pub(crate) key: WorkerKey,
    pub(crate) capacity: Capacity,
    /// Whether the worker has taints (only then are a request's taint rules evaluated).
    pub(crate) tainted: bool,
    /// Where the partition ledger keeps this rank, so the candidate loop reads its load
    /// without a key lookup (the ledger checks the hint and falls back if it went stale).
    pub(crate) ledger_slot: Option<RankSlot>,
}

/// Schedulable workers by id plus their rank rows in ascending `(worker, rank)` order.
#[derive(Debug, Default)]
pub(crate) struct Roster {
    /// Unique per roster built (0 for the empty default), so row caches know when they
    /// are stale.
    id: u64,
    by_id: BTreeMap<u64, WorkerEntry>,
    rows: Vec<RosterRow>,
    row_of: FxHashMap<WorkerKey, u32>,
    /// The ledger's slot layout when every row's slot was bound: while the ledger still
    /// reports it, the rows' slots hold their ranks and are read without a key check.
    ledger_layout: Option<SlotLayout>,
}

impl Roster {
    pub(crate) fn new(by_id: BTreeMap<u64, WorkerEntry>) -> Self {
        let mut rows = Vec::new();
        for w in by_id.values() {
            let r = &w.record;
            for rank in r.dp_ranks() {
                rows.push(RosterRow {
                    key: WorkerKey::new(r.worker_id, rank),
                    capacity: Capacity {
                        max_num_batched_tokens: r.max_num_batched_tokens,
                        total_kv_blocks: r.total_kv_blocks,
                    },
                    tainted: !r.taints.is_empty(),
                    ledger_slot: None,
                });
            }
        }
        let row_of = rows
            .iter()
            .enumerate()
            .map(|(i, row)| (row.key, i as u32))
            .collect();
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            by_id,
            rows,
            row_of,
            ledger_layout: None,
        }
    }

    pub(crate) fn rows(&self) -> &[RosterRow] {
        &self.rows
    }

    /// Records where `ledger` keeps each rank (call once its ranks are registered), and
    /// under which slot layout when every rank has a slot.
    pub(crate) fn bind_ledger(&mut self, ledger: &Ledger) {
        for row in &mut self.rows {
            row.ledger_slot = ledger.rank_slot(row.key);
        }
        self.ledger_layout = self
            .rows
            .iter()
            .all(|r| r.ledger_slot.is_some())
            .then(|| ledger.slot_layout());
    }

    /// Whether every row's ledger slot still holds its rank in `ledger` (no rank gained or
    /// lost a slot since [`Roster::bind_ledger`]).
    pub(crate) fn bound_to(&self, ledger: &Ledger) -> bool {
        self.ledger_layout == Some(ledger.slot_layout())
    }

    /// Whether `key` is a schedulable rank of this roster.
    pub(crate) fn has_row(&self, key: WorkerKey) -> bool {
        self.row_of.contains_key(&key)
    }
}

impl Deref for Roster {
    type Target = BTreeMap<u64, WorkerEntry>;

    fn deref(&self) -> &Self::Target {
        &self.by_id
    }
}

const NO_HIT: u32 = u32::MAX;
/// A cached answer "this worker has no row in the roster".
const NO_ROW: u32 = u32::MAX;

/// A cached answer "this roster row's worker has no slot in the index".
const NO_SLOT: u32 = u32::MAX;

/// The hits of one query placed on the rows of the roster it was matched against.
///
/// Two forms. When the index can answer with one device depth per worker slot (no lower
/// tier fed, no side index: the common case), rows read their depth through a cached
/// row → slot map, rebuilt only when the roster or the index's slot layout changes; no
/// per-worker entry is built, converted or placed. Otherwise the tiered hits are placed
/// on rows as before.
#[derive(Debug, Default)]
pub(crate) struct RowHits {
    tiered: TieredMatches,
    /// The per-slot answer, valid when `dense` is set.
    depths: SlotDepths,
    dense: bool,
    /// Dense form: per roster row, its index slot or `NO_SLOT`, for the roster and slot
    /// layout in `row_slot_for`.
    row_slot: Vec<u32>,
    row_slot_for: (u64, Option<u64>),
    /// Tiered form: per roster row, the index of its entry in `tiered.hits()` or `NO_HIT`.
    at_row: Vec<u32>,
    /// Tiered form: per index worker slot, the worker last seen there and its row in roster
    /// `cache_roster` (or `NO_ROW`). Placing a hit is then an array read and a key compare
    /// instead of a hash lookup; the key check catches slots the index reused.
    slot_rows: Vec<Option<(WorkerKey, u32)>>,
    cache_roster: u64,
    /// The roster of the last [`RowHits::place`].
    placed_roster: u64,
}

impl RowHits {
    /// Runs the lookup of `blocks` against `index`: in the per-slot form when `dense_ok`
    /// and the index allows it, else the tiered query. Call [`RowHits::place`] next.
    pub(crate) fn find(&mut self, index: &KvIndex, blocks: &[BlockHash], dense_ok: bool) {
        self.dense = dense_ok && index.find_device_depths(blocks, &mut self.depths);
        if !self.dense {
            index.find_tiered(blocks, &mut self.tiered);
        }
    }

    /// Buffer for a tiered lookup the caller reads itself (not through rows).
    pub(crate) fn tiered_mut(&mut self) -> &mut TieredMatches {
        self.dense = false;
        &mut self.tiered
    }

    /// The tiered hits of the last lookup; only meaningful when it was tiered (a lookup
    /// through [`RowHits::find`] with `dense_ok` off, or one into [`RowHits::tiered_mut`]).
    pub(crate) fn tiered(&self) -> &TieredMatches {
        &self.tiered
    }

    /// Assigns the last lookup's hits to the rows of `roster`; hits of workers outside the
    /// roster are ignored.
    pub(crate) fn place(&mut self, roster: &Roster) {
        self.placed_roster = roster.id;
        if self.dense {
            let key = (roster.id, self.depths.layout());
            if self.row_slot_for != key {
                self.row_slot.clear();
                self.row_slot.resize(roster.rows.len(), NO_SLOT);
                for (slot, k) in self.depths.keys().iter().enumerate() {
                    if let Some(k) = k
                        && let Some(&row) = roster.row_of.get(k)
                        && let Some(at) = self.row_slot.get_mut(row as usize)
                    {
                        *at = slot as u32;
                    }
                }
                self.row_slot_for = key;
            }
            return;
        }
        if self.cache_roster != roster.id {
            self.slot_rows.clear();
            self.cache_roster = roster.id;
        }
        self.at_row.clear();
        self.at_row.resize(roster.rows.len(), NO_HIT);
        let slots = self.tiered.hit_slots();
        for (i, h) in self.tiered.hits().iter().enumerate() {
            let row = match slots.get(i) {
                Some(&slot) => {
                    let slot = slot as usize;
                    match self.slot_rows.get(slot) {
                        Some(&Some((key, row))) if key == h.worker => row,
                        _ => {
                            let row = roster.row_of.get(&h.worker).copied().unwrap_or(NO_ROW);
                            if self.slot_rows.len() <= slot {
                                self.slot_rows.resize(slot + 1, None);
                            }
                            self.slot_rows[slot] = Some((h.worker, row));
                            row
                        }
                    }
                }
                None => roster.row_of.get(&h.worker).copied().unwrap_or(NO_ROW),
            };
            if let Some(at) = self.at_row.get_mut(row as usize) {
                *at = i as u32;
            }
        }
    }

    /// The most device blocks any row of the roster last placed holds (0 without hits).
    pub(crate) fn best_device(&self) -> u32 {
        if self.dense {
            // `NO_SLOT` reads as depth 0.
            return self
                .row_slot
                .iter()
                .map(|&slot| self.depths.depth(slot))
                .max()
                .unwrap_or(0);
        }
        let hits = self.tiered.hits();
        self.at_row
            .iter()
            .filter_map(|&i| hits.get(i as usize))
            .map(|h| h.device)
            .max()
            .unwrap_or(0)
    }

    /// Whether the last lookup took the per-slot form (device hits only).
    pub(crate) fn is_dense(&self) -> bool {
        self.dense
    }

    /// Device hits of row `row` in the per-slot form (the caller checked
    /// [`RowHits::is_dense`]): the depth at the row's slot, 0 for a row without one.
    #[inline(always)]
    pub(crate) fn dense_depth(&self, row: usize) -> u32 {
        // `NO_SLOT` is past the end of every depth table, so it reads as 0.
        self.row_slot
            .get(row)
            .map_or(0, |&slot| self.depths.depth(slot))
    }

    /// The hits of row `row` (whose worker key is `key`) of the roster last placed (zero
    /// when it matched nothing).
    #[inline]
    pub(crate) fn at(&self, row: usize, key: WorkerKey) -> TierHits {
        if self.dense {
            return match self.row_slot.get(row) {
                Some(&slot) if slot != NO_SLOT && self.depths.depth(slot) > 0 => TierHits {
                    worker: key,
                    device: self.depths.depth(slot),
                    ..TierHits::default()
                },
                // As in the tiered form: a row without hits reads as all zero.
                _ => TierHits::default(),
            };
        }
        match self.at_row.get(row) {
            Some(&i) if i != NO_HIT => self.tiered.hits()[i as usize],
            _ => TierHits::default(),
        }
    }

    /// The hits of `key`, looked up through `roster`. A roster other than the one placed
    /// against (the catalog changed in between) yields zero rather than another rank's hits.
    pub(crate) fn of(&self, roster: &Roster, key: WorkerKey) -> TierHits {
        let Some(&row) = roster.row_of.get(&key) else {
            return TierHits::default();
        };
        if self.placed_roster != roster.id {
            return TierHits::default();
        }
        let hit = self.at(row as usize, key);
        if hit.worker == key {
            hit
        } else {
            TierHits::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(id: u64, ranks: u32) -> (u64, WorkerEntry) {
        let mut record = WorkerRequest::new(id);
        record.data_parallel_size = Some(ranks);
        (
            id,
            WorkerEntry {
                record: Arc::new(record),
            },
        )
    }

    #[test]
    fn rows_follow_worker_then_rank_order() {
        let roster = Roster::new([worker(9, 1), worker(3, 2)].into_iter().collect());
        let keys: Vec<WorkerKey> = roster.rows().iter().map(|r| r.key).collect();
        assert_eq!(
            keys,
            vec![
                WorkerKey::new(3, 0),
                WorkerKey::new(3, 1),
                WorkerKey::new(9, 0)
            ]
        );
        assert_eq!(roster.len(), 2);
    }

    #[test]
    fn a_roster_stays_bound_until_a_rank_gains_or_loses_a_ledger_slot() {
        use load_accounting::{BookRequest, LedgerConfig, SlotPolicy};
        let mut roster = Roster::new([worker(3, 2), worker(9, 1)].into_iter().collect());
        let mut ledger = Ledger::new(LedgerConfig::default());
        // A rank without a slot leaves the roster unbound: its row has no slot to trust.
        ledger.register_rank(WorkerKey::new(3, 0));
        roster.bind_ledger(&ledger);
        assert!(!roster.bound_to(&ledger));
        for row in roster.rows() {
            ledger.register_rank(row.key);
        }
        roster.bind_ledger(&ledger);
        assert!(roster.bound_to(&ledger));
        // Bookings, frees and re-registering a known rank move no slot.
        let req = BookRequest::new(WorkerKey::new(9, 0), &[], 16);
        let now = std::time::Instant::now();
        assert!(
            ledger
                .book("r".into(), &req, SlotPolicy::RequireRegistered, now)
                .is_ok()
        );
        ledger.register_rank(WorkerKey::new(3, 1));
        assert!(ledger.free("r").is_ok());
        assert!(roster.bound_to(&ledger));
        // A rank outside the roster taking a slot, or one of its ranks losing its slot,
        // unbinds it until the next bind.
        ledger.register_rank(WorkerKey::new(5, 0));
        assert!(!roster.bound_to(&ledger));
        roster.bind_ledger(&ledger);
        assert!(roster.bound_to(&ledger));
        ledger.remove_rank(WorkerKey::new(3, 1));
        assert!(!roster.bound_to(&ledger));
    }

    fn store(index: &mut kv_index::KvIndex, worker: WorkerKey, blocks: &[u64]) {
        use kv_types::{BlockHash, ExternalHash, KvOperation, KvOperationKind, StorageTier};
        let op = KvOperation {
            worker,
            tier: StorageTier::Device,
            event_id: 0,
            kind: KvOperationKind::Stored {
                parent_hash: None,
                blocks: blocks
                    .iter()
                    .map(|&b| kv_types::StoredBlock::new(ExternalHash(b + 100), BlockHash(b)))
                    .collect(),
            },
        };
        index.apply(&op);
    }

    /// Row `row`'s hits, its key read from `roster` (a key no row has past the end).
    fn at(hits: &RowHits, roster: &Roster, row: usize) -> TierHits {
        let key = roster
            .rows()
            .get(row)
            .map_or(WorkerKey::new(u64::MAX, 0), |r| r.key);
        hits.at(row, key)
    }

    #[test]
    fn cached_slot_rows_follow_roster_changes_and_slot_reuse() {
        use kv_types::{BlockHash, WorkerId};
        // Both forms of the lookup: per-slot depths through the cached row → slot map, and
        // tiered hits placed through the cached slot → row map.
        for dense in [true, false] {
            let mut index = kv_index::KvIndex::with_block_size(4);
            let (a, b, c) = (
                WorkerKey::new(1, 0),
                WorkerKey::new(2, 0),
                WorkerKey::new(3, 0),
            );
            store(&mut index, a, &[10, 11]);
            store(&mut index, b, &[10]);
            let query = [BlockHash(10), BlockHash(11)];
            let mut hits = RowHits::default();
            let place = |hits: &mut RowHits, index: &kv_index::KvIndex, roster: &Roster| {
                hits.find(index, &query, dense);
                assert_eq!(hits.dense, dense);
                hits.place(roster);
            };
            let slot_of = |hits: &RowHits, key: WorkerKey| {
                if dense {
                    let keys = hits.depths.keys();
                    keys.iter().position(|k| *k == Some(key)).map(|s| s as u32)
                } else {
                    let i = hits.tiered().hits().iter().position(|h| h.worker == key);
                    i.and_then(|i| hits.tiered().hit_slots().get(i).copied())
                }
            };

            let roster = Roster::new([worker(1, 1), worker(2, 1)].into_iter().collect());
            for _ in 0..2 {
                // The second round reads the cached map.
                place(&mut hits, &index, &roster);
                assert_eq!(at(&hits, &roster, 0).device, 2);
                assert_eq!(at(&hits, &roster, 1).device, 1);
                assert_eq!(hits.of(&roster, a).device, 2);
            }
            // A new roster without worker 1: worker 2 moves to row 0.
            let roster = Roster::new([worker(2, 1), worker(3, 1)].into_iter().collect());
            place(&mut hits, &index, &roster);
            assert_eq!(at(&hits, &roster, 0).worker, b);
            assert_eq!(at(&hits, &roster, 0).device, 1);
            assert_eq!(at(&hits, &roster, 1).device, 0);
            assert_eq!(hits.of(&roster, a), TierHits::default());
            // Worker 1 leaves the index and worker 3 takes its slot: same roster, new key.
            let slot_a = slot_of(&hits, a);
            index.remove_worker(WorkerId(1));
            store(&mut index, c, &[10, 11]);
            place(&mut hits, &index, &roster);
            assert_eq!(
                slot_of(&hits, c),
                slot_a,
                "the index reuses the vacant slot"
            );
            assert_eq!(at(&hits, &roster, 0).device, 1);
            assert_eq!(at(&hits, &roster, 1).worker, c);
            assert_eq!(at(&hits, &roster, 1).device, 2);
            assert_eq!(hits.of(&roster, c).device, 2);
            // A roster the hits were not placed on answers nothing.
            let other = Roster::new([worker(3, 1)].into_iter().collect());
            assert_eq!(hits.of(&other, c), TierHits::default());
        }
    }

    #[test]
    fn unplaced_and_foreign_keys_have_no_hits() {
        let roster = Roster::new([worker(1, 1)].into_iter().collect());
        let mut hits = RowHits::default();
        hits.place(&roster);
        assert_eq!(at(&hits, &roster, 0).device, 0);
        assert_eq!(at(&hits, &roster, 7), TierHits::default());
        assert_eq!(hits.of(&roster, WorkerKey::new(2, 0)), TierHits::default());
    }

    /// An operation of the dense-versus-tiered comparison: store a chain for a worker key,
    /// remove a worker, or rebuild the roster from a subset of workers.
    #[derive(Clone, Debug)]
    enum Step {
        Store(u8, u8, Vec<u8>),
        Remove(u8),
        Roster(Vec<(u8, u8)>),
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            4 => (0u8..6, 0u8..2, prop::collection::vec(0u8..4, 1..6))
                .prop_map(|(w, r, b)| Step::Store(w, r, b)),
            1 => (0u8..6).prop_map(Step::Remove),
            1 => prop::collection::vec((0u8..6, 1u8..3), 0..6).prop_map(Step::Roster),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]

        /// The per-slot lookup and the tiered one put the same hits on every row, through
        /// roster rebuilds, removals and slot reuse, with one `RowHits` each reused
        /// throughout (so their cached maps are exercised, not rebuilt every time).
        #[test]
        fn dense_and_tiered_rows_agree(
            steps in proptest::collection::vec(step(), 1..40),
            queries in proptest::collection::vec(proptest::collection::vec(0u8..4, 1..6), 1..4),
        ) {
            use kv_types::{BlockHash, WorkerId};
            let mut index = kv_index::KvIndex::with_block_size(4);
            let mut roster = Roster::new([worker(0, 2), worker(1, 1)].into_iter().collect());
            let (mut dense, mut tiered) = (RowHits::default(), RowHits::default());
            for step in &steps {
                match step {
                    Step::Store(w, r, blocks) => {
                        // Chains over a small alphabet share prefixes and branch.
                        let blocks: Vec<u64> = blocks.iter().map(|&b| u64::from(b)).collect();
                        store(&mut index, WorkerKey::new(u64::from(*w), u32::from(*r)), &blocks);
                    }
                    Step::Remove(w) => index.remove_worker(WorkerId(u64::from(*w))),
                    Step::Roster(members) => {
                        roster = Roster::new(
                            members
                                .iter()
                                .map(|&(w, ranks)| worker(u64::from(w), u32::from(ranks)))
                                .collect(),
                        );
                    }
                }
                for q in &queries {
                    let query: Vec<BlockHash> = q.iter().map(|&b| BlockHash(u64::from(b))).collect();
                    dense.find(&index, &query, true);
                    tiered.find(&index, &query, false);
                    proptest::prop_assert!(dense.dense && !tiered.dense);
                    dense.place(&roster);
                    tiered.place(&roster);
                    for (row, r) in roster.rows().iter().enumerate() {
                        proptest::prop_assert_eq!(
                            dense.at(row, r.key),
                            tiered.at(row, r.key),
                            "row {} ({:?}) after {:?}", row, r.key, step
                        );
                        proptest::prop_assert_eq!(dense.of(&roster, r.key), tiered.of(&roster, r.key));
                    }
                }
            }
        }
    }
}
