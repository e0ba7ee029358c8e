//! Read-only views (loads, potential loads, overlap scores, counts) and the index
//! dump and restore.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use kv_index::TierHits;
use kv_types::{KvOperation, WorkerKey};
use selection_policy::{CacheInputs, cached_tokens};

use super::SelectionCore;
use super::partition::{Partition, SelectScratch};
use crate::catalog::PartitionKey;
use crate::error::SelectionError;
use crate::request::{LoadRow, ModelLoads, OverlapRow, OverlapScoresResponse, PromptQuery};
use crate::session::SessionTable;

impl SelectionCore {
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
                    p.index.read_whole().snapshot_operations(),
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
                    let p = self.new_partition(key.clone(), block_size, false);
                    p.adoptable.store(true, Ordering::Release);
                    state.partitions.insert(key, Arc::clone(&p));
                    p
                }
            }
        };
        p.index.write(|index| {
            for op in ops {
                index.apply(op);
            }
        });
        Ok(())
    }

    /// Event-application counters per partition.
    pub fn index_counters(&self) -> Vec<(PartitionKey, kv_index::ApplyCounters)> {
        let partitions: Vec<Arc<Partition>> =
            self.state.read().partitions.values().cloned().collect();
        partitions
            .iter()
            .map(|p| (p.key.clone(), p.index.read_whole().counters()))
            .collect()
    }
}
