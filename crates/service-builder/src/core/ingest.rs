//! KV operations from the listeners (and the replay tool) into the partition indexes.

use std::sync::atomic::Ordering;

use kv_index::{IndexWriter, KvIndex};
use kv_types::{KvOperation, KvOperationKind, WorkerKey};

use super::SelectionCore;
use super::partition::Partition;
use crate::catalog::PartitionKey;
use crate::ingress::IngressSink;

impl IngressSink for std::sync::Weak<SelectionCore> {
    fn apply(&self, partition: &PartitionKey, ops: &[KvOperation]) {
        if let Some(core) = self.upgrade() {
            core.apply_events(partition, ops);
        }
    }

    fn apply_owned(&self, partition: &PartitionKey, ops: &mut Vec<KvOperation>) {
        if let Some(core) = self.upgrade() {
            core.apply_listener_events(partition, ops);
        }
    }
}

impl SelectionCore {
    /// Applies normalized engine events to a partition's index: the same path the ZMQ
    /// listeners feed (for embedding hosts that receive events by other means, and replay).
    /// With a writer thread (`CoreConfig::kv_index_writer`) they are handed to it, and
    /// lookups see them once it has applied them, milliseconds later at most.
    pub fn apply_events(&self, partition: &PartitionKey, ops: &[KvOperation]) {
        let Some(p) = self.partition(partition) else {
            return;
        };
        let stored = stored_by(ops);
        // One copy: short write sections, handed over fairly, so a lookup waits behind at
        // most one section of a batch, never behind the whole batch or a writer that
        // re-locks at once. Two copies: lookups do not wait for it at all.
        p.index.apply_batch(ops);
        after_apply(&p, stored);
    }

    /// [`SelectionCore::apply_events`] for a listener's vector of operations, which a
    /// two-copy index with a writer thread keeps (leaving applied operations to reuse in
    /// its place) instead of copying it.
    pub(crate) fn apply_listener_events(
        &self,
        partition: &PartitionKey,
        ops: &mut Vec<KvOperation>,
    ) {
        let Some(p) = self.partition(partition) else {
            return;
        };
        let stored = stored_by(ops);
        p.index.apply_batch_owned(ops);
        after_apply(&p, stored);
    }
}

/// The worker rank of the first store among `ops`.
fn stored_by(ops: &[KvOperation]) -> Option<WorkerKey> {
    ops.iter()
        .find(|op| matches!(op.kind, KvOperationKind::Stored { .. }))
        .map(|op| op.worker)
}

/// What follows a batch of `stored`'s events: the capacity warning, when one is due. A
/// cell with a writer thread has only queued the batch: its thread calls
/// [`after_threaded_batch`] once the batch is applied.
fn after_apply(p: &Partition, stored: Option<WorkerKey>) {
    if let Some(worker) = stored
        && p.capacity_declared.load(Ordering::Relaxed)
        && p.index.writer() == IndexWriter::Listeners
    {
        warn_capacity_evictions(p, worker);
    }
}

/// [`after_apply`] on a partition's writer thread, with the index the batch was just
/// applied to (which it holds locked for writing, so nothing here reads the cell).
pub(super) fn after_threaded_batch(p: &Partition, index: &KvIndex, batch: &[KvOperation]) {
    if !p.capacity_declared.load(Ordering::Relaxed) {
        return;
    }
    if let Some(worker) = stored_by(batch) {
        let total = index.counters().capacity_evicted;
        warn_if_due(p, worker, total, || {
            index.primary().capacity_evicted(worker)
        });
    }
}

/// Warns, rate-limited, when the index evicted blocks because a worker rank exceeded its
/// `total_kv_blocks`: an engine cannot hold more than its capacity, so the excess was
/// state whose removal events were lost. Names the rank of the batch just applied, which
/// is the one that stored (other listeners of the partition may have evicted too; the
/// per-rank counter in `/metrics` tells them apart).
fn warn_capacity_evictions(p: &Partition, worker: WorkerKey) {
    // The total from a lookup's copy (a two-copy mirror has the counters), so that a
    // listener does not wait for the index's writer on every batch; the whole index only
    // when a warning is due.
    let total = p.index.read().counters().capacity_evicted;
    warn_if_due(p, worker, total, || {
        p.index.read_whole().primary().capacity_evicted(worker)
    });
}

/// The capacity warning for `worker`, if the partition's evictions reached `total` since
/// the last one and the rate limit lets it through; `rank_total` reads the rank's own.
fn warn_if_due(p: &Partition, worker: WorkerKey, total: u64, rank_total: impl FnOnce() -> u64) {
    let Some(evicted) = p.capacity_log.lock().due(total) else {
        return;
    };
    let rank_total = rank_total();
    tracing::warn!(
        partition = %p.key.for_log(),
        worker_id = worker.worker_id.0,
        dp_rank = worker.dp_rank.0,
        evicted,
        rank_evicted_total = rank_total,
        "a worker rank stored more blocks than its total_kv_blocks: its oldest blocks were \
         evicted from the index (their Removed events were lost); further warnings are \
         rate-limited, kv_select_index_capacity_evictions_total counts them all"
    );
}
