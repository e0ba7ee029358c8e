//! Two copies of one partition's index, so that lookups never wait for a writer
//! (a left-right pair).
//!
//! Readers read whichever copy is published; a writer changes the other one, publishes
//! it, waits until the readers that were still in the old copy have left it, and makes
//! the same change there. A lookup therefore never waits for a write, however long a
//! write section runs or however long its writer is off its core; the writer waits for
//! lookups instead, which take microseconds. The price is the index's memory and write
//! work, both twice over, and lookups that see a change only once its first copy is
//! published.
//!
//! Each copy sits behind its own lock, which does the bookkeeping of who reads it: a
//! reader only ever *tries* to read-lock the published copy. That fails only when the
//! reader read `published` just before a writer published the other copy and the writer
//! has since write-locked this one (to change it, or waiting for its readers to leave);
//! the reader then reads `published` again and gets the new copy, which its writer has
//! finished. The writer's write lock on the old copy is the wait for its readers.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::index::KvIndex;

/// A wait of a writer for readers longer than this is counted: a reader that lost its
/// core in the old copy (the wait a single lock would have made a lookup suffer, moved
/// to the writer).
const LONG_DRAIN: Duration = Duration::from_micros(50);

/// Tries of a reader before it waits for the published copy's lock. A try fails only
/// across a publication, and the next one reads the copy just published, so a second
/// failure needs two publications during one reader's two tries; waiting is a fallback
/// that is counted, not a path.
const READ_TRIES: u32 = 8;

/// Two equal [`KvIndex`]es, one published for readers at any time, changed by one writer
/// at a time.
pub(crate) struct Twin {
    copies: [RwLock<KvIndex>; 2],
    /// The copy readers read (0 or 1). Changed only under `writer`.
    published: AtomicUsize,
    writer: Mutex<()>,
    drains: AtomicU64,
    long_drains: AtomicU64,
    longest_drain_ns: AtomicU64,
    reader_waits: AtomicU64,
}

/// What a [`Twin`]'s writers and readers waited.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub(crate) struct TwinCounts {
    /// Writes whose second half waited for readers to leave the old copy.
    pub(crate) drains: u64,
    pub(crate) drains_over_50us: u64,
    pub(crate) longest_drain: Duration,
    /// Readers that failed [`READ_TRIES`] tries and waited for a lock.
    pub(crate) reader_waits: u64,
}

impl Twin {
    /// Two copies made by `make`, which must build equal indexes (the same config and
    /// origin), since every later change is applied to both.
    pub(crate) fn new(mut make: impl FnMut() -> KvIndex) -> Self {
        Twin {
            copies: [RwLock::new(make()), RwLock::new(make())],
            published: AtomicUsize::new(0),
            writer: Mutex::new(()),
            drains: AtomicU64::new(0),
            long_drains: AtomicU64::new(0),
            longest_drain_ns: AtomicU64::new(0),
            reader_waits: AtomicU64::new(0),
        }
    }

    /// The published copy; does not wait for a writer.
    #[inline]
    pub(crate) fn read(&self) -> RwLockReadGuard<'_, KvIndex> {
        for _ in 0..READ_TRIES {
            let copy = self.published.load(Ordering::Acquire);
            if let Some(guard) = self.copies[copy].try_read() {
                return guard;
            }
        }
        self.reader_waits.fetch_add(1, Ordering::Relaxed);
        self.copies[self.published.load(Ordering::Acquire)].read()
    }

    /// Applies `f` to both copies, one after the other, and returns its first result.
    /// `f` must change both copies the same way (it gets no clock or randomness of its
    /// own: callers read `now` once, outside).
    pub(crate) fn write<R>(&self, f: impl FnMut(&mut KvIndex) -> R) -> R {
        self.write_pausing(f, || ())
    }

    /// [`Twin::write`], calling `pause` between the two copies' changes, when the first is
    /// published and the writer holds no copy's lock (a yield there keeps no lookup
    /// waiting).
    pub(crate) fn write_pausing<R>(
        &self,
        mut f: impl FnMut(&mut KvIndex) -> R,
        pause: impl FnOnce(),
    ) -> R {
        let _turn = self.writer.lock();
        let old = self.published.load(Ordering::Relaxed);
        let new = 1 - old;
        // Readers are rarely in `new`: only those that read `published` before the last
        // publication and have not finished yet.
        let out = f(&mut self.lock(new));
        self.published.store(new, Ordering::Release);
        pause();
        f(&mut self.lock(old));
        out
    }

    /// Write-locks `copy`, counting a wait for its readers.
    fn lock(&self, copy: usize) -> RwLockWriteGuard<'_, KvIndex> {
        if let Some(guard) = self.copies[copy].try_write() {
            return guard;
        }
        let since = Instant::now();
        let guard = self.copies[copy].write();
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
        self.copies.map(RwLock::into_inner)
    }
}

impl std::fmt::Debug for Twin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Twin")
            .field("published", &self.published.load(Ordering::Relaxed))
            .finish_non_exhaustive()
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
        let query: Vec<BlockHash> = (100..104).map(BlockHash).collect();
        let [a, b] = twin.into_inner();
        let (mut sa, mut sb) = (OverlapScores::new(), OverlapScores::new());
        a.find_matches(&query, &mut sa);
        b.find_matches(&query, &mut sb);
        sa.sort_by_worker();
        sb.sort_by_worker();
        assert_eq!(sa.entries().len(), 3);
        assert_eq!(sa.entries(), sb.entries());
    }

    #[test]
    fn a_writer_waits_for_a_reader_in_the_old_copy_and_readers_never_wait() {
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
        // The writer published the other copy and waits for `held` to leave the old one;
        // meanwhile a new reader gets the published copy at once, with the change in it.
        let deadline = Instant::now() + Duration::from_secs(10);
        while twin.published.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert!(
            twin.read()
                .primary()
                .holds(WorkerKey::new(1, 0), &[BlockHash(1), BlockHash(2)])
        );
        std::thread::sleep(Duration::from_millis(20));
        assert!(
            !done.load(Ordering::SeqCst),
            "the writer changed a copy being read"
        );
        assert!(!held.primary().holds(WorkerKey::new(1, 0), &[BlockHash(1)]));
        drop(held);
        writer.join().expect("writer");
        assert!(done.load(Ordering::SeqCst));
        let counts = twin.counts();
        assert_eq!(counts.drains, 1);
        assert_eq!(counts.drains_over_50us, 1);
        assert!(counts.longest_drain >= Duration::from_millis(20));
        assert_eq!(counts.reader_waits, 0);
    }
}
