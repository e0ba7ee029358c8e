//! The core's side of the replica mesh: peers, mirrored rows and applying peer events.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use load_accounting::{BookRequest, LedgerError, ReservationId};
use replica_sync::{ReplicaEvent, ReplicaSink, SequenceEventKind};

use super::SelectionCore;
use super::partition::Partition;
use super::state::{ReservationRow, RowState};
use crate::catalog::PartitionKey;
use crate::session::{BindingUpdate, SessionTarget};

impl SelectionCore {
    pub(crate) fn set_replica_mesh(&self, mesh: Arc<replica_sync::ReplicaMesh>) {
        *self.replica.write() = Some(mesh);
    }

    pub(super) fn mesh(&self) -> Option<Arc<replica_sync::ReplicaMesh>> {
        self.replica.read().clone()
    }

    /// Releases a row's session lease and tells peers to refresh the binding's idle
    /// deadline (replica-sync §7.2: a released lease republishes the unchanged version).
    pub(super) fn release_row_session(&self, row: &ReservationRow, now: Instant) {
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
    pub(super) fn publish_replica_with(&self, make: impl FnOnce() -> replica_sync::ReplicaEvent) {
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
