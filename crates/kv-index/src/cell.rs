//! A partition's index as a service holds it: one copy behind a lock, whose lookups wait
//! at a [`ReadGate`] for the write section in progress, or two copies (`twin.rs`), whose
//! lookups never wait for a writer.

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
    /// Two copies (a left-right pair): a lookup never waits for a writer; writes cost twice
    /// the CPU and the index twice the memory.
    Two,
}

impl IndexCopies {
    /// How many copies: what the index's memory is multiplied by.
    pub fn count(self) -> usize {
        match self {
            IndexCopies::One => 1,
            IndexCopies::Two => 2,
        }
    }
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
    },
}

/// A lookup's hold on the index: a read guard of the one copy or of the published one.
pub type IndexRead<'a> = RwLockReadGuard<'a, KvIndex>;

/// What an [`IndexCell`]'s readers and writers waited for each other.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct IndexWaits {
    /// Lookups that waited for a write section (one copy; always zero with two).
    pub lookups: GateCounts,
    /// Writes of a two-copy index that waited for lookups to leave the copy they changed
    /// (zero with one copy).
    pub drains: u64,
    /// Of those, the ones that waited over 50 µs: a lookup lost its core while it read.
    pub drains_over_50us: u64,
    /// The longest such wait.
    pub longest_drain: Duration,
    /// Lookups of a two-copy index that failed to read-lock a published copy eight times
    /// in a row (publications racing them) and waited for it.
    pub reader_waits: u64,
}

impl IndexCell {
    /// An index of `copies` copies, each made by `make` (called once per copy: it must
    /// build equal indexes). `step_aside` is the batch writers' step-aside interval
    /// ([`ReadGate::with_step_aside`]): with one copy they step aside between sections, so
    /// that no lookup waits behind a writer that lost its core; with two, between batches,
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

    /// The index for a lookup; keep the hold short (a two-copy writer waits for it).
    #[inline]
    pub fn read(&self) -> IndexRead<'_> {
        match &self.kind {
            Kind::One { index, gate, .. } => gate.read(index),
            Kind::Two { twin, .. } => twin.read(),
        }
    }

    /// Changes the index with `f`, once per copy, and returns its first result. `f` must
    /// make the same change every time: it reads no clock of its own (callers take `now`
    /// once, outside) and moves nothing out of its captures.
    pub fn write<R>(&self, mut f: impl FnMut(&mut KvIndex) -> R) -> R {
        match &self.kind {
            Kind::One { index, .. } => f(&mut index.write()),
            Kind::Two { twin, .. } => twin.write(f),
        }
    }

    /// Applies a listener batch in order: in short sections handed over to waiting
    /// lookups with one copy ([`apply_batch_fairly`]), whole to each copy with two (the
    /// writer may step aside before the batch and between the copies).
    pub fn apply_batch(&self, ops: &[KvOperation]) {
        match &self.kind {
            Kind::One {
                index,
                writers,
                gate,
            } => apply_batch_fairly(index, writers, gate, ops),
            Kind::Two { twin, gate } => {
                let step_aside = || {
                    if gate.step_aside_due() {
                        gate.step_aside();
                    }
                };
                step_aside();
                twin.write_pausing(
                    |index| {
                        for op in ops {
                            index.apply(op);
                        }
                    },
                    step_aside,
                );
            }
        }
    }

    /// Moves this index's content into `into` and leaves `fresh()` here (a recovered
    /// partition adopted by a new one). Both cells keep their number of copies: copies
    /// are equal, so a two-copy destination fed from a one-copy source gets the source's
    /// content in one copy and a replay of its snapshot operations in the other.
    pub fn move_into(&self, into: &IndexCell, mut fresh: impl FnMut() -> KvIndex) {
        let mut taken: Vec<KvIndex> = Vec::with_capacity(2);
        self.write(|index| taken.push(std::mem::replace(index, fresh())));
        let replay = match (taken.len(), into.copies()) {
            (1, IndexCopies::Two) => taken.first().map(KvIndex::snapshot_operations),
            _ => None,
        };
        into.write(|index| match taken.pop() {
            Some(content) => *index = content,
            None => {
                // Only a two-copy destination of a one-copy source gets here.
                let mut copy = fresh();
                for op in replay.iter().flatten() {
                    copy.apply(op);
                }
                *index = copy;
            }
        });
    }

    /// What readers and writers waited for each other so far.
    pub fn waits(&self) -> IndexWaits {
        match &self.kind {
            Kind::One { gate, .. } => IndexWaits {
                lookups: gate.counts(),
                ..IndexWaits::default()
            },
            Kind::Two { twin, gate } => {
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
