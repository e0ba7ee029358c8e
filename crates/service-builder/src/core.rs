//! `SelectionCore`: the catalog, the partitions and every selection / reservation operation.
//!
//! Locking: the catalog (`State`) is a `RwLock` read by every selection for a few
//! microseconds and written only by catalog mutations, which are additionally serialized by
//! `catalog_mutation` so that listener reconciliation never races itself. Each partition has
//! its own index lock (readers: selections; writer: event ingestion, one event at a time)
//! and its own ledger mutex. Hashing happens before any lock is taken.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kv_index::{IndexConfig, KvIndex, TierHits};
use kv_types::{
    BlockHash, HashOptions, KvOperation, SequenceHash, TrackingHasher, TrackingScope, WorkerId,
    WorkerKey,
};
use load_accounting::{BookRequest, Ledger, LedgerConfig, LedgerError, ReservationId, SlotPolicy};
use parking_lot::{Mutex, RwLock};
use selection_policy::{
    CacheInputs, Candidate, CandidateRows, LoadInputs, PickRng, Policy, PolicyClasses, PolicyError,
    PoolLabel, RouterConfig, RouterConfigOverride, Scratch, Selection, SelectionContext,
    cached_tokens, preferred_taint_multiplier,
};

use crate::admission::{
    Cancel, MAX_QUEUE_WAIT, PartitionQueue, Ticket, Wait, WaitOutcome, eligible,
};
use crate::catalog::{
    Lifecycle, MAX_DATA_PARALLEL_SIZE, PartitionKey, WorkerCatalogRecord, WorkerPatch,
    WorkerRequest,
};
use crate::error::SelectionError;
use crate::ingress::{Ingress, IngressSink};
use crate::metrics::CoreMetrics;
use crate::pending::{PendingCache, PendingKey, PendingSelection, SelectionCacheConfig};
use crate::request::{
    LoadRow, ModelLoads, OverlapRow, OverlapScoresResponse, OverlapSummary, PromptInput,
    PromptQuery, ReadyResponse, ReservationRequest, ReservationResponse, SelectRequest,
    SelectResponse,
};
use crate::roster::{Roster, RosterRow, RowHits, WorkerEntry};
use crate::routing_stats::{RoutingSample, RoutingStats};
use crate::session::{BindingUpdate, Hold, MAX_SESSION_ID_BYTES, SessionTable, SessionTarget};

/// Builds the worker-selection policy of a partition; called once per partition.
pub type PolicyFactory = Arc<dyn Fn(&RouterConfig, &PartitionKey) -> Policy + Send + Sync>;

/// Everything the core needs to know, with the spec's defaults.
#[derive(Clone, Debug)]
pub struct CoreConfig {
    pub router: RouterConfig,
    pub selection_cache: SelectionCacheConfig,
    pub tracking: TrackingHasher,
    /// Absolute booking age after which a reservation is reclaimed.
    pub active_request_expiry: Duration,
    /// Upper bound on live reservations across the process (`None` = unbounded).
    pub max_active_reservations: Option<usize>,
    /// How long a gap replay may wait for the engine.
    pub replay_timeout: Duration,
    /// Seed of the pickers' random source (`None` = from the clock).
    pub rng_seed: Option<u64>,
    /// Enables per-partition session-affinity tables (hard mode) with this idle TTL.
    pub session_affinity_ttl: Option<Duration>,
    /// This replica's id as a session-binding writer (0 without replica sync).
    pub replica_id: u64,
    /// Longest prompt accepted, in tokens; longer ones fail with 413 before hashing.
    pub max_prompt_tokens: usize,
    /// Policy classes of the admission queue (from a policy file); `None` = the synthetic
    /// class of `router.router_queue_threshold` / `router.router_queue_policy`.
    pub policy_classes: Option<PolicyClasses>,
    /// A request that waited in the queue at least this long has its overlap looked up
    /// again before scheduling (`DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS`); `None` = never.
    pub overlap_refresh_after: Option<Duration>,
}

impl Default for CoreConfig {
    fn default() -> Self {
        Self {
            router: RouterConfig::default(),
            selection_cache: SelectionCacheConfig::default(),
            tracking: TrackingHasher::Public,
            active_request_expiry: Duration::from_secs(300),
            max_active_reservations: None,
            replay_timeout: Duration::from_secs(5),
            rng_seed: None,
            session_affinity_ttl: None,
            replica_id: 0,
            max_prompt_tokens: 1_000_000,
            policy_classes: None,
            overlap_refresh_after: Some(selection_policy::DEFAULT_OVERLAP_REFRESH_AFTER),
        }
    }
}

/// Scratch buffers of one selection, pooled so the hot path does not allocate.
#[derive(Debug, Default)]
struct SelectScratch {
    blocks: Vec<BlockHash>,
    tracking: Vec<SequenceHash>,
    /// `tracking` is the public sequence chain of `blocks` (computed here, not given).
    tracking_is_chain: bool,
    /// The tiered lookup and, per roster row, its hits.
    hits: RowHits,
    candidates: Vec<Candidate>,
    policy: Scratch,
}

/// What admission did for `schedule`.
/// What [`SelectionCore::schedule`] chose, with what booking it needs.
struct Scheduled {
    selection: Selection,
    isl: u64,
    track: bool,
    response: SelectResponse,
    routing: RoutingSample,
}

#[derive(Debug, Default)]
struct Admission {
    /// Set when admission already hashed and looked up the prompt into the scratch.
    prepared_isl: Option<u64>,
    /// The request waited in the queue (it re-checks the queue when done).
    queued: bool,
}

pub(crate) struct Partition {
    pub(crate) key: PartitionKey,
    pub(crate) block_size: u32,
    pub(crate) is_eagle: bool,
    pub(crate) index: RwLock<KvIndex>,
    /// The index records routing decisions (approximate mode or a predicted-TTL side
    /// index): fixed when the index is built, so bookings without it take no index lock.
    records_decisions: bool,
    ledger: Mutex<Ledger>,
    policy: Policy,
    /// Schedulable workers by id, replaced wholesale on every catalog commit.
    workers: RwLock<Arc<Roster>>,
    scratch: Mutex<Vec<SelectScratch>>,
    rng: Mutex<PickRng>,
    sessions: Option<SessionTable>,
    /// When the booking path may next run the ledger's expiry scan.
    next_expiry_check: Mutex<Instant>,
    /// The admission queue, when a busy threshold enables queueing.
    pub(crate) queue: Option<PartitionQueue>,
    /// Created by startup recovery and not yet joined by a worker: the first worker (or
    /// `ensure_partition`) sets the block size and Eagle flag, keeping the recovered index
    /// (replica-sync §9.2).
    adoptable: AtomicBool,
    /// Routing-loss counters of the bookings selections made here.
    pub(crate) routing: RoutingStats,
}

/// How often the booking path re-runs the expiry scan (the periodic task runs regardless).
const EXPIRY_RECHECK: Duration = Duration::from_secs(30);

impl SelectScratch {
    /// The sequence chain of `blocks`, when `tracking` is it.
    fn chain(&self) -> Option<&[SequenceHash]> {
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

#[derive(Debug)]
enum RowState {
    /// The id is claimed while a booking is in flight.
    Claimed,
    Booked,
}

#[derive(Debug)]
struct ReservationRow {
    partition: Arc<Partition>,
    state: RowState,
    /// The session lease this booking holds, released with the row.
    session: Option<String>,
}

impl ReservationRow {
    /// Releases the row's session lease; the binding, for peers, if it is still there.
    fn release_session(&self, now: Instant) -> Option<BindingUpdate> {
        match (&self.session, &self.partition.sessions) {
            (Some(sid), Some(table)) => table.release(sid, now),
            _ => None,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    records: BTreeMap<u64, WorkerCatalogRecord>,
    partitions: BTreeMap<PartitionKey, Arc<Partition>>,
}

/// The whole selection service state, usable without any task or socket.
pub struct SelectionCore {
    config: CoreConfig,
    policy_factory: Option<PolicyFactory>,
    state: RwLock<State>,
    catalog_mutation: Mutex<()>,
    /// Keyed by the id the ledger books under: a claim allocates it once, the booking
    /// shares it.
    reservations: Mutex<HashMap<ReservationId, ReservationRow>>,
    pending: Mutex<PendingCache>,
    ingress: Ingress,
    shut_down: AtomicBool,
    metrics: CoreMetrics,
    rng_seed: AtomicU64,
    replica: RwLock<Option<Arc<replica_sync::ReplicaMesh>>>,
    replica_stats: crate::replica::ReplicaApplyStats,
    /// When a claim at the reservation limit may next run the expiry sweep itself.
    next_full_sweep: Mutex<Instant>,
}

/// How often a claim at the reservation limit may sweep expired bookings (see `claim`).
const FULL_SWEEP_EVERY: Duration = Duration::from_secs(1);

impl std::fmt::Debug for SelectionCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SelectionCore")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn no_schedulable() -> SelectionError {
    SelectionError::not_ready("no schedulable workers are available")
}

impl SelectionCore {
    /// A local-only core: no replica mesh, no recovery; the index is ready immediately.
    pub fn try_new_local(
        config: CoreConfig,
        policy_factory: Option<PolicyFactory>,
    ) -> Result<Arc<Self>, crate::BuildError> {
        config
            .router
            .validate()
            .map_err(|e| crate::BuildError::RouterConfig(e.to_string()))?;
        index_config(&config.router)
            .validate()
            .map_err(|e| crate::BuildError::RouterConfig(e.to_string()))?;
        let seed = config.rng_seed.unwrap_or_else(clock_seed);
        let replay_timeout = config.replay_timeout;
        Ok(Arc::new_cyclic(|weak: &std::sync::Weak<SelectionCore>| {
            let sink: Arc<dyn IngressSink> = Arc::new(weak.clone());
            Self {
                pending: Mutex::new(PendingCache::new(config.selection_cache)),
                config,
                policy_factory,
                state: RwLock::default(),
                catalog_mutation: Mutex::new(()),
                reservations: Mutex::default(),
                ingress: Ingress::new(sink, replay_timeout),
                shut_down: AtomicBool::new(false),
                metrics: CoreMetrics::default(),
                rng_seed: AtomicU64::new(seed),
                replica: RwLock::new(None),
                replica_stats: crate::replica::ReplicaApplyStats::default(),
                next_full_sweep: Mutex::new(Instant::now()),
            }
        }))
    }

    pub fn config(&self) -> &CoreConfig {
        &self.config
    }

    pub fn metrics(&self) -> &CoreMetrics {
        &self.metrics
    }

    /// Statistics of every running KV-event listener, by worker key.
    pub fn listener_stats(&self) -> Vec<(WorkerKey, Arc<kv_events::ListenerStats>)> {
        self.ingress.stats()
    }

    /// Drops and filters by reason over every KV listener this core has run, removed
    /// ones included: monotonic, unlike a sum over [`Self::listener_stats`].
    pub fn listener_totals(&self) -> &kv_events::ReasonTotals {
        self.ingress.totals()
    }

    /// The (worker, rank) listeners that receive no events because they failed (a socket
    /// error, or an endpoint libzmq refused at connect), in key order. The worker's catalog
    /// record says why, in `warnings`.
    pub fn failed_listeners(&self) -> Vec<WorkerKey> {
        self.ingress.failed()
    }

    /// The (worker, rank) listeners whose publisher looks unreachable: libzmq keeps
    /// retrying without a handshake ([`kv_events::ListenerStats::unreachable`]). They
    /// recover by themselves once the publisher answers; the worker's catalog record says
    /// so in `warnings` meanwhile.
    pub fn unreachable_listeners(&self) -> Vec<WorkerKey> {
        self.ingress.unreachable()
    }

    /// Seq of the last batch applied by a rank's listener.
    pub fn listener_watermark(&self, key: WorkerKey) -> Option<u64> {
        self.ingress.watermark(key)
    }

    /// Stops accepting selections and new bookings, and stops every KV listener.
    pub fn shutdown(&self) {
        if !self.shut_down.swap(true, Ordering::SeqCst) {
            self.ingress.stop_all();
            if let Some(mesh) = self.replica.write().take() {
                mesh.shutdown();
            }
            let partitions: Vec<Arc<Partition>> =
                self.state.read().partitions.values().cloned().collect();
            for p in partitions {
                if let Some(q) = &p.queue {
                    q.shut_down();
                }
            }
        }
    }

    pub fn is_shut_down(&self) -> bool {
        self.shut_down.load(Ordering::SeqCst)
    }

    fn check_running(&self) -> Result<(), SelectionError> {
        if self.is_shut_down() {
            Err(SelectionError::shutting_down())
        } else {
            Ok(())
        }
    }

    /// Whether any policy class queues (then non-advisory selections may wait).
    pub fn queueing_enabled(&self) -> bool {
        self.policy_classes().queueing_enabled()
    }

    /// The configured policy classes, or the synthetic one.
    fn policy_classes(&self) -> PolicyClasses {
        self.config
            .policy_classes
            .clone()
            .unwrap_or_else(|| PolicyClasses::synthetic(&self.config.router))
    }

    // ---------------------------------------------------------------- replica sync

    pub(crate) fn set_replica_mesh(&self, mesh: Arc<replica_sync::ReplicaMesh>) {
        *self.replica.write() = Some(mesh);
    }

    fn mesh(&self) -> Option<Arc<replica_sync::ReplicaMesh>> {
        self.replica.read().clone()
    }

    /// Releases a row's session lease and tells peers to refresh the binding's idle
    /// deadline (replica-sync §7.2: a released lease republishes the unchanged version).
    fn release_row_session(&self, row: &ReservationRow, now: Instant) {
        if let Some(update) = row.release_session(now)
            && let Some(mesh) = self.mesh()
            && mesh.session_affinity()
        {
            crate::replica::publish(
                Some(&mesh),
                crate::replica::binding_event(&row.partition.key, &update),
            );
        }
    }

    /// Publishes the event `make` builds; without replica sync nothing is built (events own
    /// their strings, and this runs on every reservation call).
    fn publish_replica_with(&self, make: impl FnOnce() -> replica_sync::ReplicaEvent) {
        if let Some(mesh) = self.mesh() {
            crate::replica::publish(Some(&mesh), make());
        }
    }

    /// Counters of peer events, applied and dropped by reason.
    pub fn replica_stats(&self) -> &crate::replica::ReplicaApplyStats {
        &self.replica_stats
    }

    /// Mesh counters (sent, dropped, delivered...), when replica sync is on.
    pub fn replica_mesh_stats(&self) -> Option<replica_sync::MeshStatsSnapshot> {
        self.mesh().map(|m| m.stats().snapshot())
    }

    /// The replica-sync port this process publishes on, if enabled.
    pub fn replica_sync_enabled(&self) -> bool {
        self.replica.read().is_some()
    }

    /// `POST /replica_sync/register_peer`: `Ok(true)` when newly added.
    pub fn register_replica_peer(&self, endpoint: &str) -> Result<bool, replica_sync::PeerError> {
        match self.mesh() {
            Some(m) => m.register_peer(endpoint),
            None => Err(replica_sync::PeerError::Disabled),
        }
    }

    /// `POST /replica_sync/deregister_peer`.
    pub fn deregister_replica_peer(&self, endpoint: &str) -> Result<(), replica_sync::PeerError> {
        match self.mesh() {
            Some(m) => m.deregister_peer(endpoint),
            None => Err(replica_sync::PeerError::Disabled),
        }
    }

    /// The connection state of every replica peer (empty when replica sync is off).
    pub fn replica_peer_links(&self) -> Vec<replica_sync::PeerLink> {
        self.mesh().map(|m| m.peer_links()).unwrap_or_default()
    }

    /// `GET /replica_sync/peers`, sorted; empty when disabled.
    pub fn replica_peers(&self) -> Vec<String> {
        self.mesh().map(|m| m.peers()).unwrap_or_default()
    }

    /// A mirrored booking occupies its id (replacing an in-flight local claim of the same
    /// partition, whose booking then fails with 409).
    pub(crate) fn install_mirrored_row(&self, id: &str, p: &Arc<Partition>) {
        let mut rows = self.reservations.lock();
        let replace = rows.get(id).is_none_or(|r| Arc::ptr_eq(&r.partition, p));
        if replace {
            rows.insert(
                ReservationId::from(id),
                ReservationRow {
                    partition: Arc::clone(p),
                    state: RowState::Booked,
                    session: None,
                },
            );
        }
    }

    /// Drops the row of a booking a peer freed: only a booked row of partition `p` (a row
    /// of another partition, or a local claim in flight, describes another booking).
    pub(crate) fn drop_mirrored_row(&self, id: &str, p: &Arc<Partition>, now: Instant) {
        let removed = {
            let mut rows = self.reservations.lock();
            let ours = rows.get(id).is_some_and(|r| {
                matches!(r.state, RowState::Booked) && Arc::ptr_eq(&r.partition, p)
            });
            if ours { rows.remove(id) } else { None }
        };
        if let Some(row) = removed {
            self.release_row_session(&row, now);
        }
    }

    // ---------------------------------------------------------------- catalog

    /// `POST /workers`.
    pub fn upsert_worker(
        &self,
        record: WorkerRequest,
    ) -> Result<WorkerCatalogRecord, SelectionError> {
        self.upsert_workers(vec![record])
            .pop()
            .unwrap_or_else(|| Err(SelectionError::internal("empty batch")))
    }

    /// Batch upsert: one lock, per-record results in order.
    pub fn upsert_workers(
        &self,
        records: Vec<WorkerRequest>,
    ) -> Vec<Result<WorkerCatalogRecord, SelectionError>> {
        let _guard = self.catalog_mutation.lock();
        records.into_iter().map(|r| self.upsert_locked(r)).collect()
    }

    fn upsert_locked(&self, record: WorkerRequest) -> Result<WorkerCatalogRecord, SelectionError> {
        self.check_running()?;
        if let Some(n) = record
            .data_parallel_size
            .filter(|&n| n > MAX_DATA_PARALLEL_SIZE)
        {
            return Err(SelectionError::bad_request(format!(
                "data_parallel_size {n} exceeds the maximum {MAX_DATA_PARALLEL_SIZE}"
            )));
        }
        let use_kv_events = self.config.router.use_kv_events;
        let mut reasons = record.missing_metadata(self.queueing_enabled(), use_kv_events);
        let mut partition = None;
        if reasons.is_empty() {
            match self.ensure_partition_for(&record) {
                Ok(p) => partition = Some(p),
                Err(e) => reasons.push(format!("reconciliation failed: {e}")),
            }
        }
        let prev = {
            let state = self.state.read();
            state
                .records
                .get(&record.worker_id)
                .filter(|r| r.is_schedulable())
                .cloned()
        };
        let moved = prev
            .as_ref()
            .is_some_and(|p| p.worker.partition() != record.partition() || !reasons.is_empty());
        if let Some(prev) = prev.as_ref().filter(|_| moved) {
            self.detach(&prev.worker);
        }
        let prev_same = prev.filter(|_| !moved);
        if let (true, Some(_)) = (reasons.is_empty() && use_kv_events, &partition) {
            let partition = partition.as_ref().map(Arc::clone);
            if let Some(p) = partition
                && let Err(e) =
                    self.ingress
                        .reconcile(&p, prev_same.as_ref().map(|r| &r.worker), &record)
            {
                self.ingress.detach_worker(WorkerId(record.worker_id));
                reasons.push(format!("reconciliation failed: {e}"));
            }
        }
        let lifecycle = if reasons.is_empty() {
            Lifecycle::Schedulable
        } else {
            Lifecycle::Incomplete
        };
        // A refused endpoint is known at once; later listener failures appear in listings.
        let warnings = self.ingress.warnings(WorkerId(record.worker_id));
        let out = WorkerCatalogRecord {
            worker: record,
            lifecycle,
            not_schedulable_reasons: reasons,
            warnings,
        };
        let old = {
            let mut state = self.state.write();
            state.records.insert(out.worker.worker_id, out.clone())
        };
        if old
            .as_ref()
            .is_none_or(|o| o.lifecycle != out.lifecycle || o.worker != out.worker)
        {
            tracing::info!(
                worker_id = out.worker.worker_id,
                // Escaped: client-chosen names must not break a text log line in two.
                model_name = %out.worker.model_name.escape_debug(),
                routing_group = %out.worker.routing_group.escape_debug(),
                lifecycle = out.lifecycle.as_str(),
                reasons = ?out.not_schedulable_reasons,
                "worker registered"
            );
        }
        let old_partition = old.map(|o| o.worker.partition());
        if let Some(old) = old_partition.filter(|k| *k != out.worker.partition()) {
            self.publish(&old, out.worker.worker_id);
        }
        self.publish(&out.worker.partition(), out.worker.worker_id);
        Ok(out)
    }

    /// `PATCH /workers/{id}`.
    pub fn patch_worker(
        &self,
        worker_id: u64,
        patch: WorkerPatch,
    ) -> Result<WorkerCatalogRecord, SelectionError> {
        let _guard = self.catalog_mutation.lock();
        self.check_running()?;
        let mut merged = match self.state.read().records.get(&worker_id) {
            Some(r) => r.worker.clone(),
            None => {
                return Err(SelectionError::not_found(format!(
                    "worker {worker_id} not found"
                )));
            }
        };
        patch.apply_to(&mut merged);
        self.upsert_locked(merged)
    }

    /// `DELETE /workers/{id}`: works after shutdown.
    pub fn delete_worker(&self, worker_id: u64) -> Result<WorkerCatalogRecord, SelectionError> {
        let _guard = self.catalog_mutation.lock();
        let removed = self.state.write().records.remove(&worker_id);
        let Some(mut record) = removed else {
            return Err(SelectionError::not_found(format!(
                "worker {worker_id} not found"
            )));
        };
        self.publish(&record.worker.partition(), worker_id);
        self.detach(&record.worker);
        record.lifecycle = Lifecycle::Unschedulable;
        tracing::info!(worker_id, lifecycle = "unschedulable", "worker removed");
        record.not_schedulable_reasons.clear();
        Ok(record)
    }

    /// `GET /workers`, sorted by `(model_name, routing_group, worker_id)`.
    pub fn list_workers(
        &self,
        model_name: Option<&str>,
        routing_group: Option<&str>,
    ) -> Vec<WorkerCatalogRecord> {
        let state = self.state.read();
        let mut out: Vec<WorkerCatalogRecord> = state
            .records
            .values()
            .filter(|r| model_name.is_none_or(|m| r.worker.model_name == m))
            .filter(|r| routing_group.is_none_or(|g| r.worker.routing_group == g))
            .cloned()
            .collect();
        drop(state);
        out.sort_by(|a, b| {
            (
                &a.worker.model_name,
                &a.worker.routing_group,
                a.worker.worker_id,
            )
                .cmp(&(
                    &b.worker.model_name,
                    &b.worker.routing_group,
                    b.worker.worker_id,
                ))
        });
        for r in &mut out {
            r.warnings = self.ingress.warnings(WorkerId(r.worker.worker_id));
        }
        out
    }

    /// `GET /ready`.
    pub fn ready(&self) -> ReadyResponse {
        let workers = self.list_workers(None, None);
        let schedulable_workers = workers.iter().filter(|r| r.is_schedulable()).count();
        ReadyResponse {
            ready: !self.is_shut_down() && schedulable_workers > 0,
            schedulable_workers,
            workers,
        }
    }

    /// Pre-creates a partition (embedding hosts).
    pub fn ensure_partition(
        &self,
        key: PartitionKey,
        block_size: u32,
        is_eagle: bool,
    ) -> Result<(), SelectionError> {
        if block_size == 0 {
            return Err(SelectionError::bad_request(
                "block_size must be greater than 0",
            ));
        }
        self.partition_or_create(key, block_size, is_eagle)
            .map(|_| ())
            .map_err(SelectionError::bad_request)
    }

    fn ensure_partition_for(&self, r: &WorkerRequest) -> Result<Arc<Partition>, String> {
        self.partition_or_create(
            r.partition(),
            r.block_size.unwrap_or(0),
            r.is_eagle.unwrap_or(false),
        )
    }

    /// The partition `key` for a worker (or an embedding host) with this block size and
    /// Eagle flag, created if missing. A partition only recovery has created so far takes
    /// them over, keeping its index (replica-sync §9.2: the mismatch is only logged).
    fn partition_or_create(
        &self,
        key: PartitionKey,
        block_size: u32,
        is_eagle: bool,
    ) -> Result<Arc<Partition>, String> {
        if let Some(p) = self.state.read().partitions.get(&key)
            && !p.adoptable.load(Ordering::Acquire)
        {
            return check_partition(p, block_size, is_eagle).map(|()| Arc::clone(p));
        }
        let mut state = self.state.write();
        if let Some(p) = state.partitions.get(&key) {
            let adoptable = p.adoptable.swap(false, Ordering::AcqRel);
            let fits = check_partition(p, block_size, is_eagle);
            if !adoptable || fits.is_ok() {
                return fits.map(|()| Arc::clone(p));
            }
            tracing::warn!(
                partition = %key.for_log(),
                recovered_block_size = p.block_size,
                block_size,
                is_eagle,
                "the first worker of a recovered partition registers another block size or \
                 Eagle flag; the partition takes them and keeps the recovered index, whose \
                 blocks were hashed differently and will not match new prompts"
            );
            let adopted = Arc::new(self.new_partition(key.clone(), block_size, is_eagle));
            let index = std::mem::replace(
                &mut *p.index.write(),
                KvIndex::with_block_size(p.block_size),
            );
            *adopted.index.write() = index;
            state.partitions.insert(key, Arc::clone(&adopted));
            return Ok(adopted);
        }
        let p = Arc::new(self.new_partition(key.clone(), block_size, is_eagle));
        state.partitions.insert(key, Arc::clone(&p));
        Ok(p)
    }

    fn new_partition(&self, key: PartitionKey, block_size: u32, is_eagle: bool) -> Partition {
        let router = &self.config.router;
        let policy = match &self.policy_factory {
            Some(f) => f(router, &key),
            None => Policy::default_policy(router, PoolLabel::default()),
        };
        let seed = self
            .rng_seed
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        let mut icfg = index_config(router);
        icfg.block_size = block_size;
        let index = KvIndex::new(&icfg, Instant::now());
        Partition {
            key,
            block_size,
            is_eagle,
            records_decisions: records_decisions(&index),
            index: RwLock::new(index),
            ledger: Mutex::new(Ledger::new(LedgerConfig {
                expiry: self.config.active_request_expiry,
            })),
            policy,
            workers: RwLock::new(Arc::new(Roster::default())),
            scratch: Mutex::new(Vec::new()),
            rng: Mutex::new(PickRng::seeded(seed)),
            next_expiry_check: Mutex::new(Instant::now()),
            queue: PartitionQueue::new(&self.policy_classes()),
            sessions: self
                .config
                .session_affinity_ttl
                .map(|ttl| SessionTable::new(ttl, self.config.replica_id, clock_seed())),
            adoptable: AtomicBool::new(false),
            routing: RoutingStats::default(),
        }
    }

    /// Republishes the schedulable worker map of a partition after worker `changed` was
    /// upserted or removed, and reconciles its ledger slots synchronously (so a booking
    /// right after registration never misses its rank). Callers hold `catalog_mutation`, so
    /// the previous map is current except for `changed`: copying it (shared records) and
    /// updating one entry keeps a registration cheap with thousands of workers.
    fn publish(&self, key: &PartitionKey, changed: u64) {
        let state = self.state.read();
        let Some(p) = state.partitions.get(key).cloned() else {
            return;
        };
        let old = Arc::clone(&p.workers.read());
        let mut map: BTreeMap<u64, WorkerEntry> = (**old).clone();
        match state
            .records
            .get(&changed)
            .filter(|r| r.is_schedulable() && r.worker.is_in(key))
        {
            Some(r) if old.get(&changed).is_some_and(|e| *e.record == r.worker) => {}
            Some(r) => {
                let entry = WorkerEntry {
                    record: Arc::new(r.worker.clone()),
                };
                map.insert(changed, entry);
            }
            None => {
                map.remove(&changed);
            }
        }
        drop(old);
        drop(state);
        let mut roster = Roster::new(map);
        let mut ledger = p.ledger.lock();
        let current: Vec<WorkerKey> = ledger.ranks().collect();
        for rank in current {
            if !roster.has_row(rank) {
                ledger.remove_rank(rank);
            }
        }
        // Every other worker's ranks were registered when it was published.
        if let Some(w) = roster.get(&changed) {
            for rank in w.record.dp_ranks() {
                ledger.register_rank(WorkerKey::new(w.record.worker_id, rank));
            }
        }
        roster.bind_ledger(&ledger);
        drop(ledger);
        *p.workers.write() = Arc::new(roster);
        self.recheck_queue(&p);
    }

    /// Stops a worker's listeners and drops what the index holds for it.
    fn detach(&self, record: &WorkerRequest) {
        self.ingress.detach_worker(WorkerId(record.worker_id));
        if let Some(p) = self.partition(&record.partition()) {
            p.index.write().remove_worker(WorkerId(record.worker_id));
        }
    }

    pub(crate) fn partition(&self, key: &PartitionKey) -> Option<Arc<Partition>> {
        self.state.read().partitions.get(key).cloned()
    }

    fn ready_partition(&self, key: &PartitionKey) -> Result<Arc<Partition>, SelectionError> {
        let state = self.state.read();
        // The roster holds exactly the partition's schedulable workers. Scanning the catalog
        // for one instead cost every selection a walk over other partitions' records: with
        // 1,200 workers in ten models, two thirds of a selection's instructions.
        let ready = state
            .partitions
            .get(key)
            .filter(|p| !p.workers.read().is_empty());
        match ready {
            Some(p) => Ok(Arc::clone(p)),
            None if state
                .records
                .values()
                .any(WorkerCatalogRecord::is_schedulable) =>
            {
                Err(SelectionError::not_ready(format!(
                    "no schedulable workers for {key}"
                )))
            }
            None => Err(no_schedulable()),
        }
    }

    // ---------------------------------------------------------------- selection

    /// `POST /select`.
    pub fn select(&self, req: SelectRequest) -> Result<SelectResponse, SelectionError> {
        self.run_select(req, false, Wait::Yes(None)).done()
    }

    /// [`select`](Self::select) unless it would have to wait in the admission queue (a
    /// non-advisory request while every eligible rank is busy for its class): then the
    /// request comes back untouched and nothing was queued or counted. See
    /// [`try_select_and_reserve`](Self::try_select_and_reserve).
    pub fn try_select(&self, req: SelectRequest) -> Attempt<SelectResponse, SelectRequest> {
        self.run_select(req, false, Wait::No)
    }

    /// `POST /select_and_reserve`.
    pub fn select_and_reserve(
        &self,
        mut req: SelectRequest,
    ) -> Result<SelectResponse, SelectionError> {
        req.advisory = false;
        self.run_select(req, true, Wait::Yes(None)).done()
    }

    /// [`select_and_reserve`](Self::select_and_reserve) unless it would have to wait: in the
    /// admission queue (every eligible rank busy for the request's class), or behind a
    /// concurrent first booking of the same session. Then the request comes back untouched
    /// and nothing has changed (nothing queued, claimed, booked or counted), so an async
    /// caller can run the plain call where blocking is allowed, and the common case costs
    /// no thread hand-off.
    pub fn try_select_and_reserve(
        &self,
        mut req: SelectRequest,
    ) -> Attempt<SelectResponse, SelectRequest> {
        req.advisory = false;
        self.run_select(req, true, Wait::No)
    }

    /// [`select`](Self::select) for a caller that may go away (see [`Cancel`]).
    pub(crate) fn select_cancellable(
        &self,
        req: SelectRequest,
        cancel: &Cancel,
    ) -> Result<SelectResponse, SelectionError> {
        self.run_select(req, false, Wait::Yes(Some(cancel))).done()
    }

    /// [`select_and_reserve`](Self::select_and_reserve) for a caller that may go away.
    pub(crate) fn select_and_reserve_cancellable(
        &self,
        mut req: SelectRequest,
        cancel: &Cancel,
    ) -> Result<SelectResponse, SelectionError> {
        req.advisory = false;
        self.run_select(req, true, Wait::Yes(Some(cancel))).done()
    }

    fn run_select(
        &self,
        mut req: SelectRequest,
        book: bool,
        wait: Wait<'_>,
    ) -> Attempt<SelectResponse, SelectRequest> {
        let started = Instant::now();
        let Some(result) = settled(self.run_select_inner(&mut req, book, wait)) else {
            return Attempt::WouldWait(req);
        };
        self.metrics.selection_latency.observe(started.elapsed());
        match &result {
            Ok(_) => self.metrics.selections.inc(),
            Err(e) => {
                let op = if book {
                    crate::metrics::RejectedOperation::SelectAndReserve
                } else {
                    crate::metrics::RejectedOperation::Select
                };
                self.metrics.reject(op, e);
                self.metrics.selection_errors.inc()
            }
        };
        Attempt::Done(result)
    }

    /// The selection proper. `Stop::WouldWait` (only when `wait` is off) leaves `req` as it
    /// came and changes no state.
    fn run_select_inner(
        &self,
        req: &mut SelectRequest,
        book: bool,
        wait: Wait<'_>,
    ) -> Result<SelectResponse, Stop> {
        self.check_running()?;
        let partition = self.ready_partition(&req.partition)?;
        // What a stop for waiting must put back (the session code sets the affinity target).
        let taken = Taken::from(&*req);
        let selection_id = match (req.selection_id.take(), book) {
            (Some(id), _) => Some(id),
            (None, true) => Some(new_uuid_v4(&self.rng_seed)),
            (None, false) => None,
        };
        let claim = match (&selection_id, book) {
            (Some(id), true) => Some(self.claim(id, &partition)?),
            _ => None,
        };
        let session_id = session_of(req);
        let mut session = SessionGuard::none();
        if let (Some(table), Some(sid)) = (partition.sessions.as_ref(), session_id.as_deref()) {
            check_session_id(sid)?;
            let now = Instant::now();
            if book {
                let Some(held) = self.hold_session(&partition, table, sid, now, wait) else {
                    // The claim's row goes with the claim.
                    drop(claim);
                    return Err(taken.give_back(req, selection_id));
                };
                session = held;
                if let Some(target) = session.bound_target() {
                    req.affinity_target = Some(affinity(target));
                }
            } else if let Some(target) = table.read(sid, now)
                && partition.schedules(target.worker_id, target.dp_rank)
            {
                req.affinity_target = Some(affinity(target));
            }
        }
        let mut scratch = partition.scratch.lock().pop().unwrap_or_default();
        let admission = if req.advisory {
            Ok(Admission::default())
        } else {
            match settled(self.admit(&partition, req, &mut scratch, wait)) {
                Some(admission) => admission,
                None => {
                    partition.scratch.lock().push(scratch);
                    // The session hold and the claim's row are released with their guards.
                    drop(session);
                    drop(claim);
                    return Err(taken.give_back(req, selection_id));
                }
            }
        };
        let queued = admission.as_ref().is_ok_and(|a| a.queued);
        let result =
            admission.and_then(|a| self.schedule(&partition, req, &mut scratch, a.prepared_isl));
        let outcome = result.and_then(|scheduled| {
            let Scheduled {
                selection,
                isl,
                track,
                response: response_base,
                routing,
            } = scheduled;
            let tracking = scratch.tracking.clone();
            let mut kv_hint = None;
            if let (Some(claim), Some(id)) = (claim.as_ref(), selection_id.as_ref()) {
                let booking = Booking {
                    id: &claim.rid,
                    worker: selection.worker,
                    tracking: &tracking,
                    isl,
                    prefill: Some(selection.effective_prefill_tokens),
                    track,
                    expected_output_tokens: req.expected_output_tokens,
                    lora_name: req.prompt.lora_name.as_deref(),
                };
                self.book_on(&partition, &booking, SlotPolicy::CreateMissing)?;
                let binding = match session.commit(selection.worker, &partition) {
                    Ok(b) => b,
                    Err(e) => {
                        let _ = partition.ledger.lock().free(id);
                        return Err(e);
                    }
                };
                partition.routing.record(routing);
                self.record_decision(
                    &partition,
                    selection.worker,
                    &scratch.blocks,
                    scratch.chain(),
                );
                claim.install_with_session(session.into_lease());
                kv_hint = self.kv_hint(&partition, &scratch, selection.worker, id);
                self.publish_booking(&partition, &booking, binding);
            } else if let Some(id) = &selection_id {
                let retained = if partition.records_decisions {
                    scratch.blocks.clone()
                } else {
                    Vec::new()
                };
                let value = PendingSelection {
                    worker: selection.worker,
                    tracking_hashes: tracking.clone(),
                    isl,
                    effective_prefill_tokens: selection.effective_prefill_tokens,
                    expected_output_tokens: req.expected_output_tokens,
                    track_prefill: track,
                    lora_name: req.prompt.lora_name.clone(),
                    block_hashes: retained,
                    session_id: session_id.clone(),
                    routing,
                };
                let key = (
                    req.partition.model_name.clone(),
                    req.partition.routing_group.clone(),
                    id.clone(),
                );
                let dropped = self.pending.lock().insert(key, value, Instant::now());
                self.metrics
                    .pending_evictions
                    .inc_by(dropped.evicted as u64);
                self.metrics.pending_expired.inc_by(dropped.expired as u64);
                if dropped.evicted + dropped.expired > 0 {
                    // Routine (selections a router never reserved), so only at debug; the
                    // counters carry the rate.
                    tracing::debug!(
                        expired = dropped.expired,
                        evicted = dropped.evicted,
                        "pending selections dropped"
                    );
                }
            }
            Ok(SelectResponse {
                // The request's own id (or the generated one) moves into the answer; the
                // reservation index and the ledger share the claim's copy.
                selection_id,
                sequence_hashes: book.then_some(tracking),
                isl_tokens: book.then_some(isl),
                track_prefill_tokens: book.then_some(track),
                worker_load: (req.advisory && !book).then_some(selection.worker_load),
                kv_hint,
                ..response_base
            })
        });
        partition.scratch.lock().push(scratch);
        if queued {
            // This request was let out of the queue alone; now that it has booked (or
            // failed), the next waiter's gate sees the new load.
            self.recheck_queue(&partition);
        }
        outcome.map_err(Stop::Failed)
    }

    /// The KV-transfer hint of a booking (http-api §5.4, scheduling §4.8): a source
    /// rank holding a strictly longer root-aligned prefix than the chosen rank's
    /// device + host-pinned blocks, of the same hint worker type, with a control endpoint.
    fn kv_hint(
        &self,
        partition: &Partition,
        scratch: &SelectScratch,
        chosen: WorkerKey,
        id: &str,
    ) -> Option<crate::KvHint> {
        // Checked before any lock: hints name event-driven holders only.
        if !self.config.router.use_kv_events || partition.records_decisions {
            return None;
        }
        let workers = partition.workers.read();
        fn hint_type(w: &WorkerEntry) -> Option<&str> {
            w.record
                .router_hint_worker_type
                .as_deref()
                .filter(|t| !t.is_empty())
        }
        let target_type = hint_type(workers.get(&chosen.worker_id.0)?)?;
        let index = partition.index.read();
        let beat = scratch.hits.of(&workers, chosen).cpu();
        // Eligible sources with a longer prefix, best first: rows are in key order and the
        // sort is stable, so ties keep the smaller (worker, rank) first.
        let mut sources: Vec<(u32, WorkerKey, &str)> = Vec::new();
        for row in workers.rows() {
            let h = scratch.hits.of(&workers, row.key);
            let prefix = h.cpu();
            if h.worker == chosen || prefix <= beat {
                continue;
            }
            let Some(w) = workers.get(&h.worker.worker_id.0) else {
                continue;
            };
            if w.record.kv_event_source_mode.as_deref() == Some("state_agent_v2")
                || hint_type(w) != Some(target_type)
            {
                continue;
            }
            let Some(endpoint) = w
                .record
                .router_hint_source_control_endpoints
                .get(&h.worker.dp_rank.0)
                .filter(|e| !e.is_empty())
            else {
                continue;
            };
            sources.push((prefix, h.worker, endpoint.as_str()));
        }
        sources.sort_by_key(|&(prefix, _, _)| std::cmp::Reverse(prefix));
        // A source whose prefix runs past the root-aligned chain cannot be named by it
        // (§4.8 step 1 keeps only entries up to the chain's length). The chain is read in
        // the source's own hashes, which are everyone's when engines agree on them.
        let mut chain = Vec::new();
        let (prefix, endpoint) = sources.into_iter().find_map(|(prefix, key, endpoint)| {
            index.root_chain(&scratch.blocks, scratch.blocks.len(), Some(key), &mut chain);
            (prefix as usize <= chain.len()).then_some((prefix, endpoint))
        })?;
        chain.truncate(prefix as usize);
        Some(crate::KvHint {
            message_id: id.to_owned(),
            source_control_endpoint: endpoint.to_owned(),
            block_hashes: chain.into_iter().map(|h| h.0).collect(),
        })
    }

    /// Queue admission (§5): returns once the request may be scheduled. Waits on the
    /// blocking pool while every eligible rank is busy for the request's class.
    ///
    /// With a queue, the prompt is hashed and looked up here (WSPT, cached-token limits and
    /// ISL buckets need the best cached tokens) and `schedule` reuses `scratch`; after a
    /// wait of at least `overlap_refresh_after` the lookup is redone (§5.5). Without a
    /// queue this returns at once and does nothing.
    ///
    /// Without `wait`, a request that would have to queue stops with `Stop::WouldWait`
    /// instead, and nothing is queued.
    fn admit(
        &self,
        partition: &Partition,
        req: &SelectRequest,
        scratch: &mut SelectScratch,
        wait: Wait<'_>,
    ) -> Result<Admission, Stop> {
        let Some(queue) = &partition.queue else {
            return Ok(Admission::default());
        };
        // Tiered: the cached-token limits read the hits, not only the rows.
        let isl = self.lookup_overlap(partition, req, scratch, false)?;
        let workers = Arc::clone(&partition.workers.read());
        let best_cached_tokens = self
            .best_cached_tokens(partition, &workers, req, scratch)
            .min(isl);
        let classes = queue.classes();
        let classified = classes.classify(req.policy_class.as_deref(), isl - best_cached_tokens);
        if classified.unknown_explicit {
            tracing::debug!(
                policy_class = req.policy_class.as_deref().unwrap_or_default(),
                fallback = %classes.classes()[classified.index].name,
                "unknown policy class; classified by uncached ISL or the default class"
            );
        }
        let ticket = Ticket::new(req.allowed_worker_ids.clone(), req.required_taints.clone());
        // The busy gate waits for capacity, not for workers to appear: a request no rank
        // could serve is scheduled at once and fails as it does without a queue (503,
        // service-semantics §5.3), instead of waiting out the 300 s queue deadline.
        let servable = workers.values().any(|entry| {
            entry.record.dp_ranks().any(|rank| {
                let key = WorkerKey::new(entry.record.worker_id, rank);
                crate::admission::eligible_for(
                    req.pinned_worker,
                    &ticket,
                    key,
                    &entry.record.taints,
                )
            })
        });
        if !servable {
            return Ok(Admission {
                prepared_isl: Some(isl),
                queued: false,
            });
        }
        let arrival = selection_policy::Arrival {
            payload: Arc::clone(&ticket),
            class: classified.index,
            isl,
            best_cached_tokens,
            priority_jump: req.priority_jump,
            strict_priority: req.strict_priority,
            pinned: req.pinned_worker,
            advisory: false,
        };
        let offered = {
            let ledger = partition.ledger.lock();
            let gate = |class: &selection_policy::PolicyClass,
                        w: &selection_policy::Waiting<Arc<Ticket>>| {
                any_rank_free(&workers, &ledger, class, w)
            };
            if wait.allowed() {
                queue.offer(arrival, workers.len(), gate)
            } else {
                match queue.try_offer(arrival, workers.len(), gate) {
                    Ok(true) => Ok(None),
                    Ok(false) => return Err(Stop::WouldWait),
                    Err(rejected) => Err(rejected),
                }
            }
        };
        let queued = match offered {
            Ok(None) => {
                return Ok(Admission {
                    prepared_isl: Some(isl),
                    queued: false,
                });
            }
            Ok(Some(t)) => {
                self.metrics.admission_waits.inc();
                t
            }
            Err(rejected) => {
                return Err(Stop::Failed(
                    SelectionError::scheduler(429, rejected.to_string()).with_details(
                        crate::RejectionDetails {
                            policy_class: rejected.policy_class,
                            limit_kind: rejected.limit_kind.as_str().to_owned(),
                            current: rejected.current,
                            limit: rejected.limit,
                        },
                    ),
                ));
            }
        };
        let enqueued_at = Instant::now();
        if let Some(cancel) = wait.cancel() {
            cancel.watch(&queued);
        }
        let outcome = queued.wait(MAX_QUEUE_WAIT);
        if matches!(outcome, WaitOutcome::TimedOut | WaitOutcome::Cancelled) {
            queue.remove(&queued);
        }
        self.metrics.admission_wait.observe(enqueued_at.elapsed());
        match outcome {
            WaitOutcome::Admitted => {
                self.check_running()?;
                if self
                    .config
                    .overlap_refresh_after
                    .is_some_and(|after| enqueued_at.elapsed() >= after)
                    && !scratch.blocks.is_empty()
                {
                    // The index moved on while it waited; load is projected fresh anyway.
                    self.find_overlap(partition, scratch, false);
                }
                Ok(Admission {
                    prepared_isl: Some(isl),
                    queued: true,
                })
            }
            WaitOutcome::ShutDown => Err(Stop::Failed(SelectionError::scheduler(
                503,
                "endpoint subscriber shutdown",
            ))),
            WaitOutcome::TimedOut => Err(Stop::Failed(SelectionError::scheduler(
                429,
                "request deadline exceeded",
            ))),
            WaitOutcome::Cancelled => Err(Stop::Failed(caller_gone())),
        }
    }

    /// The best weighted `cached_tokens` (§3) among the ranks the request may use (pinned:
    /// the pinned rank's), from the sorted hits in `scratch`.
    fn best_cached_tokens(
        &self,
        partition: &Partition,
        workers: &BTreeMap<u64, WorkerEntry>,
        req: &SelectRequest,
        scratch: &SelectScratch,
    ) -> u64 {
        let router = &self.config.router;
        let (w_host, w_disk) = (router.host_cache_hit_weight, router.disk_cache_hit_weight);
        scratch
            .hits
            .tiered()
            .hits()
            .iter()
            .filter(|h| {
                req.pinned_worker.is_none_or(|p| p == h.worker)
                    && req
                        .allowed_worker_ids
                        .as_ref()
                        .is_none_or(|a| a.contains(&h.worker.worker_id.0))
                    && workers.get(&h.worker.worker_id.0).is_some_and(|w| {
                        w.record.has_rank(h.worker.dp_rank.0)
                            && req
                                .required_taints
                                .iter()
                                .all(|t| w.record.taints.contains(t))
                    })
            })
            .map(|h| {
                let cache = CacheInputs {
                    device_blocks: h.device,
                    host_blocks: h.host_pinned,
                    disk_blocks: h.disk_extension(),
                    shared_beyond_blocks: 0,
                };
                cached_tokens(
                    cache.effective_overlap_blocks(w_host, w_disk),
                    partition.block_size,
                )
            })
            .max()
            .unwrap_or(0)
    }

    /// Lets queued requests through after a capacity change (free, prefill completion,
    /// catalog change, periodic tick).
    pub(crate) fn recheck_queue(&self, partition: &Partition) {
        let Some(queue) = &partition.queue else {
            return;
        };
        let workers = Arc::clone(&partition.workers.read());
        let ledger = partition.ledger.lock();
        queue.drain(|class, w| any_rank_free(&workers, &ledger, class, w));
    }

    /// Holds a session for a booking, dropping bindings to departed workers (§8.3 step 1).
    /// `None` only without `wait`, when another booking is initializing the session.
    fn hold_session<'p>(
        &self,
        partition: &'p Partition,
        table: &'p SessionTable,
        sid: &str,
        now: Instant,
        wait: Wait<'_>,
    ) -> Option<SessionGuard<'p>> {
        let mesh = || {
            self.mesh()
                .filter(|m| m.session_affinity())
                .map(|m| (m, &partition.key))
        };
        for _ in 0..32 {
            match table.hold(sid, now, wait) {
                Hold::Init => {
                    return Some(SessionGuard::held(table, sid, GuardState::Init, mesh()));
                }
                Hold::Full => {
                    self.affinity_skipped(partition);
                    return Some(SessionGuard::none());
                }
                Hold::Busy => return None,
                Hold::Bound(target) if partition.schedules(target.worker_id, target.dp_rank) => {
                    let state = GuardState::Bound(target);
                    return Some(SessionGuard::held(table, sid, state, mesh()));
                }
                Hold::Bound(target) => {
                    table.release(sid, now);
                    table.invalidate(sid, target);
                }
            }
        }
        self.affinity_skipped(partition);
        Some(SessionGuard::none())
    }

    /// A session booking goes ahead without affinity: counted, and logged for the first
    /// three, then at powers of two.
    fn affinity_skipped(&self, partition: &Partition) {
        let n = self.metrics.session_affinity_skipped.inc() + 1;
        if n <= 3 || n.is_power_of_two() {
            tracing::warn!(
                partition = %partition.key.for_log(),
                occurrences = n,
                "session booked without affinity: the partition's session table is full, or \
                 the session's first booking is stuck"
            );
        }
    }

    /// Hashes the prompt into `scratch` and looks up its overlap (moved out of `schedule`
    /// so admission can do it once and `schedule` reuse it); returns the ISL. `dense_ok`:
    /// see [`SelectionCore::find_overlap`].
    fn lookup_overlap(
        &self,
        partition: &Partition,
        req: &SelectRequest,
        scratch: &mut SelectScratch,
        dense_ok: bool,
    ) -> Result<u64, SelectionError> {
        let over = &req.router_config_override;
        let isl = self.normalize_prompt(partition, &req.prompt, over, true, scratch)?;
        if let Some(pin) = req.pinned_worker
            && let Some(allowed) = &req.allowed_worker_ids
            && !allowed.contains(&pin.worker_id.0)
        {
            return Err(SelectionError::bad_request(format!(
                "pinned worker {} is not in allowed worker set",
                pin.worker_id
            )));
        }
        self.find_overlap(partition, scratch, dense_ok);
        Ok(isl)
    }

    /// The lookup of `scratch.blocks` (placed on roster rows by `schedule`): per worker slot
    /// when `dense_ok` and the index allows it, else tiered (what `tiered()` readers need).
    fn find_overlap(&self, partition: &Partition, scratch: &mut SelectScratch, dense_ok: bool) {
        scratch
            .hits
            .find(&partition.index.read(), &scratch.blocks, dense_ok);
    }

    /// Hashes, looks up, builds candidates and runs the policy.
    fn schedule(
        &self,
        partition: &Arc<Partition>,
        req: &SelectRequest,
        scratch: &mut SelectScratch,
        prepared_isl: Option<u64>,
    ) -> Result<Scheduled, SelectionError> {
        let router = &self.config.router;
        let over = &req.router_config_override;
        // Queued partitions hashed and looked up during admission (`prepared_isl`).
        let isl = match prepared_isl {
            Some(isl) => isl,
            None => self.lookup_overlap(partition, req, scratch, true)?,
        };
        let track = router.track_prefill_tokens(over);
        let workers = Arc::clone(&partition.workers.read());
        // Hits land on their candidate rows through a cached row → slot map (or, for tiered
        // hits, the roster's key map): no sort, no merge.
        scratch.hits.place(&workers);
        let session = req.session_context.as_ref();
        let mut ctx =
            SelectionContext::new(isl, partition.block_size, scratch.tracking.len() as u64);
        ctx.track_prefill_tokens = track;
        ctx.overrides = *over;
        ctx.session = session;
        ctx.policy_class = req.policy_class.as_deref();
        ctx.pinned = req.pinned_worker;
        ctx.affinity = if req.pinned_worker.is_some() {
            None
        } else {
            req.affinity_target
        };
        ctx.expected_output_tokens = req.expected_output_tokens;
        ctx.priority_jump = req.priority_jump;
        ctx.strict_priority = req.strict_priority;
        let inputs = RowInputs {
            isl,
            track,
            w_host: router.host_cache_hit_weight,
            w_disk: router.disk_cache_hit_weight,
            block_size: partition.block_size,
        };
        let unrestricted = req.allowed_worker_ids.is_none()
            && req.required_taints.is_empty()
            && req.preferred_taints.is_empty();
        let selection = if unrestricted {
            // Every roster row is a candidate: the policy reads them straight from the roster,
            // the hits and the ledger (which stays locked while it does).
            let ledger = partition.ledger.lock();
            let rows = RosterRows::<false, false> {
                inputs: &inputs,
                roster: &workers,
                hits: &scratch.hits,
                ledger: &ledger,
                tracking: &scratch.tracking,
            };
            let mut rng = partition.rng.lock();
            let policy = &partition.policy;
            if scratch.hits.is_dense() && workers.bound_to(&ledger) {
                let rows = rows.per_slot::<true>();
                policy.select_rows(&ctx, &rows, &mut scratch.policy, &mut rng)
            } else if scratch.hits.is_dense() {
                let rows = rows.per_slot::<false>();
                policy.select_rows(&ctx, &rows, &mut scratch.policy, &mut rng)
            } else {
                policy.select_rows(&ctx, &rows, &mut scratch.policy, &mut rng)
            }
        } else {
            filter_candidates(
                &inputs,
                req,
                &workers,
                &scratch.hits,
                &partition.ledger.lock(),
                &scratch.tracking,
                &mut scratch.candidates,
            );
            let mut rng = partition.rng.lock();
            partition
                .policy
                .select(&ctx, &scratch.candidates, &mut scratch.policy, &mut rng)
        }
        .map_err(policy_error)?;
        let chosen = workers.get(&selection.worker.worker_id.0).ok_or_else(|| {
            SelectionError::internal(format!(
                "selected worker {} is no longer schedulable",
                selection.worker.worker_id
            ))
        })?;
        let overlap = overlap_summary(&chosen.record, partition.block_size, |key| {
            scratch.hits.of(&workers, key)
        });
        // Routing loss: the chosen rank's device prefix against the best one among the
        // candidates the policy was offered (a pin offers one).
        let chosen_device = scratch.hits.of(&workers, selection.worker).device;
        let best_device = if req.pinned_worker.is_some() {
            chosen_device
        } else if unrestricted {
            scratch.hits.best_device()
        } else {
            scratch
                .candidates
                .iter()
                .map(|c| c.cache.device_blocks)
                .max()
                .unwrap_or(0)
        };
        let routing =
            RoutingSample::from_blocks(isl, chosen_device, best_device, partition.block_size);
        let response = SelectResponse {
            selection_id: None,
            sequence_hashes: None,
            isl_tokens: None,
            track_prefill_tokens: None,
            model_name: partition.key.model_name.clone(),
            routing_group: partition.key.routing_group.clone(),
            worker_id: selection.worker.worker_id.0,
            dp_rank: selection.worker.dp_rank.0,
            endpoint: chosen.record.endpoint.clone().unwrap_or_default(),
            block_size: partition.block_size,
            overlap,
            effective_prefill_tokens: selection.effective_prefill_tokens,
            potential_decode_blocks: selection.potential_decode_blocks,
            decode_busy: selection.decode_busy,
            worker_load: None,
            kv_hint: None,
        };
        Ok(Scheduled {
            selection,
            isl,
            track,
            response,
            routing,
        })
    }

    /// Fills `scratch.blocks` / `scratch.tracking` and returns the normalized ISL.
    fn normalize_prompt(
        &self,
        partition: &Partition,
        prompt: &PromptInput,
        over: &RouterConfigOverride,
        selection_rules: bool,
        scratch: &mut SelectScratch,
    ) -> Result<u64, SelectionError> {
        scratch.tracking_is_chain = false;
        if let Some((tokens, mm)) = prompt.routing_tokens() {
            if tokens.len() > self.config.max_prompt_tokens {
                return Err(SelectionError::new(
                    crate::ErrorKind::BadRequest,
                    413,
                    format!(
                        "prompt has {} tokens; the maximum is {}",
                        tokens.len(),
                        self.config.max_prompt_tokens
                    ),
                ));
            }
            let is_eagle = prompt.is_eagle.unwrap_or(partition.is_eagle);
            let opts = HashOptions {
                lora_name: prompt.lora_name.as_deref(),
                cache_salt: prompt.cache_salt.as_deref(),
                is_eagle,
                block_mm_infos: mm,
            };
            let reuse = self.config.router.assume_kv_reuse(over);
            if reuse && matches!(self.config.tracking, kv_types::TrackingHasher::Public) {
                // Public tracking hashes are the sequence chain of the block hashes.
                kv_types::prompt_hashes_into(
                    tokens,
                    partition.block_size,
                    &opts,
                    &mut scratch.blocks,
                    &mut scratch.tracking,
                );
                scratch.tracking_is_chain = true;
            } else if reuse {
                kv_types::block_hashes_into(
                    tokens,
                    partition.block_size,
                    &opts,
                    &mut scratch.blocks,
                );
                let scope = TrackingScope {
                    model_name: &partition.key.model_name,
                    routing_group: &partition.key.routing_group,
                    block_size: partition.block_size,
                    cache_salt: prompt.cache_salt.as_deref(),
                    lora_name: prompt.lora_name.as_deref(),
                    is_eagle,
                };
                self.config.tracking.tracking_hashes_into(
                    &scope,
                    tokens,
                    mm,
                    &scratch.blocks,
                    &mut scratch.tracking,
                );
            } else {
                kv_types::block_hashes_into(
                    tokens,
                    partition.block_size,
                    &opts,
                    &mut scratch.blocks,
                );
                scratch.tracking.clear();
                let mut rng =
                    PickRng::seeded(self.rng_seed.fetch_add(1, Ordering::Relaxed) ^ clock_seed());
                scratch
                    .tracking
                    .extend((0..scratch.blocks.len()).map(|_| SequenceHash(rng.next_u64())));
            }
            return Ok(tokens.len() as u64);
        }
        if selection_rules {
            let blocks = prompt.block_hashes.as_ref().ok_or_else(|| {
                SelectionError::bad_request("block_hashes is required without token_ids")
            })?;
            let seqs = prompt.sequence_hashes.as_ref().ok_or_else(|| {
                SelectionError::bad_request("sequence_hashes is required without token_ids")
            })?;
            let isl = prompt.isl_tokens.ok_or_else(|| {
                SelectionError::bad_request("isl_tokens is required without token_ids")
            })?;
            check_hash_only(blocks, seqs, isl)?;
            scratch.blocks.clear();
            scratch.blocks.extend(blocks.iter().map(|&h| BlockHash(h)));
            scratch.tracking.clear();
            scratch
                .tracking
                .extend(seqs.iter().map(|&h| SequenceHash(h)));
            Ok(isl)
        } else {
            let seqs = prompt.sequence_hashes.as_ref().ok_or_else(|| {
                SelectionError::bad_request("sequence_hashes is required without token_ids")
            })?;
            let isl = prompt.isl_tokens.ok_or_else(|| {
                SelectionError::bad_request("isl_tokens is required without token_ids")
            })?;
            // An index recording routing decisions needs block hashes consistent with the
            // sequence hashes; the explicit form checks that after the worker (http-api §6.1
            // step 6), see `create_reservation_inner`.
            scratch.blocks.clear();
            if let Some(blocks) = &prompt.block_hashes {
                scratch.blocks.extend(blocks.iter().map(|&h| BlockHash(h)));
            }
            scratch.tracking.clear();
            scratch
                .tracking
                .extend(seqs.iter().map(|&h| SequenceHash(h)));
            Ok(isl)
        }
    }

    /// Records a booking's blocks in approximate mode; `chain`, when known, is their
    /// sequence chain (kept out of the index's write lock).
    fn record_decision(
        &self,
        partition: &Partition,
        worker: WorkerKey,
        blocks: &[BlockHash],
        chain: Option<&[SequenceHash]>,
    ) {
        if blocks.is_empty() || !partition.records_decisions {
            return;
        }
        let mut index = partition.index.write();
        match chain {
            Some(seqs) => index.record_decision_chained(worker, blocks, seqs, Instant::now()),
            None => index.record_decision(worker, blocks, Instant::now()),
        };
    }

    // ---------------------------------------------------------------- reservations

    fn claim(&self, id: &str, partition: &Arc<Partition>) -> Result<Claim<'_>, SelectionError> {
        // Bookings past their expiry still hold rows until the periodic sweep (up to 60 s
        // later); at the limit, they are reclaimed first, at most once a second, so the
        // limit counts live reservations.
        if let Some(max) = self.config.max_active_reservations
            && self.reservations.lock().len() >= max
        {
            let now = Instant::now();
            let due = {
                let mut next = self.next_full_sweep.lock();
                let due = now >= *next;
                if due {
                    *next = now + FULL_SWEEP_EVERY;
                }
                due
            };
            if due {
                self.expire(now);
            }
        }
        let mut rows = self.reservations.lock();
        let len = rows.len();
        let rid = ReservationId::from(id);
        // One probe: the entry is the conflict check and the insert.
        let std::collections::hash_map::Entry::Vacant(slot) = rows.entry(rid.clone()) else {
            return Err(SelectionError::conflict(format!(
                "selection {id} is already reserved or being reserved"
            )));
        };
        if let Some(max) = self.config.max_active_reservations
            && len >= max
        {
            self.metrics.reservations_rejected_full.inc();
            return Err(SelectionError::new(
                crate::ErrorKind::ResourceExhausted,
                429,
                format!("active reservation limit reached (current={len}, limit={max})"),
            ));
        }
        slot.insert(ReservationRow {
            partition: Arc::clone(partition),
            state: RowState::Claimed,
            session: None,
        });
        Ok(Claim {
            core: self,
            rid,
            installed: AtomicBool::new(false),
        })
    }

    /// Books `b` in the partition's ledger (running the throttled expiry scan first).
    fn book_on(
        &self,
        partition: &Partition,
        b: &Booking<'_>,
        slot: SlotPolicy,
    ) -> Result<(), SelectionError> {
        let req = BookRequest {
            worker: b.worker,
            tracking_hashes: b.tracking,
            isl: b.isl,
            effective_prefill_tokens: b.prefill,
            track_prefill_tokens: b.track,
            expected_output_tokens: b.expected_output_tokens,
            lora_name: b.lora_name.map(Arc::from),
        };
        let now = Instant::now();
        let mut ledger = partition.ledger.lock();
        // The expiry scan visits every booking: run it on the booking path at most every
        // 30 s per partition (spec §6.7), not on every booking.
        let expired = match partition.next_expiry_check.try_lock() {
            Some(mut next) if now >= *next => {
                *next = now + EXPIRY_RECHECK;
                ledger.expire(now)
            }
            _ => Vec::new(),
        };
        let booked = ledger.book(b.id.clone(), &req, slot, now);
        drop(ledger);
        self.metrics
            .expired_reservations
            .inc_by(expired.len() as u64);
        booked.map_err(ledger_error)?;
        self.metrics.bookings.inc();
        Ok(())
    }

    /// Tells replica peers about a booking that landed (and the session binding it made).
    fn publish_booking(
        &self,
        partition: &Partition,
        b: &Booking<'_>,
        binding: Option<BindingUpdate>,
    ) {
        let Some(mesh) = self.mesh() else { return };
        let kind =
            crate::replica::admission(b.tracking, b.track, b.prefill, b.expected_output_tokens);
        let lora = b.lora_name.map(str::to_owned);
        crate::replica::publish(
            Some(&mesh),
            crate::replica::sequence_event(partition, b.id.as_str(), b.worker, lora, kind),
        );
        if let Some(update) = binding
            && mesh.session_affinity()
        {
            crate::replica::publish(
                Some(&mesh),
                crate::replica::binding_event(&partition.key, &update),
            );
        }
    }

    /// `POST /reservations`.
    pub fn create_reservation(
        &self,
        req: ReservationRequest,
    ) -> Result<ReservationResponse, SelectionError> {
        self.reserve(req, Wait::Yes(None)).done()
    }

    /// [`create_reservation`](Self::create_reservation) unless it would have to wait behind
    /// a concurrent first booking of the cached selection's session (the replay form with
    /// session affinity on; the explicit form never waits). See
    /// [`try_select_and_reserve`](Self::try_select_and_reserve).
    pub fn try_create_reservation(
        &self,
        req: ReservationRequest,
    ) -> Attempt<ReservationResponse, ReservationRequest> {
        self.reserve(req, Wait::No)
    }

    /// [`create_reservation`](Self::create_reservation) for a caller that may go away.
    pub(crate) fn create_reservation_cancellable(
        &self,
        req: ReservationRequest,
        cancel: &Cancel,
    ) -> Result<ReservationResponse, SelectionError> {
        self.reserve(req, Wait::Yes(Some(cancel))).done()
    }

    fn reserve(
        &self,
        req: ReservationRequest,
        wait: Wait<'_>,
    ) -> Attempt<ReservationResponse, ReservationRequest> {
        let Some(result) = settled(self.create_reservation_inner(&req, wait)) else {
            return Attempt::WouldWait(req);
        };
        if let Err(e) = &result {
            self.metrics
                .reject(crate::metrics::RejectedOperation::Reservation, e);
        }
        Attempt::Done(result)
    }

    fn create_reservation_inner(
        &self,
        req: &ReservationRequest,
        wait: Wait<'_>,
    ) -> Result<ReservationResponse, Stop> {
        self.check_running()?;
        let key: PendingKey = (
            req.partition.model_name.clone(),
            req.partition.routing_group.clone(),
            req.selection_id.clone(),
        );
        if req.worker_id.is_none() {
            return self.replay_reservation(req, &key, wait);
        }
        if self.pending.lock().discard(&key, Instant::now()) {
            self.metrics.pending_expired.inc();
        }
        let partition = self.ready_partition(&req.partition)?;
        let mut scratch = SelectScratch::default();
        let isl = self.normalize_prompt(
            &partition,
            &req.prompt,
            &req.router_config_override,
            false,
            &mut scratch,
        )?;
        if let Some(e) = req.effective_prefill_tokens.filter(|&e| e > isl) {
            return Err(Stop::Failed(SelectionError::bad_request(format!(
                "effective_prefill_tokens ({e}) must not exceed isl_tokens ({isl})"
            ))));
        }
        let worker_id = req.worker_id.unwrap_or_default();
        let workers = Arc::clone(&partition.workers.read());
        let Some(entry) = workers.get(&worker_id) else {
            return Err(Stop::Failed(SelectionError::not_found(format!(
                "schedulable worker {worker_id} not found for {}",
                req.partition
            ))));
        };
        if partition.records_decisions
            && req.prompt.routing_tokens().is_none()
            && let (Some(blocks), Some(seqs)) =
                (&req.prompt.block_hashes, &req.prompt.sequence_hashes)
        {
            check_hash_only(blocks, seqs, isl)?;
        }
        let worker = WorkerKey::new(worker_id, req.dp_rank.unwrap_or(0));
        let track = req.track_prefill_tokens.unwrap_or_else(|| {
            req.effective_prefill_tokens.is_some()
                || self
                    .config
                    .router
                    .track_prefill_tokens(&req.router_config_override)
        });
        let claim = self.claim(&req.selection_id, &partition)?;
        let booking = Booking {
            id: &claim.rid,
            worker,
            tracking: &scratch.tracking,
            isl,
            prefill: req.effective_prefill_tokens,
            track,
            expected_output_tokens: req.expected_output_tokens,
            lora_name: req.prompt.lora_name.as_deref(),
        };
        self.book_on(&partition, &booking, SlotPolicy::RequireRegistered)?;
        self.record_decision(&partition, worker, &scratch.blocks, scratch.chain());
        claim.install();
        self.publish_booking(&partition, &booking, None);
        Ok(ReservationResponse {
            selection_id: req.selection_id.clone(),
            model_name: partition.key.model_name.clone(),
            routing_group: partition.key.routing_group.clone(),
            worker_id,
            dp_rank: worker.dp_rank.0,
            endpoint: entry.record.endpoint.clone().unwrap_or_default(),
        })
    }

    fn replay_reservation(
        &self,
        req: &ReservationRequest,
        key: &PendingKey,
        wait: Wait<'_>,
    ) -> Result<ReservationResponse, Stop> {
        let found = self.pending.lock().get(key, Instant::now());
        let Some((cached, generation)) = found else {
            return Err(Stop::Failed(SelectionError::not_found(format!(
                "no pending selection {} for {} (expired, already used, or never selected)",
                req.selection_id, req.partition
            ))));
        };
        let partition = self.ready_partition(&req.partition)?;
        let workers = Arc::clone(&partition.workers.read());
        let worker = cached.worker;
        let entry = workers
            .get(&worker.worker_id.0)
            .filter(|w| w.record.has_rank(worker.dp_rank.0))
            .ok_or_else(|| {
                SelectionError::not_found(format!(
                    "schedulable worker {} (dp_rank {}) not found for {}",
                    worker.worker_id, worker.dp_rank, req.partition
                ))
            })?;
        let claim = self.claim(&req.selection_id, &partition)?;
        let mut session = match (partition.sessions.as_ref(), cached.session_id.as_deref()) {
            (Some(table), Some(sid)) => {
                match self.hold_session(&partition, table, sid, Instant::now(), wait) {
                    Some(held) => held,
                    // The claim's row goes with the claim; the cached selection stays.
                    None => return Err(Stop::WouldWait),
                }
            }
            _ => SessionGuard::none(),
        };
        let booking = Booking {
            id: &claim.rid,
            worker,
            tracking: &cached.tracking_hashes,
            isl: cached.isl,
            prefill: Some(cached.effective_prefill_tokens),
            track: cached.track_prefill,
            expected_output_tokens: cached.expected_output_tokens,
            lora_name: cached.lora_name.as_deref(),
        };
        self.book_on(&partition, &booking, SlotPolicy::RequireRegistered)?;
        let binding = match session.commit(worker, &partition) {
            Ok(b) => b,
            Err(e) => {
                // A session bound elsewhere consumes the cached selection (§7, §16.2).
                let _ = partition.ledger.lock().free(&req.selection_id);
                self.pending.lock().consume(key, generation);
                return Err(e.into());
            }
        };
        partition.routing.record(cached.routing);
        self.record_decision(&partition, worker, &cached.block_hashes, None);
        claim.install_with_session(session.into_lease());
        self.publish_booking(&partition, &booking, binding);
        self.pending.lock().consume(key, generation);
        Ok(ReservationResponse {
            selection_id: req.selection_id.clone(),
            model_name: partition.key.model_name.clone(),
            routing_group: partition.key.routing_group.clone(),
            worker_id: worker.worker_id.0,
            dp_rank: worker.dp_rank.0,
            endpoint: entry.record.endpoint.clone().unwrap_or_default(),
        })
    }

    fn booked_partition(&self, id: &str) -> Result<Arc<Partition>, SelectionError> {
        let rows = self.reservations.lock();
        match rows.get(id) {
            Some(ReservationRow {
                partition,
                state: RowState::Booked,
                ..
            }) => Ok(Arc::clone(partition)),
            _ => Err(SelectionError::not_found(format!(
                "reservation {id} not found"
            ))),
        }
    }

    fn forget_row(&self, id: &str) {
        let mut rows = self.reservations.lock();
        // One probe in the usual case (a booked row); a claimed row goes back.
        let Some((key, row)) = rows.remove_entry(id) else {
            return;
        };
        if matches!(row.state, RowState::Booked) {
            drop(rows);
            self.release_row_session(&row, Instant::now());
        } else {
            rows.insert(key, row);
        }
    }

    /// Maps a ledger miss to 404 and forgets the stale row.
    fn lifecycle_result<T>(
        &self,
        id: &str,
        r: Result<T, LedgerError>,
    ) -> Result<T, SelectionError> {
        r.map_err(|e| {
            if matches!(e, LedgerError::NotFound { .. }) {
                self.forget_row(id);
                SelectionError::not_found(format!("reservation {id} not found"))
            } else {
                ledger_error(e)
            }
        })
    }

    /// `POST /reservations/{id}/prefill_complete`.
    pub fn prefill_complete(&self, id: &str) -> Result<(), SelectionError> {
        let partition = self.booked_partition(id)?;
        self.check_running()?;
        let r = {
            let mut ledger = partition.ledger.lock();
            let worker = ledger.reservation(id).map(|i| i.worker);
            ledger.prefill_complete(id).map(|_| worker)
        };
        let worker = self.lifecycle_result(id, r)?;
        self.recheck_queue(&partition);
        // Re-published on repeats too, so peers that missed it converge.
        if let Some(worker) = worker {
            self.publish_replica_with(|| {
                crate::replica::sequence_event(
                    &partition,
                    id,
                    worker,
                    None,
                    replica_sync::SequenceEventKind::MarkPrefillCompleted,
                )
            });
        }
        Ok(())
    }

    /// `POST /reservations/{id}/output_block`.
    pub fn add_output_block(
        &self,
        id: &str,
        decay_fraction: Option<f64>,
    ) -> Result<(), SelectionError> {
        if let Some(f) = decay_fraction
            && !(0.0..=1.0).contains(&f)
        {
            return Err(SelectionError::bad_request(
                "decay_fraction must be between 0.0 and 1.0",
            ));
        }
        let partition = self.booked_partition(id)?;
        let r = partition.ledger.lock().output_block(id, decay_fraction);
        self.lifecycle_result(id, r)
    }

    /// `DELETE /reservations/{id}`.
    pub fn free_reservation(&self, id: &str) -> Result<(), SelectionError> {
        let partition = self.booked_partition(id)?;
        let r = partition.ledger.lock().free(id);
        let out = self.lifecycle_result(id, r);
        self.forget_row(id);
        let freed = out?;
        self.metrics.frees.inc();
        self.recheck_queue(&partition);
        self.publish_replica_with(|| {
            crate::replica::sequence_event(
                &partition,
                id,
                freed.worker,
                None,
                replica_sync::SequenceEventKind::Free,
            )
        });
        Ok(())
    }

    /// Reclaims bookings older than the expiry and drops reservation rows whose booking is
    /// gone. Returns how many bookings expired.
    pub fn expire(&self, now: Instant) -> usize {
        let partitions: Vec<Arc<Partition>> =
            self.state.read().partitions.values().cloned().collect();
        let mut expired = 0;
        for p in &partitions {
            expired += p.ledger.lock().expire(now).len();
            if let Some(t) = &p.sessions {
                t.reap(now);
            }
            p.index.write().expire(now, usize::MAX);
            self.recheck_queue(p);
        }
        let swept = self.pending.lock().sweep(now);
        self.metrics.pending_expired.inc_by(swept as u64);
        let mut rows = self.reservations.lock();
        rows.retain(|id, row| match row.state {
            RowState::Claimed => true,
            RowState::Booked => {
                let live = row.partition.ledger.lock().contains(id.as_str());
                if !live {
                    self.release_row_session(row, now);
                }
                live
            }
        });
        drop(rows);
        self.metrics.expired_reservations.inc_by(expired as u64);
        expired
    }

    /// Whether the catalog has `worker_id` registered in `partition`, in any lifecycle.
    pub(crate) fn catalog_places(&self, worker_id: u64, partition: &PartitionKey) -> bool {
        self.state
            .read()
            .records
            .get(&worker_id)
            .is_some_and(|r| r.worker.is_in(partition))
    }

    /// Applies a session binding learned from a replica peer (newer versions win).
    /// Returns false when the partition has no session table or the binding is older.
    pub fn apply_remote_binding(&self, partition: &PartitionKey, update: &BindingUpdate) -> bool {
        self.partition(partition)
            .and_then(|p| {
                p.sessions
                    .as_ref()
                    .map(|t| t.apply_remote(update, Instant::now()))
            })
            .unwrap_or(false)
    }

    /// Session bindings held across all partitions.
    pub fn session_count(&self) -> usize {
        let partitions: Vec<Arc<Partition>> =
            self.state.read().partitions.values().cloned().collect();
        partitions
            .iter()
            .filter_map(|p| p.sessions.as_ref())
            .map(SessionTable::len)
            .sum()
    }

    /// Live reservation rows (bookings and in-flight claims).
    pub fn reservation_count(&self) -> usize {
        self.reservations.lock().len()
    }

    pub fn pending_selection_count(&self) -> (usize, usize) {
        let p = self.pending.lock();
        (p.len(), p.bytes())
    }

    // ---------------------------------------------------------------- inspection

    /// `GET /loads`.
    pub fn loads(&self, model_name: Option<&str>, routing_group: Option<&str>) -> Vec<ModelLoads> {
        let partitions: Vec<Arc<Partition>> =
            self.state.read().partitions.values().cloned().collect();
        partitions
            .iter()
            .filter(|p| model_name.is_none_or(|m| p.key.model_name == m))
            .filter(|p| routing_group.is_none_or(|g| p.key.routing_group == g))
            .map(|p| {
                let ledger = p.ledger.lock();
                let mut loads: Vec<LoadRow> = ledger
                    .loads()
                    .map(|(k, l)| LoadRow {
                        worker_id: k.worker_id.0,
                        dp_rank: k.dp_rank.0,
                        potential_prefill_tokens: l.active_prefill_tokens,
                        potential_decode_blocks: l.active_decode_blocks,
                        active_requests: l.active_requests,
                    })
                    .collect();
                drop(ledger);
                loads.sort_by_key(|l| (l.worker_id, l.dp_rank));
                ModelLoads {
                    model_name: p.key.model_name.clone(),
                    routing_group: p.key.routing_group.clone(),
                    loads,
                    pending_count: p.queue.as_ref().map_or(0, |q| q.pending().0),
                    pending_isl_tokens: p.queue.as_ref().map_or(0, |q| q.pending().1),
                }
            })
            .collect()
    }

    /// `POST /potential_loads`.
    pub fn potential_loads(&self, q: &PromptQuery) -> Result<Vec<LoadRow>, SelectionError> {
        self.check_running()?;
        let partition = self.ready_partition(&q.partition)?;
        let mut scratch = SelectScratch::default();
        let isl = self.normalize_prompt(
            &partition,
            &q.prompt,
            &q.router_config_override,
            true,
            &mut scratch,
        )?;
        let router = &self.config.router;
        let track = router.track_prefill_tokens(&q.router_config_override);
        partition
            .index
            .read()
            .find_tiered(&scratch.blocks, scratch.hits.tiered_mut());
        let ledger = partition.ledger.lock();
        let mut rows: Vec<LoadRow> = ledger
            .ranks()
            .map(|k| {
                let hits = scratch.hits.tiered().get(k).copied().unwrap_or_default();
                let cache = CacheInputs {
                    device_blocks: hits.device,
                    host_blocks: hits.host_pinned,
                    disk_blocks: hits.disk_extension(),
                    shared_beyond_blocks: 0,
                };
                let cached = cached_tokens(
                    cache.effective_overlap_blocks(
                        router.host_cache_hit_weight,
                        router.disk_cache_hit_weight,
                    ),
                    partition.block_size,
                );
                let added = if track { isl - isl.min(cached) } else { 0 };
                let l = ledger.potential_load(k, &scratch.tracking, added);
                LoadRow {
                    worker_id: k.worker_id.0,
                    dp_rank: k.dp_rank.0,
                    potential_prefill_tokens: l.potential_prefill_tokens,
                    potential_decode_blocks: l.potential_decode_blocks,
                    active_requests: l.active_requests,
                }
            })
            .collect();
        drop(ledger);
        rows.sort_by_key(|l| (l.worker_id, l.dp_rank));
        Ok(rows)
    }

    /// `POST /overlap_scores`.
    pub fn overlap_scores(&self, q: &PromptQuery) -> Result<OverlapScoresResponse, SelectionError> {
        self.check_running()?;
        let partition = self.ready_partition(&q.partition)?;
        let mut scratch = SelectScratch::default();
        self.normalize_prompt(
            &partition,
            &q.prompt,
            &q.router_config_override,
            true,
            &mut scratch,
        )?;
        partition
            .index
            .read()
            .find_tiered(&scratch.blocks, scratch.hits.tiered_mut());
        let mut rows: BTreeMap<WorkerKey, TierHits> = BTreeMap::new();
        for w in partition.workers.read().values() {
            for rank in w.record.dp_ranks() {
                let key = WorkerKey::new(w.record.worker_id, rank);
                rows.insert(
                    key,
                    TierHits {
                        worker: key,
                        ..TierHits::default()
                    },
                );
            }
        }
        for h in scratch.hits.tiered().hits() {
            rows.insert(h.worker, *h);
        }
        let workers = rows
            .into_values()
            .map(|h| OverlapRow {
                worker_id: h.worker.worker_id.0,
                dp_rank: h.worker.dp_rank.0,
                device_blocks: h.device,
                host_pinned_blocks: h.cpu(),
                disk_blocks: h.disk_cumulative(),
                host_pinned_extension_blocks: h.host_pinned,
                disk_extension_blocks: h.disk_extension(),
            })
            .collect();
        Ok(OverlapScoresResponse {
            block_size: partition.block_size,
            num_blocks: scratch.blocks.len(),
            workers,
        })
    }

    /// The `/dump` content: per partition, its block size and the snapshot operations.
    pub fn index_snapshot(&self) -> Vec<(PartitionKey, u32, Vec<KvOperation>)> {
        let partitions: Vec<Arc<Partition>> =
            self.state.read().partitions.values().cloned().collect();
        partitions
            .iter()
            .map(|p| {
                (
                    p.key.clone(),
                    p.block_size,
                    p.index.read().snapshot_operations(),
                )
            })
            .collect()
    }

    /// The `/dump` body: every partition's snapshot in the recovery format
    /// (`spec/replica-sync.md` §9.1), serialized once here by the owner of the index.
    pub fn dump_json(&self) -> Result<Vec<u8>, SelectionError> {
        let dump: kv_index::snapshot::Dump = self
            .index_snapshot()
            .into_iter()
            .map(|(key, block_size, events)| {
                (
                    format!("{}:{}", key.model_name, key.routing_group),
                    kv_index::snapshot::PartitionDump::Snapshot { block_size, events },
                )
            })
            .collect();
        kv_index::snapshot::encode_dump(&dump).map_err(|e| SelectionError::internal(e.to_string()))
    }

    /// Startup recovery: applies a peer's `/dump` body. Partitions are created with the
    /// dumped block size; the first worker to join one sets its block size and Eagle flag
    /// and keeps the recovered index (a mismatch is logged). Returns the number of
    /// operations applied.
    ///
    /// The peer fails (`Err`, the caller tries the next) as replica-sync §9.2 says: a body
    /// with an `{"error": ...}` entry before anything is applied; a key without `:` when
    /// it is reached, leaving the entries applied before it in place.
    pub fn restore_from_dump(&self, bytes: &[u8]) -> Result<usize, SelectionError> {
        use kv_index::snapshot::PartitionDump;
        let dump =
            kv_index::snapshot::decode_dump(bytes, &kv_index::snapshot::DecodeLimits::default())
                .map_err(|e| SelectionError::bad_request(format!("invalid snapshot: {e}")))?;
        if let Some((key, message)) = dump.iter().find_map(|(key, part)| match part {
            PartitionDump::Error { message } => Some((key, message)),
            _ => None,
        }) {
            return Err(SelectionError::bad_request(format!(
                "invalid snapshot: partition {key:?} is an error entry: {message}"
            )));
        }
        let mut applied = 0;
        for (key, part) in dump {
            let PartitionDump::Snapshot { block_size, events } = part else {
                continue;
            };
            let Some((model, group)) = kv_index::snapshot::split_partition_key(&key) else {
                return Err(SelectionError::bad_request(format!(
                    "invalid snapshot: partition key {key:?} has no ':' (after {applied} \
                     operations applied)"
                )));
            };
            self.restore_partition(PartitionKey::new(model, group), block_size, &events)?;
            applied += events.len();
        }
        Ok(applied)
    }

    /// Applies recovered operations (from a peer's `/dump`) to a partition. A missing
    /// partition is created with the dump's block size until its first worker says
    /// otherwise; an existing one is used whatever its block size (logged), as
    /// replica-sync §9.2 says.
    pub fn restore_partition(
        &self,
        key: PartitionKey,
        block_size: u32,
        ops: &[KvOperation],
    ) -> Result<(), SelectionError> {
        if block_size == 0 {
            return Err(SelectionError::bad_request(format!(
                "invalid snapshot: partition {key} has block_size 0"
            )));
        }
        let p = {
            let mut state = self.state.write();
            match state.partitions.get(&key) {
                Some(p) => {
                    if p.block_size != block_size {
                        tracing::warn!(
                            partition = %key.for_log(),
                            block_size = p.block_size,
                            dump_block_size = block_size,
                            "recovering into an existing partition with another block size"
                        );
                    }
                    Arc::clone(p)
                }
                None => {
                    let p = Arc::new(self.new_partition(key.clone(), block_size, false));
                    p.adoptable.store(true, Ordering::Release);
                    state.partitions.insert(key, Arc::clone(&p));
                    p
                }
            }
        };
        let mut index = p.index.write();
        for op in ops {
            index.apply(op);
        }
        Ok(())
    }

    /// Every partition, for scrape-time metrics.
    pub(crate) fn partition_list(&self) -> Vec<Arc<Partition>> {
        self.state.read().partitions.values().cloned().collect()
    }

    /// Event-application counters per partition.
    pub fn index_counters(&self) -> Vec<(PartitionKey, kv_index::ApplyCounters)> {
        let partitions: Vec<Arc<Partition>> =
            self.state.read().partitions.values().cloned().collect();
        partitions
            .iter()
            .map(|p| (p.key.clone(), p.index.read().counters()))
            .collect()
    }

    /// Applies normalized engine events to a partition's index: the same path the ZMQ
    /// listeners feed (for embedding hosts that receive events by other means, and replay).
    pub fn apply_events(&self, partition: &PartitionKey, ops: &[KvOperation]) {
        let Some(p) = self.partition(partition) else {
            return;
        };
        for op in ops {
            // Short write sections, unlocked fairly: a lookup waits behind at most one piece
            // of one event, never behind a whole batch or a writer that re-locks at once.
            kv_index::apply_fairly(&p.index, op);
        }
    }
}

impl IngressSink for std::sync::Weak<SelectionCore> {
    fn apply(&self, partition: &PartitionKey, ops: &[KvOperation]) {
        if let Some(core) = self.upgrade() {
            core.apply_events(partition, ops);
        }
    }
}

/// One booking's inputs, as the ledger and the replica peers both need them.
struct Booking<'a> {
    /// The id as the claim allocated it (the ledger books under a clone of it).
    id: &'a ReservationId,
    worker: WorkerKey,
    tracking: &'a [SequenceHash],
    isl: u64,
    /// Prefill tokens to charge (when tracked and > 0).
    prefill: Option<u64>,
    track: bool,
    expected_output_tokens: Option<u32>,
    lora_name: Option<&'a str>,
}

/// An id claimed in the reservation index; released on drop unless installed.
struct Claim<'a> {
    core: &'a SelectionCore,
    /// The id, as the index keys it and the ledger books it.
    rid: ReservationId,
    installed: AtomicBool,
}

impl Claim<'_> {
    fn install(&self) {
        self.install_with_session(None);
    }

    fn install_with_session(&self, session: Option<String>) {
        if let Some(row) = self.core.reservations.lock().get_mut(&self.rid) {
            row.state = RowState::Booked;
            row.session = session;
        }
        self.installed.store(true, Ordering::Relaxed);
    }
}

/// A session held by an in-flight booking: abandons an uncommitted initialization or
/// releases an unused lease when dropped on an error path.
/// The result of an operation asked not to wait.
#[derive(Debug)]
#[must_use]
pub enum Attempt<T, R> {
    /// It ran, without waiting (and succeeded or failed).
    Done(Result<T, SelectionError>),
    /// It would have waited; the request, unchanged, for a caller that may block. Nothing
    /// was booked, claimed or counted.
    WouldWait(R),
}

impl<T, R> Attempt<T, R> {
    /// The outcome of a call that was allowed to wait, which never stops early.
    fn done(self) -> Result<T, SelectionError> {
        match self {
            Self::Done(r) => r,
            Self::WouldWait(_) => Err(SelectionError::internal(
                "an operation allowed to wait stopped as if it would wait",
            )),
        }
    }
}

/// Why a selection ended without a response.
enum Stop {
    Failed(SelectionError),
    WouldWait,
}

impl From<SelectionError> for Stop {
    fn from(e: SelectionError) -> Self {
        Self::Failed(e)
    }
}

/// The outcome of a step that ran, or `None` when it stopped to avoid waiting.
fn settled<T>(r: Result<T, Stop>) -> Option<Result<T, SelectionError>> {
    match r {
        Ok(v) => Some(Ok(v)),
        Err(Stop::Failed(e)) => Some(Err(e)),
        Err(Stop::WouldWait) => None,
    }
}

/// What a selection may take from or change in its request before it stops to avoid
/// waiting: whether the caller named the selection id, and the affinity target the
/// session code may overwrite.
#[derive(Clone, Copy)]
struct Taken {
    caller_id: bool,
    affinity: Option<selection_policy::AffinityTarget>,
}

impl From<&SelectRequest> for Taken {
    fn from(req: &SelectRequest) -> Self {
        Taken {
            caller_id: req.selection_id.is_some(),
            affinity: req.affinity_target,
        }
    }
}

impl Taken {
    /// Puts the request back as it came (a generated `selection_id` is dropped, the
    /// caller's restored) and answers the stop for waiting.
    fn give_back(self, req: &mut SelectRequest, selection_id: Option<String>) -> Stop {
        req.selection_id = selection_id.filter(|_| self.caller_id);
        req.affinity_target = self.affinity;
        Stop::WouldWait
    }
}

struct SessionGuard<'p> {
    table: Option<&'p SessionTable>,
    sid: String,
    state: GuardState,
    /// Where a hold released unused (a failed booking) republishes its binding, as a
    /// released reservation lease does (replica-sync §7.2): replica sync with affinity on.
    mesh: Option<(Arc<replica_sync::ReplicaMesh>, &'p PartitionKey)>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum GuardState {
    Idle,
    Init,
    Bound(SessionTarget),
    /// Committed: the lease now belongs to the reservation row.
    Leased,
}

impl<'p> SessionGuard<'p> {
    fn none() -> Self {
        Self {
            table: None,
            sid: String::new(),
            state: GuardState::Idle,
            mesh: None,
        }
    }

    fn held(
        table: &'p SessionTable,
        sid: &str,
        state: GuardState,
        mesh: Option<(Arc<replica_sync::ReplicaMesh>, &'p PartitionKey)>,
    ) -> Self {
        Self {
            table: Some(table),
            sid: sid.to_owned(),
            state,
            mesh,
        }
    }

    fn bound_target(&self) -> Option<SessionTarget> {
        match self.state {
            GuardState::Bound(t) => Some(t),
            _ => None,
        }
    }

    /// Binds (or checks the binding against) the booked worker and rank.
    fn commit(
        &mut self,
        booked: WorkerKey,
        partition: &Partition,
    ) -> Result<Option<BindingUpdate>, SelectionError> {
        let Some(table) = self.table else {
            return Ok(None);
        };
        // A bound target that departed while this request was scheduled is re-acquired
        // without waiting, at most twice (§8.3 item 4).
        for attempt in 0..3 {
            let held = match self.state {
                GuardState::Init => {
                    let target = SessionTarget {
                        worker_id: booked.worker_id.0,
                        dp_rank: Some(booked.dp_rank.0),
                    };
                    let update = table.commit_init(&self.sid, target, Instant::now());
                    self.state = GuardState::Leased;
                    return Ok(Some(update));
                }
                GuardState::Bound(held) => held,
                GuardState::Idle | GuardState::Leased => return Ok(None),
            };
            match table.commit_bound(&self.sid, booked) {
                Ok(update) => {
                    self.state = GuardState::Leased;
                    return Ok(Some(update));
                }
                Err(message) => {
                    // The binding (and with it our lease) is gone.
                    self.state = GuardState::Idle;
                    if partition.schedules(held.worker_id, held.dp_rank) {
                        return Err(SelectionError::bad_request(message));
                    }
                    if attempt == 2 {
                        return Ok(None);
                    }
                    // A fresh hold binds the booked target; another request's new binding
                    // must agree with it; another initializer or a full table leaves the
                    // booking without a binding.
                    self.state = match table.hold(&self.sid, Instant::now(), Wait::No) {
                        Hold::Init => GuardState::Init,
                        Hold::Bound(target) => GuardState::Bound(target),
                        Hold::Busy | Hold::Full => return Ok(None),
                    };
                }
            }
        }
        Ok(None)
    }

    /// Hands the committed lease to the reservation row.
    fn into_lease(mut self) -> Option<String> {
        if self.state == GuardState::Leased {
            self.state = GuardState::Idle;
            Some(std::mem::take(&mut self.sid))
        } else {
            None
        }
    }
}

impl Drop for SessionGuard<'_> {
    fn drop(&mut self) {
        let Some(table) = self.table else { return };
        match self.state {
            GuardState::Init => table.abandon(&self.sid),
            GuardState::Bound(_) | GuardState::Leased => {
                if let (Some(update), Some((mesh, key))) =
                    (table.release(&self.sid, Instant::now()), &self.mesh)
                {
                    crate::replica::publish(
                        Some(mesh),
                        crate::replica::binding_event(key, &update),
                    );
                }
            }
            GuardState::Idle => {}
        }
    }
}

fn check_session_id(sid: &str) -> Result<(), SelectionError> {
    if sid.len() > MAX_SESSION_ID_BYTES {
        return Err(SelectionError::bad_request(
            "session affinity ID must not exceed 256 bytes",
        ));
    }
    Ok(())
}

fn affinity(target: SessionTarget) -> selection_policy::AffinityTarget {
    selection_policy::AffinityTarget {
        worker_id: WorkerId(target.worker_id),
        dp_rank: target.dp_rank.map(kv_types::DpRank),
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if !self.installed.load(Ordering::Relaxed) {
            let mut rows = self.core.reservations.lock();
            if matches!(
                rows.get(&self.rid),
                Some(ReservationRow {
                    state: RowState::Claimed,
                    ..
                })
            ) {
                rows.remove(&self.rid);
            }
        }
    }
}

/// Per-request constants of the candidate rows.
struct RowInputs {
    isl: u64,
    track: bool,
    w_host: f64,
    w_disk: f64,
    block_size: u32,
}

impl RowInputs {
    /// The candidate of roster row `row`: its hits for this request and its rank's load
    /// with this request added. `BOUND`: the roster's ledger slots hold their ranks
    /// ([`Roster::bound_to`]), so the load is read without a key check.
    #[inline(always)]
    fn candidate<const BOUND: bool>(
        &self,
        rr: &RosterRow,
        hits: TierHits,
        ledger: &Ledger,
        tracking: &[SequenceHash],
        taint_weight: f32,
    ) -> Candidate {
        let cache = CacheInputs {
            device_blocks: hits.device,
            host_blocks: hits.host_pinned,
            disk_blocks: hits.disk_extension(),
            shared_beyond_blocks: 0,
        };
        let added = if self.track {
            let cached = cache.cached_tokens(self.w_host, self.w_disk, self.block_size);
            self.isl - self.isl.min(cached)
        } else {
            0
        };
        let load = match rr.ledger_slot {
            Some(slot) if BOUND => ledger.potential_load_bound(slot, rr.key, tracking, added),
            hint => ledger.potential_load_at(hint, rr.key, tracking, added),
        };
        Candidate {
            worker: rr.key,
            cache,
            load: Some(LoadInputs {
                active_prefill_tokens: load.active_prefill_tokens,
                potential_decode_blocks: load.potential_decode_blocks,
                active_requests: load.active_requests,
            }),
            capacity: rr.capacity,
            preferred_taint_multiplier: preferred_taint_multiplier(taint_weight),
        }
    }
}

/// Every roster row as a candidate, built when the policy reads it. `DENSE`: the hits
/// are in the per-slot form ([`RowHits::is_dense`]), read without checking which form.
/// `BOUND`: the roster's ledger slots hold their ranks ([`Roster::bound_to`]).
struct RosterRows<'a, const DENSE: bool, const BOUND: bool> {
    inputs: &'a RowInputs,
    roster: &'a Roster,
    hits: &'a RowHits,
    ledger: &'a Ledger,
    tracking: &'a [SequenceHash],
}

impl<'a> RosterRows<'a, false, false> {
    /// The same rows read through the per-slot hits (the caller checked
    /// [`RowHits::is_dense`]) and, with `BOUND`, through ledger slots without key checks
    /// (the caller checked [`Roster::bound_to`] under the ledger lock it holds).
    fn per_slot<const BOUND: bool>(&self) -> RosterRows<'a, true, BOUND> {
        RosterRows {
            inputs: self.inputs,
            roster: self.roster,
            hits: self.hits,
            ledger: self.ledger,
            tracking: self.tracking,
        }
    }
}

impl<const DENSE: bool, const BOUND: bool> CandidateRows for RosterRows<'_, DENSE, BOUND> {
    fn len(&self) -> usize {
        self.roster.rows().len()
    }

    #[inline(always)]
    fn row(&self, i: usize) -> Candidate {
        let rr = &self.roster.rows()[i];
        let hits = if DENSE {
            TierHits {
                worker: rr.key,
                device: self.hits.dense_depth(i),
                ..TierHits::default()
            }
        } else {
            self.hits.at(i, rr.key)
        };
        self.inputs
            .candidate::<BOUND>(rr, hits, self.ledger, self.tracking, 0.0)
    }

    /// Per-slot hits are device hits only, and these rows carry no taint weight.
    fn device_only(&self) -> bool {
        DENSE
    }
}

/// The candidates a request's allow-list and required taints admit, with their
/// preferred-taint weights.
fn filter_candidates(
    inputs: &RowInputs,
    req: &SelectRequest,
    roster: &Roster,
    hits: &RowHits,
    ledger: &Ledger,
    tracking: &[SequenceHash],
    out: &mut Vec<Candidate>,
) {
    out.clear();
    let taint_rules = !req.required_taints.is_empty() || !req.preferred_taints.is_empty();
    for (row, rr) in roster.rows().iter().enumerate() {
        let key = rr.key;
        if req
            .allowed_worker_ids
            .as_ref()
            .is_some_and(|a| !a.contains(&key.worker_id.0))
        {
            continue;
        }
        let mut taint_weight = 0.0_f32;
        if taint_rules {
            let taints: &[String] = match roster.get(&key.worker_id.0) {
                Some(w) if rr.tainted => &w.record.taints,
                _ => &[],
            };
            if !req.required_taints.iter().all(|t| taints.contains(t)) {
                continue;
            }
            taint_weight = req
                .preferred_taints
                .iter()
                .filter(|(t, _)| taints.contains(t))
                .map(|(_, w)| *w)
                .sum();
        }
        out.push(inputs.candidate::<false>(
            rr,
            hits.at(row, rr.key),
            ledger,
            tracking,
            taint_weight,
        ));
    }
}

fn check_partition(p: &Partition, block_size: u32, is_eagle: bool) -> Result<(), String> {
    if p.block_size != block_size {
        return Err(format!(
            "block_size mismatch for {}: existing={} requested={block_size}",
            p.key, p.block_size
        ));
    }
    if p.is_eagle != is_eagle {
        return Err(format!(
            "is_eagle mismatch for {}: existing={} requested={is_eagle}",
            p.key, p.is_eagle
        ));
    }
    Ok(())
}

/// What a waiting operation ends with when its caller went away (nobody reads it; it
/// counts under `caller_gone`). 499 is the de facto "client closed request" status.
fn caller_gone() -> SelectionError {
    SelectionError::scheduler(499, "the caller went away while the request waited")
}

fn check_hash_only(blocks: &[u64], seqs: &[u64], isl: u64) -> Result<(), SelectionError> {
    if isl == 0 {
        return Err(SelectionError::bad_request(
            "isl_tokens must be greater than 0",
        ));
    }
    if blocks.len() != seqs.len() {
        return Err(SelectionError::bad_request(format!(
            "block_hashes length {} must match sequence_hashes length {}",
            blocks.len(),
            seqs.len()
        )));
    }
    Ok(())
}

fn session_of(req: &SelectRequest) -> Option<String> {
    if req.pinned_worker.is_some() || req.affinity_target.is_some() {
        return None;
    }
    match &req.session_context {
        Some(c) => Some(c.session_id().to_owned()),
        None => req.session_id.clone(),
    }
}

fn overlap_summary(
    worker: &WorkerRequest,
    block_size: u32,
    hits_of: impl Fn(WorkerKey) -> TierHits,
) -> OverlapSummary {
    let tokens = |blocks: u32| -> u32 {
        u32::try_from(u64::from(blocks) * u64::from(block_size)).unwrap_or(u32::MAX)
    };
    let mut s = OverlapSummary::default();
    for rank in worker.dp_ranks() {
        let key = WorkerKey::new(worker.worker_id, rank);
        let h = hits_of(key);
        s.dp.insert(rank, tokens(h.device));
        s.gpu = s.gpu.max(tokens(h.gpu()));
        s.cpu = s.cpu.max(tokens(h.cpu()));
        s.disk = s.disk.max(tokens(h.disk_cumulative()));
    }
    s.longest_matched = s.gpu.max(s.cpu).max(s.disk);
    s
}

fn policy_error(e: PolicyError) -> SelectionError {
    match e {
        PolicyError::NoCandidates | PolicyError::PinnedNotCandidate { .. } => {
            SelectionError::scheduler(503, "no endpoints available to route work")
        }
        PolicyError::AllFiltered => {
            SelectionError::scheduler(503, "all eligible workers were rejected by policy filters")
        }
        other => SelectionError::scheduler(500, other.to_string()),
    }
}

fn ledger_error(e: LedgerError) -> SelectionError {
    match e {
        LedgerError::DuplicateReservation { .. } => SelectionError::sequence(409, e.to_string()),
        LedgerError::NotFound { .. } => SelectionError::sequence(404, e.to_string()),
        LedgerError::UnknownRank { worker } => {
            SelectionError::sequence(404, format!("{worker} not found"))
        }
        LedgerError::InvalidDecayFraction { .. } | LedgerError::PrefillExceedsIsl { .. } => {
            SelectionError::bad_request(e.to_string())
        }
        other => SelectionError::internal(other.to_string()),
    }
}

fn index_config(router: &RouterConfig) -> IndexConfig {
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
fn records_decisions(index: &KvIndex) -> bool {
    index.is_approximate() || index.has_side_index()
}

fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0x5EED)
}

/// A random UUIDv4 string (lowercase, hyphenated) for generated selection ids.
fn new_uuid_v4(seed: &AtomicU64) -> String {
    let mut rng =
        PickRng::seeded(seed.fetch_add(0xA076_1D64_78BD_642F, Ordering::Relaxed) ^ clock_seed());
    let hi = rng.next_u64();
    let lo = rng.next_u64();
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&hi.to_be_bytes());
    b[8..].copy_from_slice(&lo.to_be_bytes());
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// The queue gate: does the waiting request have an eligible rank that is not busy?
/// The queue gate: whether `w` may go now. It may when one of its eligible ranks is not
/// busy, and also when it has no eligible rank left at all (its workers were deleted while
/// it waited): the queue waits for capacity, not for workers, so such a request is let go
/// to fail with 503 as it would on arrival (scheduling §5.4), not after the 300 s deadline.
fn any_rank_free(
    workers: &BTreeMap<u64, WorkerEntry>,
    ledger: &Ledger,
    class: &selection_policy::PolicyClass,
    w: &selection_policy::Waiting<Arc<Ticket>>,
) -> bool {
    let mut any_eligible = false;
    let free = workers.values().any(|entry| {
        entry.record.dp_ranks().any(|rank| {
            let key = WorkerKey::new(entry.record.worker_id, rank);
            eligible(w, key, &entry.record.taints) && {
                any_eligible = true;
                let active = ledger.load(key).map_or(0, |l| l.active_prefill_tokens);
                !class.is_busy(active, entry.record.max_num_batched_tokens)
            }
        })
    });
    free || !any_eligible
}
