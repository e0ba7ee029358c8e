//! Replica sync, service side (`spec/replica-sync.md` §4–§7): what this replica publishes
//! after its own bookings, and how events from peers are applied.
//!
//! Peer events are applied on the mesh's receiver thread: each is one short ledger or
//! session-table operation, so no extra queue is needed to keep the receiver responsive.
//! Every dropped event is counted by reason.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kv_types::{SequenceHash, WorkerKey};
use replica_sync::{
    Admission, PrefillLoadHint, ReplicaEvent, ReplicaMesh, RouterId, SequenceEvent,
    SequenceEventKind, SessionBinding,
};

use crate::catalog::PartitionKey;
use crate::core::partition::Partition;
use crate::session::BindingUpdate;

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
