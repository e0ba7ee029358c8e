//! One partition's whole index: primary, lower tiers, approximate retention, side index,
//! counters (`spec/indexing.md` §1, §4–§8).

use std::time::{Duration, Instant};

use kv_types::{
    BlockHash, ExternalHash, KvOperation, KvOperationKind, SequenceHash, StorageTier, StoredBlock,
    WorkerId, WorkerKey,
};
use rustc_hash::FxHashMap;

use crate::lower::LowerTierIndex;
use crate::primary::{OverlapScores, PrefixIndex, PrefixIndexStats, SlotDepths, StoreOutcome};
use crate::tiers::{TierHits, TieredMatches};
use crate::ttl::TtlTracker;

/// Retention policy of approximate mode (`router_approximate_cache_policy`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum ApproxCachePolicy {
    #[default]
    Ttl,
    /// Not supported by the service: a warning (approximate mode) or an error (KV events).
    Lru,
}

/// How a partition's index is fed. `Default` equals the spec's defaults.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct IndexConfig {
    /// Tokens per block of this partition (dumped with the snapshot).
    pub block_size: u32,
    /// `true`: engine KV events feed the primary. `false`: approximate mode (§5).
    pub use_kv_events: bool,
    /// `router_ttl_secs`, approximate-mode retention (default 120 s).
    pub router_ttl: Duration,
    pub approximate_cache_policy: ApproxCachePolicy,
    /// `router_predicted_ttl_secs`: enables the side index (§6).
    pub predicted_ttl: Option<Duration>,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            block_size: 16,
            use_kv_events: true,
            router_ttl: Duration::from_secs(120),
            approximate_cache_policy: ApproxCachePolicy::Ttl,
            predicted_ttl: None,
        }
    }
}

/// A configuration the service must refuse at startup.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IndexConfigError {
    #[error(
        "router_approximate_cache_policy=lru requires use_kv_events=false; the local side indexer is TTL-only"
    )]
    LruWithKvEvents,
    #[error(
        "router_predicted_ttl_secs requires use_kv_events=true; do not combine a primary approximate indexer with a side approximate indexer"
    )]
    PredictedTtlWithoutKvEvents,
    #[error("block_size must be at least 1")]
    ZeroBlockSize,
}

/// A configuration that works but not as written.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum IndexConfigWarning {
    /// `lru` in approximate mode: TTL retention is used instead.
    LruFallsBackToTtl,
}

impl IndexConfig {
    /// Checks the combinations of §5.3 and §6. Warnings are for the caller to log.
    pub fn validate(&self) -> Result<Vec<IndexConfigWarning>, IndexConfigError> {
        if self.block_size == 0 {
            return Err(IndexConfigError::ZeroBlockSize);
        }
        if self.use_kv_events && self.approximate_cache_policy == ApproxCachePolicy::Lru {
            return Err(IndexConfigError::LruWithKvEvents);
        }
        if !self.use_kv_events && self.predicted_ttl.is_some() {
            return Err(IndexConfigError::PredictedTtlWithoutKvEvents);
        }
        let mut warnings = Vec::new();
        if !self.use_kv_events && self.approximate_cache_policy == ApproxCachePolicy::Lru {
            warnings.push(IndexConfigWarning::LruFallsBackToTtl);
        }
        Ok(warnings)
    }
}

/// The outcome of one applied operation (§8 statuses).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum ApplyOutcome {
    Ok,
    /// Accepted, but it changed nothing (`duplicate_store` warning).
    DuplicateStore,
    /// Store rejected whole: parent unknown or no longer owned.
    ParentBlockNotFound,
    /// Remove applied; `missing` hashes were unknown and skipped.
    BlockNotFound {
        missing: u32,
    },
}

/// Event-application counters (§8). Monotonic; read with [`KvIndex::counters`].
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct ApplyCounters {
    pub stored_ok: u64,
    pub stored_parent_block_not_found: u64,
    pub removed_ok: u64,
    /// Remove events with at least one unknown hash.
    pub removed_block_not_found: u64,
    pub cleared_ok: u64,
    /// `duplicate_store` warnings (also counted in `stored_ok`).
    pub duplicate_store: u64,
    /// Unknown hashes skipped by removes (block granularity).
    pub blocks_not_found: u64,
    /// Operations applied to lower tiers (stored and removed; a cleared counts once above).
    pub lower_tier_ops: u64,
    /// Entries removed by approximate-mode expiry (primary and side index).
    pub approx_expired: u64,
    /// Device blocks evicted because their worker key exceeded its declared capacity
    /// ([`KvIndex::set_capacity`]), all keys together.
    pub capacity_evicted: u64,
}

impl ApplyCounters {
    /// `(event_type, status, count)` rows of `kv_cache_events_applied`.
    pub fn applied_rows(&self) -> [(&'static str, &'static str, u64); 5] {
        [
            ("stored", "ok", self.stored_ok),
            (
                "stored",
                "parent_block_not_found",
                self.stored_parent_block_not_found,
            ),
            ("removed", "ok", self.removed_ok),
            ("removed", "block_not_found", self.removed_block_not_found),
            ("cleared", "ok", self.cleared_ok),
        ]
    }
}

/// Result of recording a routing decision.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum RecordOutcome {
    /// Stored and timers (re)armed in the approximate primary and/or the side index.
    Recorded,
    /// Empty prompt, or neither approximate mode nor a side index is configured.
    NotRecorded,
}

/// An approximate index: a prefix index fed by routing decisions plus its timers.
#[derive(Debug)]
struct Approx {
    timers: TtlTracker,
    /// Per worker key, the chain its last decision recorded.
    chains: FxHashMap<WorkerKey, RecordedChain>,
}

/// The chain of a worker's last recorded decision. A decision whose chain extends it (a
/// repeat of the prompt, or the next turn of a conversation) need not walk and verify the
/// blocks the worker provably still holds.
#[derive(Debug, Clone, Copy)]
struct RecordedChain {
    /// Its length in blocks.
    len: usize,
    /// The sequence hash of its last block, which determines every block before it.
    last: SequenceHash,
    /// The worker's state version right after recording it: while the version is the same,
    /// the worker still holds every block of the chain.
    version: u64,
    /// The deadline its timers were armed for.
    deadline: u64,
}

impl Approx {
    fn new(timers: TtlTracker) -> Self {
        Approx {
            timers,
            chains: FxHashMap::default(),
        }
    }

    /// Stores `blocks` (whose sequence hashes are `seqs`) for `worker` in `index` and
    /// (re)arms their timers; `false` when nothing was recorded.
    ///
    /// When the chain extends the worker's last recorded one and the worker's state is
    /// unchanged since, the known prefix is skipped: storing starts below its last block
    /// (what a walk from the root would reach, changing nothing on the way), and its timers
    /// are re-armed only if the deadline moved to another bucket.
    fn record(
        &mut self,
        index: &mut PrefixIndex,
        worker: WorkerKey,
        blocks: &[StoredBlock],
        seqs: &[SequenceHash],
        now: Instant,
    ) -> bool {
        let deadline = self.timers.deadline(now);
        let known = self.chains.get(&worker).copied().filter(|c| {
            c.len > 0
                && seqs.get(c.len - 1) == Some(&c.last)
                && index.worker_version(worker) == Some(c.version)
        });
        let held = known.map_or(0, |c| c.len);
        let outcome = match held {
            0 => index.apply_stored(worker, None, blocks),
            n if n >= blocks.len() => StoreOutcome::Duplicate,
            n => {
                match index.apply_stored(worker, Some(ExternalHash(seqs[n - 1].0)), &blocks[n..]) {
                    // Unreachable while the version check holds; the walk from the root is
                    // always right.
                    StoreOutcome::ParentNotFound => index.apply_stored(worker, None, blocks),
                    other => other,
                }
            }
        };
        if outcome == StoreOutcome::ParentNotFound {
            self.chains.remove(&worker);
            return false;
        }
        let armed = match known {
            Some(c) if c.deadline == deadline => held,
            _ => 0,
        };
        self.timers.arm_from(worker, seqs, armed, now);
        match (index.worker_version(worker), seqs.last()) {
            (Some(version), Some(&last)) => {
                self.chains.insert(
                    worker,
                    RecordedChain {
                        len: seqs.len(),
                        last,
                        version,
                        deadline,
                    },
                );
            }
            _ => {
                self.chains.remove(&worker);
            }
        }
        true
    }

    fn forget_worker_key(&mut self, worker: WorkerKey) {
        self.timers.remove_worker_key(worker);
        self.chains.remove(&worker);
    }

    fn forget_worker_id(&mut self, worker_id: WorkerId) {
        self.timers.remove_worker_id(worker_id);
        self.chains.retain(|w, _| w.worker_id != worker_id);
    }
}

/// The index of one partition `(model_name, routing_group)`.
///
/// Single-writer, `Sync` for readers: share it through [`crate::SharedKvIndex`].
#[derive(Debug)]
pub struct KvIndex {
    block_size: u32,
    primary: PrefixIndex,
    /// Approximate mode: timers of the primary.
    primary_ttl: Option<Approx>,
    /// host_pinned, disk, external; created on first use.
    lower: [Option<LowerTierIndex>; 3],
    /// Predict-on-route side index and its timers.
    side: Option<(PrefixIndex, Approx)>,
    counters: ApplyCounters,
    seq_scratch: Vec<SequenceHash>,
    block_scratch: Vec<StoredBlock>,
    /// Unique among the indexes of the process: a mirror's writer tells by it that a write
    /// replaced the index.
    serial: u64,
}

fn lower_slot(tier: StorageTier) -> Option<usize> {
    match tier {
        StorageTier::Device => None,
        StorageTier::HostPinned => Some(0),
        StorageTier::Disk => Some(1),
        StorageTier::External => Some(2),
    }
}

impl KvIndex {
    /// A new empty index. `origin` is the instant TTL grids are measured from. Call
    /// [`IndexConfig::validate`] first; an invalid combination is built as documented
    /// (side index only with KV events, TTL in place of LRU).
    pub fn new(config: &IndexConfig, origin: Instant) -> Self {
        let primary_ttl = (!config.use_kv_events)
            .then(|| Approx::new(TtlTracker::new(config.router_ttl, origin)));
        let side = config
            .predicted_ttl
            .filter(|_| config.use_kv_events)
            .map(|ttl| {
                (
                    PrefixIndex::new(),
                    Approx::new(TtlTracker::new(ttl, origin)),
                )
            });
        KvIndex {
            block_size: config.block_size,
            primary: PrefixIndex::new(),
            primary_ttl,
            lower: [None, None, None],
            side,
            counters: ApplyCounters::default(),
            seq_scratch: Vec::new(),
            block_scratch: Vec::new(),
            serial: {
                static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            },
        }
    }

    /// An event-fed index with no side index (what a restore creates).
    pub fn with_block_size(block_size: u32) -> Self {
        let config = IndexConfig {
            block_size,
            ..IndexConfig::default()
        };
        Self::new(&config, Instant::now())
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    pub fn counters(&self) -> ApplyCounters {
        ApplyCounters {
            capacity_evicted: self.primary.capacity_evicted_total(),
            ..self.counters
        }
    }

    /// Estimated bytes of the whole partition index (primary, lower tiers, side index), in
    /// O(worker keys): see [`PrefixIndex::estimated_bytes`].
    pub fn estimated_bytes(&self) -> usize {
        self.primary.estimated_bytes()
            + self
                .lower
                .iter()
                .flatten()
                .map(LowerTierIndex::estimated_bytes)
                .sum::<usize>()
            + self.side.as_ref().map_or(0, |(s, _)| s.estimated_bytes())
    }

    pub fn primary(&self) -> &PrefixIndex {
        &self.primary
    }

    pub fn primary_stats(&self) -> PrefixIndexStats {
        self.primary.stats()
    }

    /// The lower tier index of `tier`, if it exists yet.
    pub fn lower_tier(&self, tier: StorageTier) -> Option<&LowerTierIndex> {
        lower_slot(tier).and_then(|i| self.lower[i].as_ref())
    }

    pub fn has_side_index(&self) -> bool {
        self.side.is_some()
    }

    pub fn is_approximate(&self) -> bool {
        self.primary_ttl.is_some()
    }

    /// Starts noting what writes change, for a mirror ([`KvIndex::mirror_changes`]);
    /// forgets what was noted before. Returns `false` when the previous log was never
    /// turned off (a write panicked while noting): a mirror then needs
    /// [`KvIndex::mirror_all`].
    pub(crate) fn log_on(&mut self) -> bool {
        let clean = self.primary.log_on();
        if let Some((side, _)) = &mut self.side {
            side.log_on();
        }
        for tier in self.lower.iter_mut().flatten() {
            tier.log_on();
        }
        clean
    }

    /// Unique among the indexes of this process.
    pub(crate) fn serial(&self) -> u64 {
        self.serial
    }

    /// Stops noting changes. Returns whether the log was on.
    pub(crate) fn log_off(&mut self) -> bool {
        if let Some((side, _)) = &mut self.side {
            side.log_off();
        }
        for tier in self.lower.iter_mut().flatten() {
            tier.log_off();
        }
        self.primary.log_off()
    }

    /// Makes this mirror answer every lookup as `src` does, given that it did before the
    /// changes `src` noted since its [`KvIndex::log_on`]. A mirror answers lookups
    /// (matches, depths, tiered matches, hint chains) and counters; its dumps, byte and
    /// membership figures and capacities are not the source's.
    pub(crate) fn mirror_changes(&mut self, src: &KvIndex) {
        self.primary.mirror_changes(&src.primary);
        if let (Some((mine, _)), Some((theirs, _))) = (&mut self.side, &src.side) {
            mine.mirror_changes(theirs);
        }
        for (mine, theirs) in self.lower.iter_mut().zip(&src.lower) {
            match (mine.as_mut(), theirs) {
                (Some(mine), Some(theirs)) => mine.mirror_changes(theirs),
                // Made by this write, before its log could be on.
                (None, Some(theirs)) => mine
                    .get_or_insert_with(LowerTierIndex::new)
                    .mirror_all(theirs),
                (_, None) => *mine = None,
            }
        }
        self.counters = src.counters;
    }

    /// Makes this mirror answer every lookup as `src` does, whatever it held (O(`src`)).
    pub(crate) fn mirror_all(&mut self, src: &KvIndex) {
        // The source's shape (it may be another cell's index, moved in); a mirror's own
        // timers are never armed: every write goes to the source.
        self.block_size = src.block_size;
        self.primary_ttl = src
            .primary_ttl
            .as_ref()
            .map(|a| Approx::new(a.timers.empty_like()));
        self.side = src
            .side
            .as_ref()
            .map(|(_, a)| (PrefixIndex::new(), Approx::new(a.timers.empty_like())));
        self.primary.mirror_all(&src.primary);
        if let (Some((mine, _)), Some((theirs, _))) = (&mut self.side, &src.side) {
            mine.mirror_all(theirs);
        }
        for (mine, theirs) in self.lower.iter_mut().zip(&src.lower) {
            match theirs {
                Some(theirs) => mine
                    .get_or_insert_with(LowerTierIndex::new)
                    .mirror_all(theirs),
                None => *mine = None,
            }
        }
        self.counters = src.counters;
    }

    /// Applies one normalized operation, routing it by tier (kv-events §7.4).
    pub fn apply(&mut self, op: &KvOperation) -> ApplyOutcome {
        if let KvOperationKind::Cleared = op.kind {
            self.clear_worker_key(op.worker);
            self.counters.cleared_ok += 1;
            return ApplyOutcome::Ok;
        }
        if let Some(i) = lower_slot(op.tier) {
            let tier = self.lower[i].get_or_insert_with(LowerTierIndex::new);
            match &op.kind {
                KvOperationKind::Stored {
                    parent_hash,
                    blocks,
                } => {
                    tier.apply_stored(op.worker, *parent_hash, blocks);
                }
                KvOperationKind::Removed { block_hashes } => {
                    tier.apply_removed(op.worker, block_hashes);
                }
                KvOperationKind::Cleared => {}
            }
            self.counters.lower_tier_ops += 1;
            return ApplyOutcome::Ok;
        }
        match &op.kind {
            KvOperationKind::Stored {
                parent_hash,
                blocks,
            } => match self.primary.apply_stored(op.worker, *parent_hash, blocks) {
                StoreOutcome::ParentNotFound => {
                    self.counters.stored_parent_block_not_found += 1;
                    ApplyOutcome::ParentBlockNotFound
                }
                StoreOutcome::Duplicate => {
                    self.counters.stored_ok += 1;
                    self.counters.duplicate_store += 1;
                    ApplyOutcome::DuplicateStore
                }
                _ => {
                    self.counters.stored_ok += 1;
                    ApplyOutcome::Ok
                }
            },
            KvOperationKind::Removed { block_hashes } => {
                let r = self.primary.apply_removed(op.worker, block_hashes);
                if r.not_found == 0 {
                    self.counters.removed_ok += 1;
                    ApplyOutcome::Ok
                } else {
                    self.counters.removed_block_not_found += 1;
                    self.counters.blocks_not_found += u64::from(r.not_found);
                    ApplyOutcome::BlockNotFound {
                        missing: r.not_found,
                    }
                }
            }
            KvOperationKind::Cleared => ApplyOutcome::Ok,
        }
    }

    /// One piece of a device-tier store that the caller split so that no single write
    /// section is long (a 750-block event costs ~75 µs): pieces applied in order, each
    /// with the previous piece's last engine hash as its parent, give the same index as the
    /// whole event. Only the first piece (`first = true`) counts in [`ApplyCounters`], so
    /// the counters still count events. A rejected piece leaves later pieces orphaned:
    /// stop at the first [`ApplyOutcome::ParentBlockNotFound`].
    pub fn apply_stored_piece(
        &mut self,
        worker: WorkerKey,
        parent_hash: Option<ExternalHash>,
        blocks: &[StoredBlock],
        first: bool,
    ) -> ApplyOutcome {
        let outcome = self.primary.apply_stored(worker, parent_hash, blocks);
        let counted = |n: &mut u64| {
            if first {
                *n += 1;
            }
        };
        match outcome {
            StoreOutcome::ParentNotFound => {
                counted(&mut self.counters.stored_parent_block_not_found);
                ApplyOutcome::ParentBlockNotFound
            }
            StoreOutcome::Duplicate => {
                counted(&mut self.counters.stored_ok);
                counted(&mut self.counters.duplicate_store);
                ApplyOutcome::DuplicateStore
            }
            _ => {
                counted(&mut self.counters.stored_ok);
                ApplyOutcome::Ok
            }
        }
    }

    /// `Cleared` fan-out (§4.3): primary and every existing lower tier. The side index
    /// and approximate timers are untouched (they are not fed by engine events).
    fn clear_worker_key(&mut self, worker: WorkerKey) {
        self.primary.remove_worker_key(worker);
        for tier in self.lower.iter_mut().flatten() {
            tier.remove_worker_key(worker);
        }
    }

    /// Drops every rank of `worker_id` everywhere: primary, lower tiers, side index, timers.
    pub fn remove_worker(&mut self, worker_id: WorkerId) {
        self.primary.remove_worker_id(worker_id);
        for tier in self.lower.iter_mut().flatten() {
            tier.remove_worker_id(worker_id);
        }
        if let Some(a) = &mut self.primary_ttl {
            a.forget_worker_id(worker_id);
        }
        if let Some((side, a)) = &mut self.side {
            side.remove_worker_id(worker_id);
            a.forget_worker_id(worker_id);
        }
    }

    /// Declares (`Some`) or withdraws (`None`) the device-tier capacity of `worker` in
    /// blocks ([`PrefixIndex::set_capacity`]); returns the blocks evicted now.
    pub fn set_capacity(&mut self, worker: WorkerKey, blocks: Option<u32>) -> u32 {
        self.primary.set_capacity(worker, blocks)
    }

    /// Drops one worker key everywhere, with its declared capacity.
    pub fn remove_rank(&mut self, worker: WorkerKey) {
        self.primary.set_capacity(worker, None);
        self.clear_worker_key(worker);
        if let Some(a) = &mut self.primary_ttl {
            a.forget_worker_key(worker);
        }
        if let Some((side, a)) = &mut self.side {
            side.remove_worker_key(worker);
            a.forget_worker_key(worker);
        }
    }

    /// Device scores of `query` (primary merged with the side index by per-worker max).
    /// Allocation-free once `out` has grown to the answer size.
    pub fn find_matches(&self, query: &[BlockHash], out: &mut OverlapScores) {
        self.primary.find_matches(query, out);
        if let Some((side, _)) = &self.side {
            out.stash();
            side.find_matches(query, out);
            out.merge_stash();
        }
    }

    /// The root-aligned chain of engine hashes for `query` (at most `max_len`) that a
    /// KV-transfer hint names (`scheduling.md` §4.8): the device tree's walk, then extended
    /// position by position with host_pinned continuations. Disk and external tiers do not
    /// take part: a hint moves blocks a source can serve from memory. Blocks are named by
    /// `holder`'s own hashes where its engine hashed them differently from the tree's first
    /// writer, so the chain continues along `holder`'s host-tier blocks too.
    pub fn root_chain(
        &self,
        query: &[BlockHash],
        max_len: usize,
        holder: Option<WorkerKey>,
        out: &mut Vec<ExternalHash>,
    ) {
        self.primary.root_chain(query, max_len, holder, out);
        let Some(host) = &self.lower[0] else {
            return;
        };
        let end = max_len.min(query.len());
        let mut anchor = out.last().copied();
        while out.len() < end {
            let Some(child) = host.child(anchor, query[out.len()]) else {
                break;
            };
            out.push(child);
            anchor = Some(child);
        }
    }

    /// The device-tier depth of `query` for every worker slot, when that is the whole
    /// answer: no lower tier has ever been fed and there is no side index (whose scores
    /// would be merged in). Returns `false`, leaving `out` as it was, otherwise; then
    /// [`KvIndex::find_tiered`] is the query to run.
    pub fn find_device_depths(&self, query: &[BlockHash], out: &mut SlotDepths) -> bool {
        if self.side.is_some() || self.lower.iter().any(Option::is_some) {
            return false;
        }
        self.primary.find_depths(query, out);
        true
    }

    /// The tiered query of §4.4 into `out`.
    pub fn find_tiered(&self, query: &[BlockHash], out: &mut TieredMatches) {
        self.primary.find_matches(query, &mut out.device);
        out.hits.clear();
        out.conts.clear();
        out.hits
            .extend(out.device.entries().iter().map(|e| TierHits {
                worker: e.worker,
                device: e.matched_blocks,
                ..TierHits::default()
            }));
        // Continuations only feed the lower-tier walks.
        if self.lower.iter().any(Option::is_some) {
            out.conts.extend(
                out.device
                    .entries()
                    .iter()
                    .map(|e| (e.matched_blocks, Some(e.last_external))),
            );
        }
        if let Some(&first) = query.first() {
            let len = u32::try_from(query.len()).unwrap_or(u32::MAX);
            for (i, tier) in self.lower.iter().enumerate() {
                let Some(tier) = tier else { continue };
                for &w in tier.root_owners(first) {
                    if !out.hits.iter().any(|h| h.worker == w) {
                        out.hits.push(TierHits {
                            worker: w,
                            ..TierHits::default()
                        });
                        out.conts.push((0, None));
                    }
                }
                for (h, cont) in out.hits.iter_mut().zip(out.conts.iter_mut()) {
                    let (start, mut anchor) = *cont;
                    let mut pos = start;
                    while pos < len {
                        match tier.owned_child(h.worker, anchor, query[pos as usize]) {
                            Some(child) => {
                                anchor = Some(child);
                                pos += 1;
                            }
                            None => break,
                        }
                    }
                    let gained = pos - start;
                    match i {
                        0 => h.host_pinned = gained,
                        1 => h.disk = gained,
                        _ => h.external = gained,
                    }
                    if gained > 0 {
                        *cont = (pos, anchor);
                    }
                }
            }
        }
        // Predicted credit is merged last so it never seeds a lower-tier walk.
        if let Some((side, _)) = &self.side {
            side.find_matches(query, &mut out.side);
            out.device.merge_max(&out.side);
            for e in out.side.entries() {
                match out.hits.iter_mut().find(|h| h.worker == e.worker) {
                    Some(h) => h.device = h.device.max(e.matched_blocks),
                    None => out.hits.push(TierHits {
                        worker: e.worker,
                        device: e.matched_blocks,
                        ..TierHits::default()
                    }),
                }
            }
        }
    }

    /// Records a routing decision of `worker` for a prompt with local hashes `locals`
    /// (§5.1): into the primary in approximate mode, into the side index when configured.
    pub fn record_decision(
        &mut self,
        worker: WorkerKey,
        locals: &[BlockHash],
        now: Instant,
    ) -> RecordOutcome {
        if locals.is_empty() || (self.primary_ttl.is_none() && self.side.is_none()) {
            return RecordOutcome::NotRecorded;
        }
        let mut seqs = std::mem::take(&mut self.seq_scratch);
        kv_types::sequence_hashes_into(locals, &mut seqs);
        let out = self.record_decision_chained(worker, locals, &seqs, now);
        self.seq_scratch = seqs;
        out
    }

    /// [`Self::record_decision`] when the caller already has the chain: `seqs` must be
    /// `sequence_hashes(locals)`, as the service has it from hashing the prompt. The chain is
    /// serial (about 1 µs per 256 blocks) and this runs under the index's write lock, so
    /// computing it outside keeps the lock shorter. A `seqs` of another length is ignored and
    /// the chain computed here.
    pub fn record_decision_chained(
        &mut self,
        worker: WorkerKey,
        locals: &[BlockHash],
        seqs: &[SequenceHash],
        now: Instant,
    ) -> RecordOutcome {
        if seqs.len() != locals.len() {
            debug_assert_eq!(seqs.len(), locals.len(), "a chain for other blocks");
            return self.record_decision(worker, locals, now);
        }
        if locals.is_empty() || (self.primary_ttl.is_none() && self.side.is_none()) {
            return RecordOutcome::NotRecorded;
        }
        self.block_scratch.clear();
        self.block_scratch.extend(
            locals
                .iter()
                .zip(seqs)
                .map(|(&l, s)| StoredBlock::new(ExternalHash(s.0), l)),
        );
        let mut recorded = false;
        if let Some(a) = &mut self.primary_ttl {
            recorded |= a.record(&mut self.primary, worker, &self.block_scratch, seqs, now);
        }
        if let Some((side, a)) = &mut self.side {
            recorded |= a.record(side, worker, &self.block_scratch, seqs, now);
        }
        if recorded {
            RecordOutcome::Recorded
        } else {
            RecordOutcome::NotRecorded
        }
    }

    /// Applies up to `budget` expired approximate entries (primary and side) as one
    /// `Removed` per worker key. Returns the number expired; call again while it returns
    /// `budget` (the shared wrapper does, releasing the lock in between).
    pub fn expire(&mut self, now: Instant, budget: usize) -> usize {
        let mut groups = Vec::new();
        let mut hashes: Vec<ExternalHash> = Vec::new();
        let mut total = 0;
        if let Some(a) = &mut self.primary_ttl {
            total += a.timers.expire(now, budget, &mut groups);
            for (worker, seqs) in groups.drain(..) {
                hashes.clear();
                hashes.extend(seqs.iter().map(|s| ExternalHash(s.0)));
                self.primary.apply_removed(worker, &hashes);
            }
        }
        if let Some((side, a)) = &mut self.side {
            total += a
                .timers
                .expire(now, budget.saturating_sub(total), &mut groups);
            for (worker, seqs) in groups.drain(..) {
                hashes.clear();
                hashes.extend(seqs.iter().map(|s| ExternalHash(s.0)));
                side.apply_removed(worker, &hashes);
            }
        }
        self.counters.approx_expired += total as u64;
        total
    }

    /// The primary and lower tiers as replayable `stored` operations (§9.1), event ids
    /// counting from 0 in emission order. The side index is never included.
    pub fn snapshot_operations(&self) -> Vec<KvOperation> {
        let mut ops = Vec::new();
        self.primary.for_each_run(|worker, parent_hash, blocks| {
            ops.push(KvOperation {
                worker,
                tier: StorageTier::Device,
                event_id: ops.len() as u64,
                kind: KvOperationKind::Stored {
                    parent_hash,
                    blocks: blocks.to_vec(),
                },
            });
        });
        for (i, tier) in self.lower.iter().enumerate() {
            let Some(tier) = tier else { continue };
            for (worker, parent_hash, block) in tier.memberships_sorted() {
                ops.push(KvOperation {
                    worker,
                    tier: StorageTier::LOWER[i],
                    event_id: ops.len() as u64,
                    kind: KvOperationKind::Stored {
                        parent_hash,
                        blocks: vec![block],
                    },
                });
            }
        }
        ops
    }
}
