//! Replica sync, service side (`spec/replica-sync.md` §4–§7): what this replica publishes
//! after its own bookings, and how events from peers are applied.
//!
//! Peer events are applied on the mesh's receiver thread: each is one short ledger or
//! session-table operation, so no extra queue is needed to keep the receiver responsive.
//! Every dropped event is counted by reason.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kv_types::{SequenceHash, WorkerKey};
use load_accounting::{BookRequest, LedgerError, ReservationId};
use replica_sync::{
    Admission, PrefillLoadHint, ReplicaEvent, ReplicaMesh, ReplicaSink, RouterId, SequenceEvent,
    SequenceEventKind, SessionBinding,
};

use crate::catalog::PartitionKey;
use crate::core::{Partition, SelectionCore};
use crate::session::{BindingUpdate, SessionTarget};

/// Counters of peer events that were not applied, by reason.
#[derive(Debug, Default)]
pub struct ReplicaApplyStats {
    pub applied: AtomicU64,
    pub unknown_partition: AtomicU64,
    pub block_size_mismatch: AtomicU64,
    pub unknown_worker: AtomicU64,
    pub duplicate_request: AtomicU64,
    pub not_live: AtomicU64,
    pub affinity_disabled: AtomicU64,
    pub stale_binding: AtomicU64,
    /// A binding whose session id is over the 256-byte limit.
    pub invalid_session: AtomicU64,
}

impl ReplicaApplyStats {
    /// `(reason, count)` rows of dropped events.
    pub fn dropped_rows(&self) -> [(&'static str, u64); 8] {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        [
            ("unknown_partition", g(&self.unknown_partition)),
            ("block_size_mismatch", g(&self.block_size_mismatch)),
            ("unknown_worker", g(&self.unknown_worker)),
            ("duplicate_request", g(&self.duplicate_request)),
            ("not_live", g(&self.not_live)),
            ("affinity_disabled", g(&self.affinity_disabled)),
            ("stale_binding", g(&self.stale_binding)),
            ("invalid_session", g(&self.invalid_session)),
        ]
    }
}

/// Delivers peer events into the core (held weakly: the mesh must not keep it alive).
pub(crate) struct CoreSink(pub(crate) std::sync::Weak<SelectionCore>);

impl ReplicaSink for CoreSink {
    fn on_event(&self, event: ReplicaEvent) {
        if let Some(core) = self.0.upgrade() {
            core.apply_replica_event(event);
        }
    }
}

/// What the core publishes; `None` mesh = replica sync disabled.
pub(crate) fn publish(mesh: Option<&Arc<ReplicaMesh>>, event: ReplicaEvent) {
    if let Some(mesh) = mesh {
        let outcome = mesh.publish(&event);
        if !matches!(outcome, replica_sync::PublishOutcome::Queued) {
            tracing::debug!(?outcome, "replica event not queued");
        }
    }
}

pub(crate) fn sequence_event(
    partition: &Partition,
    id: &str,
    worker: WorkerKey,
    lora_name: Option<String>,
    kind: SequenceEventKind,
) -> ReplicaEvent {
    ReplicaEvent::Sequence(SequenceEvent {
        model_name: partition.key.model_name.clone(),
        routing_group: partition.key.routing_group.clone(),
        block_size: partition.block_size,
        request_id: id.to_owned(),
        worker,
        // The mesh stamps its own id on publish.
        router_id: RouterId(0),
        lora_name,
        kind,
    })
}

pub(crate) fn admission(
    tracking: &[SequenceHash],
    track: bool,
    prefill_tokens: Option<u64>,
    expected_output_tokens: Option<u32>,
) -> SequenceEventKind {
    let hint = prefill_tokens
        .filter(|&p| track && p > 0)
        .map(|p| PrefillLoadHint {
            initial_effective_prefill_tokens: p,
            expected_prefill_duration: None,
        });
    SequenceEventKind::AddRequest(Admission {
        tracking_hashes: Some(tracking.to_vec()),
        track_prefill_tokens: track,
        expected_output_tokens,
        prefill_load_hint: hint,
    })
}

pub(crate) fn binding_event(partition: &PartitionKey, update: &BindingUpdate) -> ReplicaEvent {
    ReplicaEvent::Binding(SessionBinding {
        model_name: partition.model_name.clone(),
        routing_group: partition.routing_group.clone(),
        session_id: update.session_id.clone(),
        worker_id: kv_types::WorkerId(update.target.worker_id),
        dp_rank: update.target.dp_rank.map(kv_types::DpRank),
        sequence: update.version.0,
        writer_id: RouterId(update.version.1),
    })
}

impl SelectionCore {
    /// Applies one event received from a replica peer (§5–§7).
    pub fn apply_replica_event(&self, event: ReplicaEvent) {
        let stats = self.replica_stats();
        // Counted always; logged for the first three of a reason, then at powers of two, so
        // a peer that keeps sending what we cannot apply is seen without flooding the log.
        let count = |c: &AtomicU64, reason: &'static str| {
            let n = c.fetch_add(1, Ordering::Relaxed) + 1;
            if n <= 3 || n.is_power_of_two() {
                tracing::warn!(reason, occurrences = n, "replica event dropped");
            }
        };
        match event {
            ReplicaEvent::Sequence(e) => {
                let key = PartitionKey::new(e.model_name.clone(), e.routing_group.clone());
                let Some(p) = self.partition(&key) else {
                    return count(&stats.unknown_partition, "unknown_partition");
                };
                if p.block_size != e.block_size {
                    return count(&stats.block_size_mismatch, "block_size_mismatch");
                }
                let now = Instant::now();
                match e.kind {
                    SequenceEventKind::AddRequest(a) => {
                        if !p.schedules(e.worker.worker_id.0, Some(e.worker.dp_rank.0)) {
                            return count(&stats.unknown_worker, "unknown_worker");
                        }
                        // Only a booking live in this partition's tracker makes it a
                        // duplicate (below): a stale row is replaced, and a row of another
                        // partition is left alone while the load is still booked (§5).
                        let tracking = a.tracking_hashes.unwrap_or_default();
                        let prefill = a
                            .prefill_load_hint
                            .map(|h| h.initial_effective_prefill_tokens);
                        let req = BookRequest {
                            worker: e.worker,
                            tracking_hashes: &tracking,
                            // The wire carries no ISL; the prefill hint is its lower bound.
                            isl: prefill.unwrap_or(0),
                            effective_prefill_tokens: prefill,
                            track_prefill_tokens: a.track_prefill_tokens,
                            expected_output_tokens: a.expected_output_tokens,
                            lora_name: e.lora_name.map(Arc::from),
                        };
                        let booked = p.ledger().lock().book_remote(
                            ReservationId::new(e.request_id.as_str()),
                            &req,
                            now,
                        );
                        match booked {
                            Ok(_) => {
                                self.install_mirrored_row(&e.request_id, &p);
                                stats.applied.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(LedgerError::DuplicateReservation { .. }) => {
                                count(&stats.duplicate_request, "duplicate_request")
                            }
                            Err(_) => count(&stats.unknown_worker, "unknown_worker"),
                        }
                    }
                    // The ledger's guard ends with each `let`: the queue re-check takes
                    // the ledger again, and rows are locked before the ledger elsewhere (a
                    // guard living through the `match` deadlocked the receiver).
                    SequenceEventKind::Free => {
                        let freed = p.ledger().lock().free_remote(&e.request_id, e.worker);
                        match freed {
                            Ok(_) => {
                                self.drop_mirrored_row(&e.request_id, &p, now);
                                self.recheck_queue(&p);
                                stats.applied.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(_) => count(&stats.not_live, "not_live"),
                        }
                    }
                    SequenceEventKind::MarkPrefillCompleted => {
                        let completed = p
                            .ledger()
                            .lock()
                            .prefill_complete_remote(&e.request_id, e.worker);
                        match completed {
                            Ok(_) => {
                                // Freed prefill capacity wakes the queue, as a local
                                // completion does (service-semantics §11).
                                self.recheck_queue(&p);
                                stats.applied.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(_) => count(&stats.not_live, "not_live"),
                        }
                    }
                }
            }
            ReplicaEvent::Binding(b) => {
                let key = PartitionKey::new(b.model_name.clone(), b.routing_group.clone());
                let Some(p) = self.partition(&key) else {
                    return count(&stats.unknown_partition, "unknown_partition");
                };
                let Some(table) = p.sessions() else {
                    return count(&stats.affinity_disabled, "affinity_disabled");
                };
                // §7.3 step 3 comes before the checks that may drop the event.
                table.observe_sequence(b.sequence);
                let target = SessionTarget {
                    worker_id: b.worker_id.0,
                    dp_rank: b.dp_rank.map(|r| r.0),
                };
                // Step 4: the worker is in the catalog and in this partition, whatever its
                // lifecycle (a selection checks the target is schedulable before using it).
                if !self.catalog_places(target.worker_id, &key) {
                    return count(&stats.unknown_worker, "unknown_worker");
                }
                if b.session_id.len() > crate::session::MAX_SESSION_ID_BYTES {
                    return count(&stats.invalid_session, "invalid_session");
                }
                let update = BindingUpdate {
                    session_id: b.session_id,
                    target,
                    version: (b.sequence, b.writer_id.0),
                    ttl: std::time::Duration::ZERO,
                };
                if self.apply_remote_binding(&key, &update) {
                    stats.applied.fetch_add(1, Ordering::Relaxed);
                } else {
                    count(&stats.stale_binding, "stale_binding");
                }
            }
        }
    }
}
