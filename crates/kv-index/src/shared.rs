//! The partition index shared between request tasks (readers) and ingest tasks (writers).

use std::time::Instant;

use kv_types::{BlockHash, KvOperation, KvOperationKind, WorkerId, WorkerKey};
use parking_lot::{Mutex, RwLock, RwLockWriteGuard};

use crate::gate::ReadGate;
use crate::index::{ApplyCounters, ApplyOutcome, KvIndex, RecordOutcome};
use crate::primary::OverlapScores;

/// Longest run of blocks a store applies under one write lock (~13 µs at 10 M blocks/s).
pub const STORE_PIECE_BLOCKS: usize = 128;

/// Blocks of a batch applied in one write section between two chances for waiting lookups.
const SECTION_BLOCKS: usize = 32;
use crate::tiers::TieredMatches;

/// Expired entries applied per write section, so a large expiry wave never holds the
/// lock for long.
const EXPIRE_CHUNK: usize = 512;

/// A [`KvIndex`] behind a `parking_lot::RwLock`: every write section is short (one
/// operation, one recorded decision, one expiry chunk, or up to [`STORE_PIECE_BLOCKS`]
/// blocks of one batch), so a lookup waits at most for one short write. See the crate docs
/// for the measurements.
#[derive(Debug)]
pub struct SharedKvIndex {
    inner: RwLock<KvIndex>,
}

/// Counts of a restore (§9.2 step 3).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct RestoreReport {
    pub applied: u64,
    pub duplicate: u64,
    pub parent_block_not_found: u64,
    pub block_not_found: u64,
}

impl SharedKvIndex {
    pub fn new(index: KvIndex) -> Self {
        SharedKvIndex {
            inner: RwLock::new(index),
        }
    }

    pub fn into_inner(self) -> KvIndex {
        self.inner.into_inner()
    }

    pub fn block_size(&self) -> u32 {
        self.inner.read().block_size()
    }

    /// Applies one operation under short write sections ([`apply_fairly`]).
    pub fn apply(&self, op: &KvOperation) -> ApplyOutcome {
        apply_fairly(&self.inner, op)
    }

    /// Replays snapshot operations in order, one write section each.
    pub fn restore(&self, ops: &[KvOperation]) -> RestoreReport {
        let mut report = RestoreReport::default();
        for op in ops {
            match self.apply(op) {
                ApplyOutcome::Ok => report.applied += 1,
                ApplyOutcome::DuplicateStore => report.duplicate += 1,
                ApplyOutcome::ParentBlockNotFound => report.parent_block_not_found += 1,
                ApplyOutcome::BlockNotFound { .. } => report.block_not_found += 1,
            }
        }
        report
    }

    pub fn find_matches(&self, query: &[BlockHash], out: &mut OverlapScores) {
        self.inner.read().find_matches(query, out);
    }

    pub fn find_tiered(&self, query: &[BlockHash], out: &mut TieredMatches) {
        self.inner.read().find_tiered(query, out);
    }

    pub fn record_decision(
        &self,
        worker: WorkerKey,
        locals: &[BlockHash],
        now: Instant,
    ) -> RecordOutcome {
        self.inner.write().record_decision(worker, locals, now)
    }

    /// Applies every approximate entry expired at `now`, in chunks. Returns the count.
    pub fn expire(&self, now: Instant) -> usize {
        let mut total = 0;
        loop {
            let n = self.inner.write().expire(now, EXPIRE_CHUNK);
            total += n;
            if n < EXPIRE_CHUNK {
                return total;
            }
        }
    }

    pub fn remove_worker(&self, worker_id: WorkerId) {
        self.inner.write().remove_worker(worker_id);
    }

    pub fn remove_rank(&self, worker: WorkerKey) {
        self.inner.write().remove_rank(worker);
    }

    pub fn counters(&self) -> ApplyCounters {
        self.inner.read().counters()
    }

    /// Snapshot operations (§9.1) taken under one read lock: consistent, but it delays
    /// writers (and, through lock fairness, later readers) for the traversal time.
    pub fn snapshot_operations(&self) -> Vec<KvOperation> {
        self.inner.read().snapshot_operations()
    }

    /// Runs `f` under the read lock (keep it short).
    pub fn read<R>(&self, f: impl FnOnce(&KvIndex) -> R) -> R {
        f(&self.inner.read())
    }
}

/// Applies one batch's operations, in order, under write sections of at most 32 blocks
/// each, handing the lock to waiting threads between sections
/// ([`ReadGate::between_sections`]: to the lookups waiting at `gate`, or a fair unlock and
/// re-lock for threads parked on the lock; free when nobody waits). A lookup still waits
/// behind at most one section, but a batch of small events takes the lock once per section
/// instead of once per event: with two listener threads writing one partition, a fair
/// unlock per event handed the lock to the other writer each time, and the futex wake-ups
/// and context switches cost more than the writes. A `Cleared` event or a store longer than
/// [`STORE_PIECE_BLOCKS`] gets sections of its own ([`apply_fairly`]).
///
/// Batch writers take turns on `writers` first and hold it for the whole batch. The index
/// lock prefers queued writers to arriving readers, so with many listener threads writing
/// one partition a lookup would queue behind every one of their sections (docs/hot-path.md);
/// with the turn, at most one writer waits on the index lock, and each hand-over between
/// sections goes to the lookups that arrived meanwhile.
///
/// With a step-aside interval at `gate` ([`ReadGate::with_step_aside`]), a writer that has
/// run that long releases the lock at the next section boundary and yields its core
/// before it goes on (gate.rs says why).
pub fn apply_batch_fairly(
    index: &RwLock<KvIndex>,
    writers: &Mutex<()>,
    gate: &ReadGate,
    ops: &[KvOperation],
) {
    let _turn = writers.lock();
    let mut guard: Option<RwLockWriteGuard<'_, KvIndex>> = None;
    let mut section = 0usize;
    for op in ops {
        let blocks = match &op.kind {
            KvOperationKind::Stored { blocks, .. } => blocks.len(),
            KvOperationKind::Removed { block_hashes } => block_hashes.len(),
            KvOperationKind::Cleared => usize::MAX,
        };
        if blocks > STORE_PIECE_BLOCKS {
            if let Some(held) = guard.take() {
                gate.unlock(held);
            }
            apply_fairly(index, op);
            continue;
        }
        let boundary = guard.is_none() || section + blocks > SECTION_BLOCKS;
        if boundary && gate.step_aside_due() {
            if let Some(held) = guard.take() {
                gate.unlock(held);
            }
            gate.step_aside();
        }
        let mut held = match guard.take() {
            Some(held) if section + blocks > SECTION_BLOCKS => {
                section = 0;
                gate.between_sections(index, held)
            }
            Some(held) => held,
            None => {
                section = 0;
                index.write()
            }
        };
        held.apply(op);
        section += blocks;
        guard = Some(held);
    }
    if let Some(held) = guard {
        gate.unlock(held);
    }
}

/// Applies one operation to a locked index under short write sections: a device store
/// longer than [`STORE_PIECE_BLOCKS`] goes in pieces ([`KvIndex::apply_stored_piece`]),
/// and every section ends with a fair unlock, which hands the lock to waiting lookups (an
/// ingest loop that re-locks at once would otherwise keep readers waiting up to
/// parking_lot's 0.5 ms fairness timeout). Returns the outcome of the event (its first
/// piece).
pub fn apply_fairly(index: &RwLock<KvIndex>, op: &KvOperation) -> ApplyOutcome {
    if let KvOperationKind::Stored {
        parent_hash,
        blocks,
    } = &op.kind
        && op.tier.is_device()
        && blocks.len() > STORE_PIECE_BLOCKS
    {
        let mut parent = *parent_hash;
        let mut first = ApplyOutcome::Ok;
        for (i, piece) in blocks.chunks(STORE_PIECE_BLOCKS).enumerate() {
            let mut guard = index.write();
            let outcome = guard.apply_stored_piece(op.worker, parent, piece, i == 0);
            RwLockWriteGuard::unlock_fair(guard);
            if i == 0 {
                first = outcome;
            }
            if outcome == ApplyOutcome::ParentBlockNotFound {
                break;
            }
            parent = piece.last().map(|b| b.block_hash);
        }
        return first;
    }
    let mut guard = index.write();
    let outcome = guard.apply(op);
    RwLockWriteGuard::unlock_fair(guard);
    outcome
}
