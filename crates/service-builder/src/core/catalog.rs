//! Worker catalog mutations and the partition lifecycle: upserts, patches, deletes,
//! partition creation and the schedulable roster each partition publishes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use kv_index::{IndexCell, KvIndex};
use kv_types::{WorkerId, WorkerKey};
use load_accounting::{Ledger, LedgerConfig};
use parking_lot::{Mutex, RwLock};
use selection_policy::{PickRng, Policy, PoolLabel};

use super::partition::{CapacityLog, Partition, index_config, records_decisions};
use super::{SelectionCore, clock_seed, no_schedulable};
use crate::admission::PartitionQueue;
use crate::catalog::{
    Lifecycle, MAX_DATA_PARALLEL_SIZE, PartitionKey, WorkerCatalogRecord, WorkerPatch,
    WorkerRequest,
};
use crate::error::SelectionError;
use crate::request::ReadyResponse;
use crate::roster::{Roster, WorkerEntry};
use crate::routing_stats::RoutingStats;
use crate::session::SessionTable;

pub(super) fn check_partition(
    p: &Partition,
    block_size: u32,
    is_eagle: bool,
) -> Result<(), String> {
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

/// Bounds every rank of `record` in the partition's index by its `total_kv_blocks` (0 or
/// absent: no bound), after the listeners were reconciled (a restarted rank starts from an
/// empty state without one). Event-fed partitions only: an approximate index is bounded by
/// its TTL.
fn declare_capacity(p: &Partition, record: &WorkerRequest) {
    let blocks = record
        .total_kv_blocks
        .filter(|&n| n > 0)
        .map(|n| u32::try_from(n).unwrap_or(u32::MAX));
    if blocks.is_some() {
        p.capacity_declared.store(true, Ordering::Relaxed);
    } else if !p.capacity_declared.load(Ordering::Relaxed) {
        // Nothing here was ever bounded: nothing to withdraw, no write lock to take.
        return;
    }
    let evicted = p.index.write(|index| {
        record
            .dp_ranks()
            .map(|rank| {
                u64::from(index.set_capacity(WorkerKey::new(record.worker_id, rank), blocks))
            })
            .sum::<u64>()
    });
    if evicted > 0 {
        tracing::warn!(
            worker_id = record.worker_id,
            partition = %p.key.for_log(),
            total_kv_blocks = blocks,
            evicted,
            "the worker's ranks held more blocks than its total_kv_blocks: the oldest were \
             evicted from the index"
        );
    }
}

impl SelectionCore {
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

    pub(super) fn upsert_locked(
        &self,
        record: WorkerRequest,
    ) -> Result<WorkerCatalogRecord, SelectionError> {
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
        if let (true, Some(p)) = (reasons.is_empty() && use_kv_events, &partition) {
            declare_capacity(p, &record);
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

    pub(super) fn ensure_partition_for(&self, r: &WorkerRequest) -> Result<Arc<Partition>, String> {
        self.partition_or_create(
            r.partition(),
            r.block_size.unwrap_or(0),
            r.is_eagle.unwrap_or(false),
        )
    }

    /// The partition `key` for a worker (or an embedding host) with this block size and
    /// Eagle flag, created if missing. A partition only recovery has created so far takes
    /// them over, keeping its index (replica-sync §9.2: the mismatch is only logged).
    pub(super) fn partition_or_create(
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
            let adopted = self.new_partition(key.clone(), block_size, is_eagle);
            p.index
                .move_into(&adopted.index, || KvIndex::with_block_size(p.block_size));
            state.partitions.insert(key, Arc::clone(&adopted));
            return Ok(adopted);
        }
        let p = self.new_partition(key.clone(), block_size, is_eagle);
        state.partitions.insert(key, Arc::clone(&p));
        Ok(p)
    }

    pub(super) fn new_partition(
        &self,
        key: PartitionKey,
        block_size: u32,
        is_eagle: bool,
    ) -> Arc<Partition> {
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
        let origin = Instant::now();
        let make = || KvIndex::new(&icfg, origin);
        let (copies, step_aside) = (
            self.config.kv_index_copies,
            self.config.kv_writer_step_aside,
        );
        let index = IndexCell::with_writer(copies, self.config.kv_index_writer, step_aside, make)
            .unwrap_or_else(|e| {
                tracing::warn!(
                    partition = %key.for_log(),
                    error = %e,
                    "cannot start the index writer thread; the listeners write the index"
                );
                IndexCell::new(copies, step_aside, make)
            });
        let records_decisions = records_decisions(&index.read_whole());
        Arc::new_cyclic(|me| {
            let me = me.clone();
            index.after_each_threaded_batch(Box::new(move |index, batch| {
                if let Some(p) = me.upgrade() {
                    super::ingest::after_threaded_batch(&p, index, batch);
                }
            }));
            Partition {
                key,
                block_size,
                is_eagle,
                records_decisions,
                index,
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
                capacity_declared: AtomicBool::new(false),
                capacity_log: Mutex::new(CapacityLog::default()),
            }
        })
    }

    /// Republishes the schedulable worker map of a partition after worker `changed` was
    /// upserted or removed, and reconciles its ledger slots synchronously (so a booking
    /// right after registration never misses its rank). Callers hold `catalog_mutation`, so
    /// the previous map is current except for `changed`: copying it (shared records) and
    /// updating one entry keeps a registration cheap with thousands of workers.
    pub(super) fn publish(&self, key: &PartitionKey, changed: u64) {
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
    pub(super) fn detach(&self, record: &WorkerRequest) {
        self.ingress.detach_worker(WorkerId(record.worker_id));
        if let Some(p) = self.partition(&record.partition()) {
            p.index
                .write(|index| index.remove_worker(WorkerId(record.worker_id)));
        }
    }

    pub(crate) fn partition(&self, key: &PartitionKey) -> Option<Arc<Partition>> {
        self.state.read().partitions.get(key).cloned()
    }

    pub(super) fn ready_partition(
        &self,
        key: &PartitionKey,
    ) -> Result<Arc<Partition>, SelectionError> {
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

    /// Whether the catalog has `worker_id` registered in `partition`, in any lifecycle.
    pub(crate) fn catalog_places(&self, worker_id: u64, partition: &PartitionKey) -> bool {
        self.state
            .read()
            .records
            .get(&worker_id)
            .is_some_and(|r| r.worker.is_in(partition))
    }

    /// Every partition, for scrape-time metrics.
    pub(crate) fn partition_list(&self) -> Vec<Arc<Partition>> {
        self.state.read().partitions.values().cloned().collect()
    }
}
