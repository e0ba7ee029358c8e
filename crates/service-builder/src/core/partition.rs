//! A partition (one model and routing group): its index, ledger, policy, roster, queue
//! and session table, and the scratch buffers its selections reuse.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use kv_index::{IndexCell, IndexConfig, KvIndex};
use kv_types::{BlockHash, SequenceHash};
use load_accounting::Ledger;
use parking_lot::{Mutex, RwLock};
use selection_policy::{Candidate, PickRng, Policy, RouterConfig, Scratch};

use crate::admission::PartitionQueue;
use crate::catalog::PartitionKey;
use crate::roster::{Roster, RowHits};
use crate::routing_stats::RoutingStats;
use crate::session::SessionTable;

/// Scratch buffers of one selection, pooled so the hot path does not allocate.
#[derive(Debug, Default)]
pub(super) struct SelectScratch {
    pub(super) blocks: Vec<BlockHash>,
    pub(super) tracking: Vec<SequenceHash>,
    /// `tracking` is the public sequence chain of `blocks` (computed here, not given).
    pub(super) tracking_is_chain: bool,
    /// The tiered lookup and, per roster row, its hits.
    pub(super) hits: RowHits,
    pub(super) candidates: Vec<Candidate>,
    pub(super) policy: Scratch,
}

pub(crate) struct Partition {
    pub(crate) key: PartitionKey,
    pub(crate) block_size: u32,
    pub(crate) is_eagle: bool,
    /// One copy behind a lock whose lookups wait for a listener's write section, or two
    /// copies whose lookups never wait (`CoreConfig::kv_index_copies`).
    pub(crate) index: IndexCell,
    /// The index records routing decisions (approximate mode or a predicted-TTL side
    /// index): fixed when the index is built, so bookings without it take no index lock.
    pub(super) records_decisions: bool,
    pub(super) ledger: Mutex<Ledger>,
    pub(super) policy: Policy,
    /// Schedulable workers by id, replaced wholesale on every catalog commit.
    pub(super) workers: RwLock<Arc<Roster>>,
    pub(super) scratch: Mutex<Vec<SelectScratch>>,
    pub(super) rng: Mutex<PickRng>,
    pub(super) sessions: Option<SessionTable>,
    /// When the booking path may next run the ledger's expiry scan.
    pub(super) next_expiry_check: Mutex<Instant>,
    /// The admission queue, when a busy threshold enables queueing.
    pub(crate) queue: Option<PartitionQueue>,
    /// Created by startup recovery and not yet joined by a worker: the first worker (or
    /// `ensure_partition`) sets the block size and Eagle flag, keeping the recovered index
    /// (replica-sync §9.2).
    pub(super) adoptable: AtomicBool,
    /// Routing-loss counters of the bookings selections made here.
    pub(crate) routing: RoutingStats,
    /// Some worker rank here declared `total_kv_blocks`: only then does applying events
    /// look for capacity evictions to warn about.
    pub(super) capacity_declared: AtomicBool,
    /// The index's capacity evictions already reported, and how many reports were due.
    pub(super) capacity_log: Mutex<CapacityLog>,
}

/// Rate limit of the capacity-eviction warning: the first three batches that evict, then
/// only the ones whose count is a power of two, so a worker whose removals are lost for
/// hours cannot flood the log (the counter in `/metrics` has the full story).
#[derive(Debug, Default)]
pub(super) struct CapacityLog {
    pub(super) reported: u64,
    pub(super) occurrences: u64,
}

impl CapacityLog {
    /// Records that the index's evictions reached `total`; the blocks evicted since the last
    /// call when they are due a warning.
    pub(super) fn due(&mut self, total: u64) -> Option<u64> {
        if total <= self.reported {
            return None;
        }
        let new = total - self.reported;
        self.reported = total;
        self.occurrences += 1;
        (self.occurrences <= 3 || self.occurrences.is_power_of_two()).then_some(new)
    }
}

impl SelectScratch {
    /// The sequence chain of `blocks`, when `tracking` is it.
    pub(super) fn chain(&self) -> Option<&[SequenceHash]> {
        self.tracking_is_chain.then_some(&self.tracking[..])
    }
}

impl Partition {
    /// Whether `worker_id` is schedulable here (and, when given, serves global `rank`).
    pub(crate) fn schedules(&self, worker_id: u64, rank: Option<u32>) -> bool {
        self.workers
            .read()
            .get(&worker_id)
            .is_some_and(|w| rank.is_none_or(|r| w.record.has_rank(r)))
    }

    pub(crate) fn ledger(&self) -> &Mutex<Ledger> {
        &self.ledger
    }

    pub(crate) fn sessions(&self) -> Option<&SessionTable> {
        self.sessions.as_ref()
    }
}

impl std::fmt::Debug for Partition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Partition")
            .field("key", &self.key)
            .field("block_size", &self.block_size)
            .finish()
    }
}

pub(super) fn index_config(router: &RouterConfig) -> IndexConfig {
    IndexConfig {
        block_size: 16,
        use_kv_events: router.use_kv_events,
        router_ttl: Duration::from_secs_f64(router.router_ttl_secs.max(0.0)),
        approximate_cache_policy: match router.router_approximate_cache_policy {
            selection_policy::ApproximateCachePolicy::Lru => kv_index::ApproxCachePolicy::Lru,
            _ => kv_index::ApproxCachePolicy::Ttl,
        },
        predicted_ttl: router
            .router_predicted_ttl_secs
            .map(|s| Duration::from_secs_f64(s.max(0.0))),
    }
}

/// Whether bookings are recorded into the index (approximate primary or side index).
pub(super) fn records_decisions(index: &KvIndex) -> bool {
    index.is_approximate() || index.has_side_index()
}
