//! The schedulable workers of one partition as an immutable snapshot.
//!
//! A selection reads the snapshot once and walks every candidate rank, so the rank rows are
//! laid out flat at catalog commit (rare) instead of being derived from the worker records on
//! every selection (hot): each row carries what the candidate table needs, and a key map lets
//! the index's hits, which arrive in no particular order, land on their rows without a sort.

use std::collections::BTreeMap;
use std::ops::Deref;
use std::sync::Arc;

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
        Self {
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

/// The tiered hits of one query placed on the rows of the roster it was matched against.
#[derive(Debug, Default)]
pub(crate) struct RowHits {
    tiered: TieredMatches,
    /// Per roster row, the index of its entry in `tiered.hits()` or `NO_HIT`.
    at_row: Vec<u32>,
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
        self.at_row.clear();
        self.at_row.resize(roster.rows.len(), NO_HIT);
        for (i, h) in self.tiered.hits().iter().enumerate() {
            if let Some(&row) = roster.row_of.get(&h.worker) {
                self.at_row[row as usize] = i as u32;
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
