//! A partition's index and a mirror of it, so that lookups never wait for a writer.
//!
//! Every write changes the whole index (the source: per-worker maps, capacities, timers,
//! everything) while the mirror, which answers lookups only (`primary/mirror.rs`), stays
//! readable. The writer then lets lookups read the source, which it now only reads,
//! while it brings the mirror up to date by copying what the write touched. At every
//! moment one of the two is open for reading, so a lookup never waits for a write,
//! however long a write section runs or however long its writer is off its core; the
//! writer waits for lookups instead, which take microseconds.
//!
//! The mirror costs a fraction of a second copy: the source notes the nodes, child links
//! and worker slots a write changed, and the mirror copies those instead of applying the
//! write again (its per-worker maps, most of a write's cost, do not exist). What lookups
//! see only moves forward: the mirror, one write behind, while the source is written; the
//! source, with that write, while the mirror catches up.
//!
//! Each copy sits behind its own lock, which does the bookkeeping of who reads it; a
//! reader only ever *tries* to read-lock either. A try fails only for the copy being
//! written, so the other one's try succeeds unless the writer moved on in between; the
//! writer's write lock is its wait for the readers of the copy it changes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::index::KvIndex;

/// A wait of a writer for readers longer than this is counted: a reader that lost its
/// core in the copy the writer changes (the wait a single lock would have made a lookup
/// suffer, moved to the writer).
const LONG_DRAIN: Duration = Duration::from_micros(50);

/// Tries of a reader (each at both copies) before it waits for the mirror's lock. A try
/// fails only when the writer moved from one copy to the other during it; waiting is a
/// fallback that is counted, not a path.
const READ_TRIES: u32 = 8;

/// An index and its mirror: written by one writer at a time, read without waiting.
pub(crate) struct Twin {
    /// The index every write changes, with everything a write or a cold read needs.
    whole: RwLock<KvIndex>,
    /// What lookups read while `whole` is written: equal to it for every lookup once the
    /// writer has mirrored its last write.
    mirror: RwLock<KvIndex>,
    /// The writers' turn, and whether the mirror must be copied whole at the next write
    /// (a write or a mirroring that panicked left it unknown).
    writer: Mutex<bool>,
    drains: AtomicU64,
    long_drains: AtomicU64,
    longest_drain_ns: AtomicU64,
    reader_waits: AtomicU64,
}

/// What a [`Twin`]'s writers and readers waited.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub(crate) struct TwinCounts {
    /// Write-locks of either copy that waited for its readers to leave.
    pub(crate) drains: u64,
    pub(crate) drains_over_50us: u64,
    pub(crate) longest_drain: Duration,
    /// Readers that failed [`READ_TRIES`] tries and waited for a lock.
    pub(crate) reader_waits: u64,
}

impl Twin {
    /// The index and its mirror, both made by `make`, which must build equal indexes (the
    /// same config and origin).
    pub(crate) fn new(mut make: impl FnMut() -> KvIndex) -> Self {
        Twin {
            whole: RwLock::new(make()),
            mirror: RwLock::new(make()),
            writer: Mutex::new(false),
            drains: AtomicU64::new(0),
            long_drains: AtomicU64::new(0),
            longest_drain_ns: AtomicU64::new(0),
            reader_waits: AtomicU64::new(0),
        }
    }

    /// The mirror or, while it is being brought up to date, the index; does not wait for a
    /// writer. Answers lookups only (see [`KvIndex::mirror_changes`]).
    #[inline]
    pub(crate) fn read(&self) -> RwLockReadGuard<'_, KvIndex> {
        for _ in 0..READ_TRIES {
            if let Some(guard) = self.mirror.try_read() {
                return guard;
            }
            if let Some(guard) = self.whole.try_read() {
                return guard;
            }
        }
        self.reader_waits.fetch_add(1, Ordering::Relaxed);
        self.mirror.read()
    }

    /// The index itself, for reads a mirror cannot answer (dumps, sizes, capacities);
    /// waits for a write in progress.
    pub(crate) fn read_whole(&self) -> RwLockReadGuard<'_, KvIndex> {
        self.whole.read()
    }

    /// Estimated bytes of the index and its mirror.
    pub(crate) fn estimated_bytes(&self) -> usize {
        self.whole.read().estimated_bytes() + self.mirror.read().estimated_bytes()
    }

    /// Applies `f` to the index, mirrors what it changed, and returns its result.
    pub(crate) fn write<R>(&self, f: impl FnOnce(&mut KvIndex) -> R) -> R {
        self.write_in_turn(self.writer.lock(), f)
    }

    /// [`Twin::write`] if no other writer has the turn; `None` (and `f` not called) if one
    /// has.
    pub(crate) fn try_write<R>(&self, f: impl FnOnce(&mut KvIndex) -> R) -> Option<R> {
        let turn = self.writer.try_lock()?;
        Some(self.write_in_turn(turn, f))
    }

    fn write_in_turn<R>(
        &self,
        mut unknown: MutexGuard<'_, bool>,
        f: impl FnOnce(&mut KvIndex) -> R,
    ) -> R {
        let mut whole = self.lock(&self.whole);
        let clean = whole.log_on();
        let serial = whole.serial();
        let was_unknown = std::mem::replace(&mut *unknown, true);
        let out = f(&mut whole);
        // Another serial means `f` replaced the index: the log is not of this one.
        let noted = whole.log_off() && whole.serial() == serial;
        // Readers find the index open from here on, with this write in it; none reads it
        // before the mirror is locked (a reader tries the mirror first), so what lookups
        // see never goes back.
        let whole = RwLockWriteGuard::downgrade(whole);
        let mut mirror = self.lock(&self.mirror);
        if clean && noted && !was_unknown {
            mirror.mirror_changes(&whole);
        } else {
            mirror.mirror_all(&whole);
        }
        *unknown = false;
        out
    }

    /// Write-locks `copy`, counting a wait for its readers.
    fn lock<'a>(&self, copy: &'a RwLock<KvIndex>) -> RwLockWriteGuard<'a, KvIndex> {
        if let Some(guard) = copy.try_write() {
            return guard;
        }
        let since = Instant::now();
        let guard = copy.write();
        let waited = since.elapsed();
        self.drains.fetch_add(1, Ordering::Relaxed);
        if waited > LONG_DRAIN {
            self.long_drains.fetch_add(1, Ordering::Relaxed);
        }
        let nanos = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
        self.longest_drain_ns.fetch_max(nanos, Ordering::Relaxed);
        guard
    }

    pub(crate) fn counts(&self) -> TwinCounts {
        TwinCounts {
            drains: self.drains.load(Ordering::Relaxed),
            drains_over_50us: self.long_drains.load(Ordering::Relaxed),
            longest_drain: Duration::from_nanos(self.longest_drain_ns.load(Ordering::Relaxed)),
            reader_waits: self.reader_waits.load(Ordering::Relaxed),
        }
    }

    #[cfg(test)]
    fn into_inner(self) -> [KvIndex; 2] {
        [self.whole.into_inner(), self.mirror.into_inner()]
    }
}

impl std::fmt::Debug for Twin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Twin").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    use kv_types::{
        BlockHash, ExternalHash, KvOperation, KvOperationKind, StorageTier, StoredBlock, WorkerKey,
    };

    use super::*;
    use crate::primary::OverlapScores;

    fn store(worker: u64, first: u64, len: u64) -> KvOperation {
        let blocks = (first..first + len)
            .map(|h| StoredBlock::new(ExternalHash(h), BlockHash(h)))
            .collect();
        KvOperation {
            worker: WorkerKey::new(worker, 0),
            tier: StorageTier::Device,
            event_id: 0,
            kind: KvOperationKind::Stored {
                parent_hash: None,
                blocks,
            },
        }
    }

    #[test]
    fn a_write_changes_both_copies() {
        let twin = Twin::new(|| KvIndex::with_block_size(16));
        for w in 0..3 {
            twin.write(|i| i.apply(&store(w, 100, 4)));
        }
        assert_copies_agree(twin, 100..104, 3);
    }

    /// The index and the mirror match `blocks` for the same `workers` workers alike.
    fn assert_copies_agree(twin: Twin, blocks: std::ops::Range<u64>, workers: usize) {
        let query: Vec<BlockHash> = blocks.map(BlockHash).collect();
        let [whole, mirror] = twin.into_inner();
        let (mut a, mut b) = (OverlapScores::new(), OverlapScores::new());
        whole.find_matches(&query, &mut a);
        mirror.find_matches(&query, &mut b);
        a.sort_by_worker();
        b.sort_by_worker();
        assert_eq!(a.entries().len(), workers);
        assert_eq!(a.entries(), b.entries());
    }

    #[test]
    fn a_writer_waits_for_a_reader_of_the_mirror_and_readers_never_wait() {
        let twin = Arc::new(Twin::new(|| KvIndex::with_block_size(16)));
        let held = twin.read();
        let done = Arc::new(AtomicBool::new(false));
        let writer = {
            let (twin, done) = (Arc::clone(&twin), Arc::clone(&done));
            std::thread::spawn(move || {
                twin.write(|i| i.apply(&store(1, 1, 2)));
                done.store(true, Ordering::SeqCst);
            })
        };
        // The writer changed the index and waits for `held` to leave the mirror; meanwhile
        // a new reader gets the index at once, with the change in it.
        let holds = |twin: &Twin| {
            twin.read()
                .primary()
                .holds(WorkerKey::new(1, 0), &[BlockHash(1), BlockHash(2)])
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !holds(&twin) && Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert!(holds(&twin));
        std::thread::sleep(Duration::from_millis(20));
        assert!(
            !done.load(Ordering::SeqCst),
            "the writer changed a mirror being read"
        );
        assert!(!held.primary().holds(WorkerKey::new(1, 0), &[BlockHash(1)]));
        drop(held);
        writer.join().expect("writer");
        assert!(done.load(Ordering::SeqCst));
        assert!(holds(&twin));
        let counts = twin.counts();
        assert_eq!(counts.drains, 1);
        assert_eq!(counts.drains_over_50us, 1);
        assert!(counts.longest_drain >= Duration::from_millis(20));
        assert_eq!(counts.reader_waits, 0);
    }

    #[test]
    fn a_write_that_panics_leaves_the_next_write_to_copy_the_mirror_whole() {
        let twin = Twin::new(|| KvIndex::with_block_size(16));
        twin.write(|i| i.apply(&store(1, 1, 4)));
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            twin.write(|i| {
                i.apply(&store(2, 1, 4));
                panic!("a bug in the index");
            })
        }));
        assert!(panicked.is_err());
        twin.write(|i| i.apply(&store(3, 1, 2)));
        assert_copies_agree(twin, 1..5, 3);
    }
}
