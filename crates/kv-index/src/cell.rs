//! A partition's index as a service holds it: one copy behind a lock, whose lookups wait
//! at a [`ReadGate`] for the write section in progress, or the index and a mirror of it
//! (`twin.rs`), whose lookups never wait for a writer.

use std::time::Duration;

use kv_types::KvOperation;
use parking_lot::{Mutex, RwLock, RwLockReadGuard};

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
        /// Boxed: two indexes inline would make every one-copy cell twice as large.
        twin: Box<Twin>,
        /// Used only for its batch writers' step-aside (no lookup waits at it).
        gate: ReadGate,
        /// Batches left by writers that found the turn taken, in arrival order: the writer
        /// with the turn applies them (see [`IndexCell::apply_batch`]).
        queued: Mutex<Vec<Vec<KvOperation>>>,
    },
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
        mut make: impl FnMut() -> KvIndex,
    ) -> Self {
        let kind = match copies {
            IndexCopies::One => Kind::One {
                index: RwLock::new(make()),
                writers: Mutex::new(()),
                gate: ReadGate::with_step_aside(step_aside),
            },
            IndexCopies::Two => Kind::Two {
                twin: Box::new(Twin::new(make)),
                gate: ReadGate::with_step_aside(step_aside),
                queued: Mutex::new(Vec::new()),
            },
        };
        IndexCell { kind }
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
    /// lookups do).
    pub fn read_whole(&self) -> IndexRead<'_> {
        match &self.kind {
            Kind::One { index, gate, .. } => gate.read(index),
            Kind::Two { twin, .. } => twin.read_whole(),
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
            Kind::Two { twin, queued, .. } => {
                // Batches left for the turn first: their writers returned before this call.
                let out = twin.write(|index| {
                    apply_left(index, queued, None);
                    f(index)
                });
                // And the ones left while `f` ran, which only a holder of the turn applies.
                apply_combining(twin, queued, &[]);
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
            Kind::Two { twin, gate, queued } => {
                if gate.step_aside_due() {
                    gate.step_aside();
                }
                apply_combining(twin, queued, ops);
            }
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
            Kind::Two { twin, gate, .. } => {
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
fn apply_combining(twin: &Twin, queued: &Mutex<Vec<Vec<KvOperation>>>, ops: &[KvOperation]) {
    let mut mine = (!ops.is_empty()).then_some(ops);
    if mine.is_none() && queued.lock().is_empty() {
        return;
    }
    loop {
        if twin
            .try_write(|index| apply_left(index, queued, mine.take()))
            .is_none()
        {
            let Some(ops) = mine.take() else {
                // Another writer has the turn and looks for left batches after it.
                return;
            };
            let mut left = queued.lock();
            if left.len() < MAX_LEFT_BATCHES {
                left.push(ops.to_vec());
                continue;
            }
            drop(left);
            twin.write(|index| apply_left(index, queued, Some(ops)));
        }
        if queued.lock().is_empty() {
            return;
        }
    }
}

/// Applies the batches left in `queued`, then `mine`, in that order.
fn apply_left(
    index: &mut KvIndex,
    queued: &Mutex<Vec<Vec<KvOperation>>>,
    mine: Option<&[KvOperation]>,
) {
    let left = std::mem::take(&mut *queued.lock());
    for op in left.iter().flatten().chain(mine.into_iter().flatten()) {
        index.apply(op);
    }
}
