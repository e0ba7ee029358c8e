//! A partition's index as a service holds it: one copy behind a lock, whose lookups wait
//! at a [`ReadGate`] for the write section in progress, or the index and a mirror of it
//! (`twin.rs`), whose lookups never wait for a writer.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kv_types::KvOperation;
use parking_lot::{Condvar, Mutex, RwLock, RwLockReadGuard};

use crate::gate::{GateCounts, ReadGate};
use crate::index::KvIndex;
use crate::shared::apply_batch_fairly;
use crate::twin::Twin;

/// How many copies of each partition's index a service keeps.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum IndexCopies {
    /// One copy behind a lock: a lookup waits for the write section in progress (at most
    /// 32 blocks of a listener batch, longer when its writer loses its core inside it).
    #[default]
    One,
    /// The index and a lookup-only mirror of it: a lookup never waits for a writer. A write
    /// also copies what it changed into the mirror, and the mirror holds the trie again
    /// (not the per-worker maps).
    Two,
}

/// Who applies the listeners' batches to a two-copy index.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum IndexWriter {
    /// The listener threads themselves, one at a time; a listener that finds the turn
    /// taken leaves its batch to the one that has it.
    #[default]
    Listeners,
    /// A thread of the cell's own: listeners hand their batches over and go back to
    /// decoding, so the index is written from one core while the next batches are decoded
    /// on another. A batch reaches lookups once that thread has applied it; cold reads
    /// ([`IndexCell::read_whole`]) wait for every batch handed over before them.
    Thread,
}

/// One partition's index and how its readers and writers take turns.
#[derive(Debug)]
pub struct IndexCell {
    kind: Kind,
}

#[derive(Debug)]
#[expect(
    clippy::large_enum_variant,
    reason = "one cell per partition: the default one-copy index stays inline, one pointer \
              nearer its lookups"
)]
enum Kind {
    One {
        index: RwLock<KvIndex>,
        /// The listeners' turn at writing ([`apply_batch_fairly`]).
        writers: Mutex<()>,
        gate: ReadGate,
    },
    Two {
        /// Shared with the writer thread, if any (on the heap besides: two indexes inline
        /// would make every one-copy cell twice as large).
        twin: Arc<Twin>,
        /// Used only for its batch writers' step-aside (no lookup waits at it); shared with
        /// the writer thread, if any.
        gate: Arc<ReadGate>,
        left: Arc<Left>,
        /// [`IndexWriter::Thread`]: the writer thread applies every batch.
        threaded: bool,
    },
}

impl Kind {
    fn one(step_aside: Option<Duration>, mut make: impl FnMut() -> KvIndex) -> Self {
        Kind::One {
            index: RwLock::new(make()),
            writers: Mutex::new(()),
            gate: ReadGate::with_step_aside(step_aside),
        }
    }

    fn two(threaded: bool, step_aside: Option<Duration>, make: impl FnMut() -> KvIndex) -> Self {
        Kind::Two {
            twin: Arc::new(Twin::new(make)),
            gate: Arc::new(ReadGate::with_step_aside(step_aside)),
            left: Arc::default(),
            threaded,
        }
    }
}

/// What a writer thread calls after each batch it applies, with the index as that batch
/// left it (still locked for writing: the hook must not read the cell). Its owner learns
/// there what the batch did, as a caller of [`IndexCell::apply_batch`] learns it on return.
pub type AfterBatch = Box<dyn Fn(&KvIndex, &[KvOperation]) + Send + Sync>;

/// [`AfterBatch`] in a struct that derives `Debug`.
#[derive(Default)]
struct AfterBatchHook(OnceLock<AfterBatch>);

impl std::fmt::Debug for AfterBatchHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "AfterBatchHook(set)"
        } else {
            "AfterBatchHook(unset)"
        })
    }
}

/// Batches left for a two-copy index's writer, and the signals of its writer thread.
#[derive(Debug, Default)]
struct Left {
    /// Batches left by writers that found the turn taken, or handed to the writer thread,
    /// in arrival order: the writer with the turn applies them (see
    /// [`IndexCell::apply_batch`]).
    queued: Mutex<Vec<Vec<KvOperation>>>,
    /// The writer thread waits here for batches, or for its cell to be dropped.
    wake: Condvar,
    /// Listeners that found [`MAX_HANDED_BATCHES`] waiting wait here for the writer thread
    /// to take them.
    room: Condvar,
    /// The cell was dropped: its writer thread ends (set under `queued`'s lock).
    ended: AtomicBool,
    /// Batches ever queued (counted under `queued`'s lock) and applied from the queue:
    /// a cold read of a threaded cell waits until the second reaches the first as it was
    /// when the read began, which `done` signals (under `queued`'s lock).
    handed: AtomicU64,
    applied: AtomicU64,
    done: Condvar,
    /// Batches the writer thread applied, given back to the listeners that hand theirs
    /// over owned ([`IndexCell::apply_batch_owned`]): each takes one in exchange, so the
    /// vectors go back to a listener thread and are reused there, not freed by the writer.
    returned: Mutex<Vec<Vec<KvOperation>>>,
    /// Turns of the writer thread that panicked (their batches lost).
    writer_panics: AtomicU64,
    /// Called by the writer thread after each batch ([`IndexCell::after_each_threaded_batch`]).
    after_batch: AfterBatchHook,
}

impl Left {
    /// Queues `batch` (the caller holds the queue).
    fn push(&self, queued: &mut Vec<Vec<KvOperation>>, batch: Vec<KvOperation>) {
        queued.push(batch);
        self.handed.fetch_add(1, Ordering::Relaxed);
    }

    /// Takes every queued batch, making room for more.
    fn take(&self) -> Vec<Vec<KvOperation>> {
        let taken = std::mem::take(&mut *self.queued.lock());
        self.room.notify_all();
        taken
    }

    /// Keeps `batches`, applied, for listeners to take back in exchange for theirs (at most
    /// a queue's worth: the rest are dropped here).
    fn give_back(&self, batches: impl Iterator<Item = Vec<KvOperation>>) {
        let mut returned = self.returned.lock();
        let room = MAX_HANDED_BATCHES.saturating_sub(returned.len());
        returned.extend(batches.take(room));
    }

    /// Counts `n` batches taken from the queue as applied, for the cold reads that wait.
    fn applied(&self, n: usize) {
        if n == 0 {
            return;
        }
        self.applied.fetch_add(n as u64, Ordering::Release);
        let _queued = self.queued.lock();
        self.done.notify_all();
    }

    /// Waits until every batch queued before this call has been applied.
    fn wait_applied(&self) {
        let mut queued = self.queued.lock();
        let target = self.handed.load(Ordering::Relaxed);
        while self.applied.load(Ordering::Acquire) < target {
            self.done.wait(&mut queued);
        }
    }
}

/// A lookup's hold on the index: a read guard of the one copy, or of the mirror or the
/// index (whichever is not being written) with two.
pub type IndexRead<'a> = RwLockReadGuard<'a, KvIndex>;

/// What an [`IndexCell`]'s readers and writers waited for each other.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct IndexWaits {
    /// Lookups that waited for a write section (one copy; always zero with two).
    pub lookups: GateCounts,
    /// Write-locks of a two-copy index that waited for lookups to leave the copy they
    /// changed (zero with one copy).
    pub drains: u64,
    /// Of those, the ones that waited over 50 µs: a lookup lost its core while it read.
    pub drains_over_50us: u64,
    /// The longest such wait.
    pub longest_drain: Duration,
    /// Lookups of a two-copy index that failed to read-lock either copy eight times in a
    /// row (the writer moving between them during each try) and waited.
    pub reader_waits: u64,
    /// Turns of a writer thread whose apply panicked (a bug): their batches were lost.
    pub writer_panics: u64,
}

impl IndexCell {
    /// An index of `copies` copies, each made by `make` (called once per copy: it must
    /// build equal indexes). `step_aside` is the batch writers' step-aside interval
    /// ([`ReadGate::with_step_aside`]): with one copy they step aside between sections, so
    /// that no lookup waits behind a writer that lost its core; with two, before batches,
    /// so that a woken HTTP thread gets a core within about that long.
    pub fn new(
        copies: IndexCopies,
        step_aside: Option<Duration>,
        make: impl FnMut() -> KvIndex,
    ) -> Self {
        let kind = match copies {
            IndexCopies::One => Kind::one(step_aside, make),
            IndexCopies::Two => Kind::two(false, step_aside, make),
        };
        IndexCell { kind }
    }

    /// [`IndexCell::new`] with a choice of who applies a two-copy index's batches (one copy
    /// ignores it). [`IndexWriter::Thread`] starts a thread named `kv-index-writer`, which
    /// ends when the cell is dropped; this fails only if that thread cannot be started.
    pub fn with_writer(
        copies: IndexCopies,
        writer: IndexWriter,
        step_aside: Option<Duration>,
        make: impl FnMut() -> KvIndex,
    ) -> std::io::Result<Self> {
        let kind = match (copies, writer) {
            (IndexCopies::Two, IndexWriter::Thread) => Kind::two(true, step_aside, make),
            _ => return Ok(Self::new(copies, step_aside, make)),
        };
        if let Kind::Two {
            twin, left, gate, ..
        } = &kind
        {
            spawn_writer(twin, left, gate)?;
        }
        Ok(IndexCell { kind })
    }

    /// Has this cell's writer thread call `hook` after each batch it applies, once it is
    /// applied to the index (before the mirror has it). Returns `false`, and drops `hook`,
    /// for a cell without a writer thread, whose batches are applied by the callers of
    /// [`IndexCell::apply_batch`], or one that has a hook already.
    pub fn after_each_threaded_batch(&self, hook: AfterBatch) -> bool {
        match &self.kind {
            Kind::Two {
                left,
                threaded: true,
                ..
            } => left.after_batch.0.set(hook).is_ok(),
            _ => false,
        }
    }

    /// Who applies this cell's batches: [`IndexWriter::Thread`] only for a two-copy cell
    /// whose writer thread started.
    pub fn writer(&self) -> IndexWriter {
        match self.kind {
            Kind::Two { threaded: true, .. } => IndexWriter::Thread,
            _ => IndexWriter::Listeners,
        }
    }

    pub fn copies(&self) -> IndexCopies {
        match self.kind {
            Kind::One { .. } => IndexCopies::One,
            Kind::Two { .. } => IndexCopies::Two,
        }
    }

    /// The index for a lookup; keep the hold short (a two-copy writer waits for it). With
    /// two copies this may be the mirror, which answers lookups (matches, depths, tiered
    /// matches, hint chains) and counters only: read sizes, dumps and capacities through
    /// [`IndexCell::read_whole`].
    #[inline]
    pub fn read(&self) -> IndexRead<'_> {
        match &self.kind {
            Kind::One { index, gate, .. } => gate.read(index),
            Kind::Two { twin, .. } => twin.read(),
        }
    }

    /// The whole index, for every read (waits for a write in progress, as one copy's
    /// lookups do), with every batch handed to the cell applied.
    pub fn read_whole(&self) -> IndexRead<'_> {
        match &self.kind {
            Kind::One { index, gate, .. } => gate.read(index),
            Kind::Two {
                twin,
                left,
                threaded,
                ..
            } => {
                if *threaded {
                    // Applied by the writer thread, not this (HTTP) thread.
                    left.wait_applied();
                } else if !left.queued.lock().is_empty() {
                    // Batches still queued may be about to be taken by a writer that has
                    // the turn but not yet the index: waiting for the turn waits for it.
                    twin.write(|index| apply_left(index, left, None));
                }
                // A batch counted applied was applied under the index's write lock, and an
                // empty queue means every batch was taken by a writer holding it: this
                // read waits for that writer.
                twin.read_whole()
            }
        }
    }

    /// Estimated bytes of every copy ([`KvIndex::estimated_bytes`]): with two, the index's
    /// and its mirror's (a trie without per-worker maps).
    pub fn estimated_bytes(&self) -> usize {
        match &self.kind {
            // Not through the gate: a scrape is not a lookup to count.
            Kind::One { index, .. } => index.read().estimated_bytes(),
            Kind::Two { twin, .. } => twin.estimated_bytes(),
        }
    }

    /// Changes the index with `f` and returns its result.
    pub fn write<R>(&self, f: impl FnOnce(&mut KvIndex) -> R) -> R {
        match &self.kind {
            Kind::One { index, .. } => f(&mut index.write()),
            Kind::Two {
                twin,
                left,
                threaded,
                ..
            } => {
                // Batches left for the turn first: their writers returned before this call.
                let out = twin.write(|index| {
                    apply_left(index, left, None);
                    f(index)
                });
                // And the ones left while `f` ran, which only a holder of the turn applies
                // (a writer thread, woken by the first of them, applies them itself).
                if !threaded {
                    apply_combining(twin, left, &[]);
                }
                out
            }
        }
    }

    /// Applies a listener batch in order: in short sections handed over to waiting
    /// lookups with one copy ([`apply_batch_fairly`]); with two, whole, by this thread or,
    /// when another writer has the turn, by that one (the batch is copied and left to it,
    /// and this call returns at once; see `apply_combining`). Either way the batch is in
    /// the index before any later write of this cell, and lookups see it once its writer's
    /// turn has mirrored it. The writer may step aside before the batch.
    pub fn apply_batch(&self, ops: &[KvOperation]) {
        match &self.kind {
            Kind::One {
                index,
                writers,
                gate,
            } => apply_batch_fairly(index, writers, gate, ops),
            Kind::Two {
                twin,
                gate,
                left,
                threaded,
            } => {
                gate.step_aside_if_due();
                if *threaded {
                    hand_over(left, ops);
                } else {
                    apply_combining(twin, left, ops);
                }
            }
        }
    }

    /// Returns once lookups see every batch handed to this cell before the call: with a
    /// writer thread, a batch is applied after its `apply_batch` returns.
    pub fn settle(&self) {
        if matches!(self.kind, Kind::Two { .. }) {
            self.write(|_| ());
        }
    }

    /// [`IndexCell::apply_batch`] of a listener's own vector: a cell with a writer thread
    /// keeps it rather than copying it, and leaves in its place a vector of operations it
    /// has applied (or an empty one), for the listener to empty and reuse; any other cell
    /// applies the batch and leaves `ops` as it was.
    pub fn apply_batch_owned(&self, ops: &mut Vec<KvOperation>) {
        let Kind::Two {
            left,
            gate,
            threaded: true,
            ..
        } = &self.kind
        else {
            return self.apply_batch(ops);
        };
        gate.step_aside_if_due();
        if !ops.is_empty() {
            let spare = left.returned.lock().pop().unwrap_or_default();
            queue(left, std::mem::replace(ops, spare));
        }
    }

    /// Moves this index's content into `into` and leaves `fresh()` here (a recovered
    /// partition adopted by a new one).
    pub fn move_into(&self, into: &IndexCell, fresh: impl FnOnce() -> KvIndex) {
        let mut content = self.write(|index| std::mem::replace(index, fresh()));
        // A two-copy source's writer left it noting changes, which nothing would clear.
        content.log_off();
        into.write(|index| *index = content);
    }

    /// What readers and writers waited for each other so far.
    pub fn waits(&self) -> IndexWaits {
        match &self.kind {
            Kind::One { gate, .. } => IndexWaits {
                lookups: gate.counts(),
                ..IndexWaits::default()
            },
            Kind::Two {
                twin, gate, left, ..
            } => {
                let c = twin.counts();
                IndexWaits {
                    lookups: GateCounts {
                        step_asides: gate.counts().step_asides,
                        ..GateCounts::default()
                    },
                    drains: c.drains,
                    drains_over_50us: c.drains_over_50us,
                    longest_drain: c.longest_drain,
                    reader_waits: c.reader_waits,
                    writer_panics: left.writer_panics.load(Ordering::Relaxed),
                }
            }
        }
    }
}

/// How many batches a two-copy cell holds for the writer with the turn (a listener batch is
/// a few KiB: about a MiB per partition). A writer that finds this many waits for the turn
/// instead, so a listener that decodes faster than the index is written still stops
/// reading its engine's socket, as with one copy.
pub const MAX_LEFT_BATCHES: usize = 256;

/// How many batches (a listener's handful of engine batches each) wait for a cell's writer
/// thread before the listener that hands one more waits: enough to keep the writer busy
/// while the listener decodes, few enough that lookups see a batch a few milliseconds
/// after its listener handed it over, at most.
pub const MAX_HANDED_BATCHES: usize = 16;

/// Applies `ops` to a two-copy index, or leaves a copy of them to the writer that has the
/// turn: that writer applies every batch left before it lets the turn go, so the batches of
/// one partition are written by one thread at a time while the others go on decoding, and
/// the index's hot lines stay on that thread's core. Batches apply in the order their
/// writers left or applied them, so each listener's batches (one worker's stream) keep
/// theirs. At most [`MAX_LEFT`] batches wait so.
///
/// No batch is stranded: a writer that leaves one then tries the turn again, and fails only
/// while another writer has it; a writer looks for left batches after it releases the turn
/// and takes the turn again to apply them.
fn apply_combining(twin: &Twin, left: &Left, ops: &[KvOperation]) {
    let mut mine = (!ops.is_empty()).then_some(ops);
    if mine.is_none() && left.queued.lock().is_empty() {
        return;
    }
    loop {
        if twin
            .try_write(|index| apply_left(index, left, mine.take()))
            .is_none()
        {
            let Some(ops) = mine.take() else {
                // Another writer has the turn and looks for left batches after it.
                return;
            };
            let mut queued = left.queued.lock();
            if queued.len() < MAX_LEFT_BATCHES {
                left.push(&mut queued, ops.to_vec());
                continue;
            }
            drop(queued);
            twin.write(|index| apply_left(index, left, Some(ops)));
        }
        if left.queued.lock().is_empty() {
            return;
        }
    }
}

/// Applies the batches left in `left`, then `mine`, in that order.
fn apply_left(index: &mut KvIndex, left: &Left, mine: Option<&[KvOperation]>) {
    let taken = left.take();
    for op in taken.iter().flatten().chain(mine.into_iter().flatten()) {
        index.apply(op);
    }
    left.applied(taken.len());
}

/// Hands a copy of `ops` to the cell's writer thread, waiting while [`MAX_HANDED_BATCHES`]
/// wait for it (so a listener still feels the index's pace).
fn hand_over(left: &Left, ops: &[KvOperation]) {
    if ops.is_empty() {
        return;
    }
    queue(left, ops.to_vec());
}

/// Queues `batch` for the cell's writer thread, waiting while [`MAX_HANDED_BATCHES`] wait.
fn queue(left: &Left, batch: Vec<KvOperation>) {
    let mut queued = left.queued.lock();
    while queued.len() >= MAX_HANDED_BATCHES {
        left.room.wait(&mut queued);
    }
    left.push(&mut queued, batch);
    if queued.len() == 1 {
        left.wake.notify_one();
    }
}

/// Starts the writer thread of a two-copy cell (detached: it ends once the cell is
/// dropped, and drops the index there, off the dropper's thread).
fn spawn_writer(twin: &Arc<Twin>, left: &Arc<Left>, gate: &Arc<ReadGate>) -> std::io::Result<()> {
    let (twin, left, gate) = (Arc::clone(twin), Arc::clone(left), Arc::clone(gate));
    std::thread::Builder::new()
        .name("kv-index-writer".into())
        .spawn(move || serve_writes(&twin, &left, &gate))
        .map(drop)
}

/// The writer thread: applies the batches handed over until its cell is dropped. A turn
/// ends at the first batch boundary past the step-aside interval, and the thread then
/// yields its core, so that a woken HTTP thread waits for it about that long at most.
fn serve_writes(twin: &Twin, left: &Left, gate: &ReadGate) {
    loop {
        {
            let mut queued = left.queued.lock();
            while queued.is_empty() {
                if left.ended.load(Ordering::Acquire) {
                    return;
                }
                left.wake.wait(&mut queued);
            }
        }
        gate.step_aside_if_due();
        // A batch whose apply panics (a bug) is lost, as a listener's would be, but the
        // thread goes on: otherwise every listener of the partition would wait for room,
        // and every cold read for it, for good. The twin copies the mirror whole after a
        // write that panicked, and the batches it took count as applied.
        let turn = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            twin.write(|index| apply_until_due(index, left, gate));
        }));
        if turn.is_err() {
            left.writer_panics.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Batches taken from a queue and not yet counted: counted as applied when dropped, even
/// by a panic, so that cold reads waiting for them do not wait for good.
struct Uncounted<'a> {
    left: &'a Left,
    batches: usize,
}

impl Drop for Uncounted<'_> {
    fn drop(&mut self) {
        self.left.applied(self.batches);
    }
}

/// Applies the batches waiting in `left`, in order, until the step-aside interval has run;
/// puts the rest back in front of any batch handed over meanwhile.
fn apply_until_due(index: &mut KvIndex, left: &Left, gate: &ReadGate) {
    let mut taken = left.take();
    let mut uncounted = Uncounted {
        left,
        batches: taken.len(),
    };
    let mut applied = 0;
    let hook = left.after_batch.0.get();
    for batch in &taken {
        for op in batch {
            index.apply(op);
        }
        if let Some(hook) = hook {
            hook(index, batch);
        }
        applied += 1;
        if gate.step_aside_due() {
            break;
        }
    }
    // The rest goes back to the queue, to be counted when applied.
    uncounted.batches = applied;
    drop(uncounted);
    let rest = taken.split_off(applied);
    left.give_back(taken.into_iter());
    if !rest.is_empty() {
        let mut queued = left.queued.lock();
        let mut rest = rest;
        rest.append(&mut queued);
        *queued = rest;
    }
}

impl Drop for IndexCell {
    fn drop(&mut self) {
        if let Kind::Two {
            left,
            threaded: true,
            ..
        } = &self.kind
        {
            let _queued = left.queued.lock();
            left.ended.store(true, Ordering::Release);
            left.wake.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_taken_by_a_turn_that_panics_count_as_applied() {
        let left = Left::default();
        for _ in 0..3 {
            let mut queued = left.queued.lock();
            left.push(&mut queued, Vec::new());
        }
        let taken = left.take();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _uncounted = Uncounted {
                left: &left,
                batches: taken.len(),
            };
            panic!("a bug in the index");
        }));
        assert!(panicked.is_err());
        assert_eq!(left.applied.load(Ordering::Acquire), 3);
        // Returns at once: nothing handed over is left to wait for.
        left.wait_applied();
    }

    fn store(worker: u64, first: u64) -> KvOperation {
        use kv_types::{BlockHash, ExternalHash, KvOperationKind, StorageTier, StoredBlock};
        KvOperation {
            worker: kv_types::WorkerKey::new(worker, 0),
            tier: StorageTier::Device,
            event_id: 0,
            kind: KvOperationKind::Stored {
                parent_hash: None,
                blocks: (first..first + 2)
                    .map(|h| StoredBlock::new(ExternalHash(h), BlockHash(h)))
                    .collect(),
            },
        }
    }

    /// The hook sees each batch once it is in the index, in order, and only a cell with a
    /// writer thread takes one.
    #[test]
    fn a_writer_thread_calls_its_hook_after_each_batch_applied() {
        for (copies, writer) in [
            (IndexCopies::One, IndexWriter::Thread),
            (IndexCopies::Two, IndexWriter::Listeners),
        ] {
            let cell =
                IndexCell::with_writer(copies, writer, None, || KvIndex::with_block_size(16))
                    .expect("cell");
            assert_eq!(cell.writer(), IndexWriter::Listeners);
            assert!(!cell.after_each_threaded_batch(Box::new(|_, _| {})));
        }
        let cell = IndexCell::with_writer(IndexCopies::Two, IndexWriter::Thread, None, || {
            KvIndex::with_block_size(16)
        })
        .expect("thread");
        assert_eq!(cell.writer(), IndexWriter::Thread);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        assert!(
            cell.after_each_threaded_batch(Box::new(move |index, batch| {
                log.lock()
                    .push((batch.len(), index.primary().stats().memberships));
            }))
        );
        assert!(!cell.after_each_threaded_batch(Box::new(|_, _| {})));
        cell.apply_batch(&[store(1, 10)]);
        cell.apply_batch(&[store(2, 20), store(3, 30)]);
        // A cold read waits for both batches, so the hook has run for them.
        assert_eq!(cell.read_whole().primary().stats().memberships, 6);
        assert_eq!(*seen.lock(), [(1, 2), (2, 6)]);
    }

    #[test]
    fn a_writer_thread_ends_once_its_cell_is_dropped() {
        let cell = IndexCell::with_writer(IndexCopies::Two, IndexWriter::Thread, None, || {
            KvIndex::with_block_size(16)
        })
        .expect("thread");
        let Kind::Two { left, .. } = &cell.kind else {
            panic!("two copies");
        };
        let left = Arc::clone(left);
        assert_eq!(
            Arc::strong_count(&left),
            3,
            "the cell, its thread and this test"
        );
        drop(cell);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while Arc::strong_count(&left) > 1 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(
            Arc::strong_count(&left),
            1,
            "the writer thread outlived its cell"
        );
    }
}
