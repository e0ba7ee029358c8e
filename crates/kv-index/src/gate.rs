//! How a lookup waits for a batch writer's section without giving its core away, and how a
//! batch writer gives its core away between sections.
//!
//! A `parking_lot` reader that finds the lock write-held spins, then calls `sched_yield`
//! up to seven times before it parks. While the listener threads keep every core busy,
//! each of those yields puts the HTTP thread behind them for a whole time slice: during
//! `cargo xtask bench ingest` a lookup that met a write section was back on a core 3 to 6
//! ms later, which was the `/select` p99 (docs/hot-path.md). With a [`ReadGate`], a lookup
//! that finds the lock taken sleeps on a condition variable instead, and the batch writer,
//! at the end of its section, downgrades the lock, wakes the sleeping lookups and lets them
//! in before it takes the next section.
//!
//! A listener that has events to apply never sleeps, so the scheduler takes its core away
//! at a tick or a wake-up of its choosing: inside a write section as often as not, and then
//! every lookup of the partition waits until the listener runs again, and the HTTP thread
//! woken on the same core waits for the listener's slice to end. A gate made with a
//! step-aside interval ([`ReadGate::with_step_aside`]) has a batch writer that has run that
//! long end its section at the next boundary, release the lock and yield its core
//! (`sched_yield`, which returns at once when nothing else is runnable): the core changes
//! hands where no lookup can be caught behind it, and a woken HTTP thread waits at most
//! about one interval.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Longest sleep of a waiting lookup between two tries: writers other than the batch
/// writers (a worker's removal, a recorded decision) end their sections without waking
/// the gate.
const RETRY_AFTER: Duration = Duration::from_micros(100);

/// Longest a batch writer holds the downgraded lock for lookups it woke that have not
/// started yet (a woken thread may wait for a core); those then get in after the next
/// section.
const HAND_OVER_FOR: Duration = Duration::from_micros(200);

/// How long a lookup spins (without yielding) before it sleeps.
const SPIN_FOR: Duration = Duration::from_micros(10);

/// A wait longer than this is counted apart ([`GateCounts::over_50us`]): the bound a lookup
/// should wait behind one write section.
const LONG_WAIT: Duration = Duration::from_micros(50);

/// The lookups waiting for a writer's section of one lock, and the signal that one ended.
#[derive(Debug)]
pub struct ReadGate {
    /// Lookups between a failed first try and their read guard.
    waiting: AtomicUsize,
    /// Sections ended with lookups waiting; a waiting lookup sleeps until it changes.
    ended: Mutex<u64>,
    signal: Condvar,
    /// Lookups that found the lock taken, those that waited longer than [`LONG_WAIT`], and
    /// the longest wait in nanoseconds.
    waits: AtomicU64,
    long_waits: AtomicU64,
    longest_ns: AtomicU64,
    /// Of the long waits, those the writer let in more than [`LONG_WAIT`] after they began.
    long_behind_writer: AtomicU64,
    /// When a batch writer last let waiting lookups in ([`clock`]), stamped before it
    /// releases the lock, so a lookup reads the stamp of the hand-over that let it in.
    let_in_at: AtomicU64,
    /// How long a batch writer runs before it steps aside at a section boundary
    /// (`None`: never).
    step_aside_after: Option<Duration>,
    /// Times batch writers stepped aside.
    step_asides: AtomicU64,
}

/// Nanoseconds since the first call in this process: a time that fits an atomic.
fn clock(at: Instant) -> u64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    u64::try_from(at.saturating_duration_since(epoch).as_nanos()).unwrap_or(u64::MAX)
}

thread_local! {
    /// When the calling thread last stepped aside at any gate, or first asked: the
    /// interval is the thread's own running time, whatever partitions it writes.
    static LAST_STEP_ASIDE: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// What the lookups of one [`ReadGate`] waited, since it was made.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct GateCounts {
    /// Lookups that found the lock write-held (and waited).
    pub waits: u64,
    /// Of those, the ones that waited longer than 50 µs (until their read guard, including
    /// any wait for a core after the wake-up).
    pub over_50us: u64,
    /// Of those, the ones a batch writer let in more than 50 µs after they began to wait:
    /// behind a write section that ran long or whose writer lost its core inside it. The
    /// other long waits were let in sooner and then waited for a core themselves. A wait
    /// that ends at another writer's unlock (a worker's removal, a recorded decision, a
    /// long store's pieces) counts here whole.
    pub behind_writer_over_50us: u64,
    /// The longest wait.
    pub longest: Duration,
    /// Times a batch writer ended its section early to yield its core
    /// ([`ReadGate::with_step_aside`]).
    pub step_asides: u64,
}

impl Default for ReadGate {
    fn default() -> Self {
        // Fixes the clock's epoch no later than the first wait at this gate begins.
        clock(Instant::now());
        ReadGate {
            waiting: AtomicUsize::new(0),
            ended: Mutex::new(0),
            signal: Condvar::new(),
            waits: AtomicU64::new(0),
            long_waits: AtomicU64::new(0),
            longest_ns: AtomicU64::new(0),
            long_behind_writer: AtomicU64::new(0),
            let_in_at: AtomicU64::new(0),
            step_aside_after: None,
            step_asides: AtomicU64::new(0),
        }
    }
}

impl ReadGate {
    pub fn new() -> Self {
        ReadGate::default()
    }

    /// A gate whose batch writers step aside once they have run `interval` (`None`: never):
    /// they end the section at the next boundary, release the lock and yield their core.
    pub fn with_step_aside(interval: Option<Duration>) -> Self {
        ReadGate {
            step_aside_after: interval,
            ..ReadGate::default()
        }
    }

    /// Whether the calling batch writer has run this gate's step-aside interval since it
    /// last stepped aside (never, without an interval). One clock read.
    pub(crate) fn step_aside_due(&self) -> bool {
        let Some(interval) = self.step_aside_after else {
            return false;
        };
        let now = Instant::now();
        match LAST_STEP_ASIDE.get() {
            Some(last) => now.duration_since(last) >= interval,
            None => {
                LAST_STEP_ASIDE.set(Some(now));
                false
            }
        }
    }

    /// [`ReadGate::step_aside`] if it is due; call it holding no lock of the index.
    pub(crate) fn step_aside_if_due(&self) {
        if self.step_aside_due() {
            self.step_aside();
        }
    }

    /// Yields the calling batch writer's core; call it holding no lock of the index.
    pub(crate) fn step_aside(&self) {
        std::thread::yield_now();
        LAST_STEP_ASIDE.set(Some(Instant::now()));
        self.step_asides.fetch_add(1, Ordering::Relaxed);
    }

    /// A read guard of `lock`, waiting (asleep) for the write section that holds it.
    pub fn read<'a, T>(&self, lock: &'a RwLock<T>) -> RwLockReadGuard<'a, T> {
        if let Some(guard) = lock.try_read() {
            return guard;
        }
        let since = Instant::now();
        // Counted before the next try, so a writer that ends its section after that try
        // fails sees this lookup and lets it in (and wakes it, once it sleeps).
        self.waiting.fetch_add(1, Ordering::SeqCst);
        // A section usually ends within microseconds, sooner than a sleep and a wake-up,
        // and the writer hands the lock over at its end because this lookup is counted.
        while since.elapsed() < SPIN_FOR {
            for _ in 0..32 {
                std::hint::spin_loop();
            }
            if let Some(guard) = lock.try_read() {
                self.waiting.fetch_sub(1, Ordering::SeqCst);
                self.count_wait(since);
                return guard;
            }
        }
        let mut ended = self.ended.lock();
        let guard = loop {
            // Tried under `ended`: a writer's signal takes it, so it cannot fall between
            // this try and the sleep.
            if let Some(guard) = lock.try_read() {
                break guard;
            }
            let seen = *ended;
            self.signal
                .wait_while_for(&mut ended, |now| *now == seen, RETRY_AFTER);
        };
        drop(ended);
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        self.count_wait(since);
        guard
    }

    fn count_wait(&self, since: Instant) {
        let waited = since.elapsed();
        self.waits.fetch_add(1, Ordering::Relaxed);
        if waited > LONG_WAIT {
            self.long_waits.fetch_add(1, Ordering::Relaxed);
            // Holding the read guard: no writer stamps again until it is dropped.
            let began = clock(since);
            let let_in = self.let_in_at.load(Ordering::SeqCst);
            let behind = if let_in > began {
                Duration::from_nanos(let_in - began)
            } else {
                waited
            };
            if behind > LONG_WAIT {
                self.long_behind_writer.fetch_add(1, Ordering::Relaxed);
            }
        }
        let nanos = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
        self.longest_ns.fetch_max(nanos, Ordering::Relaxed);
    }

    /// What the lookups waited so far.
    pub fn counts(&self) -> GateCounts {
        GateCounts {
            waits: self.waits.load(Ordering::Relaxed),
            over_50us: self.long_waits.load(Ordering::Relaxed),
            behind_writer_over_50us: self.long_behind_writer.load(Ordering::Relaxed),
            longest: Duration::from_nanos(self.longest_ns.load(Ordering::Relaxed)),
            step_asides: self.step_asides.load(Ordering::Relaxed),
        }
    }

    /// Whether lookups are waiting for the lock.
    pub fn has_waiting(&self) -> bool {
        self.waiting.load(Ordering::SeqCst) > 0
    }

    /// Ends a batch writer's section: when lookups wait, the lock is downgraded (so they
    /// can read, and no other writer can take it), they are woken and let in, and the
    /// writer then takes the lock again; otherwise `parking_lot`'s `bump` hands it to the
    /// threads parked on the lock itself, if any.
    pub fn between_sections<'a, T>(
        &self,
        lock: &'a RwLock<T>,
        mut held: RwLockWriteGuard<'a, T>,
    ) -> RwLockWriteGuard<'a, T> {
        if !self.has_waiting() {
            RwLockWriteGuard::bump(&mut held);
            return held;
        }
        self.stamp_let_in();
        let shared = RwLockWriteGuard::downgrade(held);
        self.wake();
        let until = Instant::now() + HAND_OVER_FOR;
        while self.has_waiting() && Instant::now() < until {
            // The woken lookups may need this core.
            std::thread::yield_now();
        }
        drop(shared);
        lock.write()
    }

    /// Ends a batch writer's last section.
    pub fn unlock<T>(&self, held: RwLockWriteGuard<'_, T>) {
        let waiting = self.has_waiting();
        if waiting {
            self.stamp_let_in();
        }
        RwLockWriteGuard::unlock_fair(held);
        if waiting || self.has_waiting() {
            self.wake();
        }
    }

    fn stamp_let_in(&self) {
        self.let_in_at
            .store(clock(Instant::now()), Ordering::SeqCst);
    }

    fn wake(&self) {
        *self.ended.lock() += 1;
        self.signal.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn an_open_lock_is_read_at_once() {
        let gate = ReadGate::new();
        let lock = RwLock::new(7);
        assert_eq!(*gate.read(&lock), 7);
        assert!(!gate.has_waiting());
        assert_eq!(gate.counts(), GateCounts::default());
    }

    #[test]
    fn a_waiting_lookup_gets_in_between_two_sections() {
        let gate = Arc::new(ReadGate::new());
        let lock = Arc::new(RwLock::new(0u32));
        let mut held = lock.write();
        *held = 1;
        let reader = {
            let (gate, lock) = (Arc::clone(&gate), Arc::clone(&lock));
            std::thread::spawn(move || *gate.read(&lock))
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !gate.has_waiting() {
            assert!(Instant::now() < deadline, "the lookup never waited");
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(2));
        // The section ends; the next one starts only after the lookup read the first's value
        // (or after the hand-over bound, when the test machine is slow: then it reads 2).
        let mut held = gate.between_sections(&lock, held);
        *held = 2;
        gate.unlock(held);
        let seen = reader.join().expect("reader");
        assert!(seen == 1 || seen == 2, "{seen}");
        assert!(!gate.has_waiting());
        let counts = gate.counts();
        assert_eq!((counts.waits, counts.over_50us), (1, 1), "{counts:?}");
        // The writer held its section 2 ms after the lookup began to wait.
        assert_eq!(counts.behind_writer_over_50us, 1, "{counts:?}");
        assert!(counts.longest >= Duration::from_millis(1), "{counts:?}");
    }

    #[test]
    fn a_long_wait_is_behind_the_writer_only_until_the_writer_let_it_in() {
        let gate = ReadGate::new();
        let since = Instant::now();
        std::thread::sleep(Duration::from_millis(2));
        // Let in 10 µs after it began, then 2 ms waiting for a core: not behind the writer.
        gate.let_in_at
            .store(clock(since + Duration::from_micros(10)), Ordering::SeqCst);
        gate.count_wait(since);
        // Let in 1 ms after it began: behind the writer.
        gate.let_in_at
            .store(clock(since + Duration::from_millis(1)), Ordering::SeqCst);
        gate.count_wait(since);
        // No hand-over since it began (another writer's unlock): the whole wait counts.
        let later = Instant::now();
        std::thread::sleep(Duration::from_millis(1));
        gate.count_wait(later);
        let counts = gate.counts();
        assert_eq!(
            (
                counts.waits,
                counts.over_50us,
                counts.behind_writer_over_50us
            ),
            (3, 3, 2),
            "{counts:?}"
        );
    }

    #[test]
    fn lookups_and_a_batch_writer_interleave_without_losing_a_wake_up() {
        let gate = Arc::new(ReadGate::new());
        let lock = Arc::new(RwLock::new(0u64));
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let (gate, lock, stop) = (Arc::clone(&gate), Arc::clone(&lock), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut batches = 0u64;
                while !stop.load(Ordering::Relaxed) && batches < 100_000 {
                    let mut held = lock.write();
                    for _ in 0..4 {
                        *held += 1;
                        held = gate.between_sections(&lock, held);
                    }
                    gate.unlock(held);
                    batches += 1;
                }
            })
        };
        let mut last = 0;
        for _ in 0..2_000 {
            let now = *gate.read(&lock);
            assert!(now >= last, "the value went back: {now} < {last}");
            last = now;
        }
        stop.store(true, Ordering::Relaxed);
        writer.join().expect("writer");
        assert!(!gate.has_waiting());
        assert_eq!(*gate.read(&lock) % 4, 0, "every batch ended");
    }
}
