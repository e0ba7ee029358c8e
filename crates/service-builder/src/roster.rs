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

use kv_index::{TierHits, TieredMatches};
use kv_types::WorkerKey;
use load_accounting::{Ledger, RankSlot};
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
        }
    }

    pub(crate) fn rows(&self) -> &[RosterRow] {
        &self.rows
    }

    /// Records where `ledger` keeps each rank (call once its ranks are registered).
    pub(crate) fn bind_ledger(&mut self, ledger: &Ledger) {
        for row in &mut self.rows {
            row.ledger_slot = ledger.rank_slot(row.key);
        }
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

/// The tiered hits of one query placed on the rows of the roster it was matched against.
#[derive(Debug, Default)]
pub(crate) struct RowHits {
    tiered: TieredMatches,
    /// Per roster row, the index of its entry in `tiered.hits()` or `NO_HIT`.
    at_row: Vec<u32>,
    /// Per index worker slot, the worker last seen there and its row in roster
    /// `cache_roster` (or `NO_ROW`). Placing a hit is then an array read and a key compare
    /// instead of a hash lookup; the key check catches slots the index reused.
    slot_rows: Vec<Option<(WorkerKey, u32)>>,
    cache_roster: u64,
}

impl RowHits {
    /// Buffer for the index lookup; call [`RowHits::place`] after filling it.
    pub(crate) fn tiered_mut(&mut self) -> &mut TieredMatches {
        &mut self.tiered
    }

    pub(crate) fn tiered(&self) -> &TieredMatches {
        &self.tiered
    }

    /// Assigns each hit to its row; hits of workers outside the roster are ignored.
    pub(crate) fn place(&mut self, roster: &Roster) {
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

    /// The hits of row `row` of the roster last placed (zero when it matched nothing).
    pub(crate) fn at(&self, row: usize) -> TierHits {
        match self.at_row.get(row) {
            Some(&i) if i != NO_HIT => self.tiered.hits()[i as usize],
            _ => TierHits::default(),
        }
    }

    /// The hits of `key`, looked up through `roster`. A roster other than the one placed
    /// against (the catalog changed in between) yields zero rather than another rank's hits.
    pub(crate) fn of(&self, roster: &Roster, key: WorkerKey) -> TierHits {
        let hit = roster
            .row_of
            .get(&key)
            .map_or_else(TierHits::default, |&row| self.at(row as usize));
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

    #[test]
    fn cached_slot_rows_follow_roster_changes_and_slot_reuse() {
        use kv_types::{BlockHash, WorkerId};
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
            index.find_tiered(&query, hits.tiered_mut());
            assert!(!hits.tiered().hit_slots().is_empty());
            hits.place(roster);
        };

        let roster = Roster::new([worker(1, 1), worker(2, 1)].into_iter().collect());
        for _ in 0..2 {
            // The second round reads the cached slots.
            place(&mut hits, &index, &roster);
            assert_eq!(hits.at(0).device, 2);
            assert_eq!(hits.at(1).device, 1);
        }
        // A new roster without worker 1: worker 2 moves to row 0.
        let roster = Roster::new([worker(2, 1), worker(3, 1)].into_iter().collect());
        place(&mut hits, &index, &roster);
        assert_eq!(hits.at(0).worker, b);
        assert_eq!(hits.at(0).device, 1);
        assert_eq!(hits.at(1), TierHits::default());
        // Worker 1 leaves the index and worker 3 takes its slot: same roster, new key.
        let slot_of = |hits: &RowHits, key: WorkerKey| {
            let i = hits.tiered().hits().iter().position(|h| h.worker == key);
            i.and_then(|i| hits.tiered().hit_slots().get(i).copied())
        };
        let slot_a = slot_of(&hits, a);
        index.remove_worker(WorkerId(1));
        store(&mut index, c, &[10, 11]);
        place(&mut hits, &index, &roster);
        assert_eq!(
            slot_of(&hits, c),
            slot_a,
            "the index reuses the vacant slot"
        );
        assert_eq!(hits.at(0).device, 1);
        assert_eq!(hits.at(1).worker, c);
        assert_eq!(hits.at(1).device, 2);
    }

    #[test]
    fn unplaced_and_foreign_keys_have_no_hits() {
        let roster = Roster::new([worker(1, 1)].into_iter().collect());
        let mut hits = RowHits::default();
        hits.place(&roster);
        assert_eq!(hits.at(0), TierHits::default());
        assert_eq!(hits.at(7), TierHits::default());
        assert_eq!(hits.of(&roster, WorkerKey::new(2, 0)), TierHits::default());
    }
}
