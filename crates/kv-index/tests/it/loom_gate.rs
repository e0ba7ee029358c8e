//! loom model of the read gate's hand-over (`src/gate.rs`), compiled only with
//! `--cfg loom`; run by `cargo xtask loom`.
//!
//! The gate takes `parking_lot`'s lock, mutex and condition variable, which loom cannot
//! schedule, so the model replicates its protocol on loom's types: a lookup that finds the
//! lock write-held counts itself in `waiting`, tries again, then sleeps until `ended`
//! changes; a batch writer ending a section with lookups counted lets them in and bumps
//! `ended` under its mutex, and its last unlock wakes them too; a writer stepping aside
//! ends its section through that same unlock. Keep the replica in step with `src/gate.rs`
//! and `apply_batch_fairly` in `src/shared.rs`.
//!
//! What the real code bounds with timeouts the model leaves unbounded: the sleep waits
//! for `ended` alone (no 100 µs retry), so a lost wake-up leaves a lookup asleep for good,
//! which loom reports as a deadlock; and a writer that woke lookups waits until they got
//! in (no 200 µs bound), so a missing wake-up between sections spins it for good, which
//! loom reports as too many branches.
//! `downgrade` becomes a release and a new `write`: with one batch writer, which the
//! writers' turn guarantees, no other writer can come between. The lock is a small
//! reader-count lock of the model's own ([`Lock`]): loom's `RwLock::try_read` never fails
//! in any interleaving loom explores, so a model on it never has a lookup wait at all.
//!
//! Invariants: every lookup gets in, whatever the interleaving, and one counted as
//! waiting when a section ends gets in before the next section; a lookup sees a whole
//! number of sections; what lookups see never goes back.

use loom::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use loom::sync::{Arc, Condvar, Mutex};
use loom::thread;

/// Set in [`Lock::state`] while a writer holds the lock; the rest counts the readers.
const WRITER: usize = 1 << 20;

/// A reader-count lock with the value it guards: what the gate needs of `parking_lot`'s
/// `RwLock` (a read try, a blocking write, releases), each step a loom atomic.
#[derive(Default)]
struct Lock {
    state: AtomicUsize,
    /// Written only under the write lock, read only under a read lock.
    value: AtomicU64,
}

/// A held read lock; releases on drop.
struct Read<'a>(&'a Lock);

/// A held write lock; releases on drop.
struct Write<'a>(&'a Lock);

impl Lock {
    fn try_read(&self) -> Option<Read<'_>> {
        let s = self.state.load(Ordering::SeqCst);
        if s & WRITER != 0 {
            return None;
        }
        self.state
            .compare_exchange(s, s + 1, Ordering::SeqCst, Ordering::SeqCst)
            .ok()
            .map(|_| Read(self))
    }

    fn write(&self) -> Write<'_> {
        while self
            .state
            .compare_exchange(0, WRITER, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            thread::yield_now();
        }
        Write(self)
    }
}

impl Read<'_> {
    fn value(&self) -> u64 {
        self.0.value.load(Ordering::SeqCst)
    }
}

impl Write<'_> {
    fn add(&mut self, n: u64) {
        self.0.value.fetch_add(n, Ordering::SeqCst);
    }
}

impl Drop for Read<'_> {
    fn drop(&mut self) {
        self.0.state.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for Write<'_> {
    fn drop(&mut self) {
        self.0.state.fetch_sub(WRITER, Ordering::SeqCst);
    }
}

#[derive(Default)]
struct Gate {
    waiting: AtomicUsize,
    ended: Mutex<u64>,
    signal: Condvar,
}

impl Gate {
    fn read<'a>(&self, lock: &'a Lock) -> Read<'a> {
        if let Some(guard) = lock.try_read() {
            return guard;
        }
        self.waiting.fetch_add(1, Ordering::SeqCst);
        // The spin: one more try before sleeping.
        if let Some(guard) = lock.try_read() {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return guard;
        }
        let mut ended = self.ended.lock().unwrap();
        let guard = loop {
            if let Some(guard) = lock.try_read() {
                break guard;
            }
            let seen = *ended;
            while *ended == seen {
                ended = self.signal.wait(ended).unwrap();
            }
        };
        drop(ended);
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        guard
    }

    fn has_waiting(&self) -> bool {
        self.waiting.load(Ordering::SeqCst) > 0
    }

    fn between_sections<'a>(&self, lock: &'a Lock, held: Write<'a>) -> Write<'a> {
        if !self.has_waiting() {
            return held;
        }
        drop(held);
        self.wake();
        // The wait for the woken lookups to get in, unbounded here (200 µs in the real
        // gate): a lookup counted at a section's end gets in before the next section.
        while self.has_waiting() {
            thread::yield_now();
        }
        lock.write()
    }

    fn unlock(&self, held: Write<'_>) {
        let waiting = self.has_waiting();
        drop(held);
        if waiting || self.has_waiting() {
            self.wake();
        }
    }

    fn wake(&self) {
        *self.ended.lock().unwrap() += 1;
        self.signal.notify_all();
    }
}

#[test]
fn loom_gate_lets_every_waiting_lookup_in_and_shows_whole_sections() {
    loom::model(|| {
        let gate = Arc::new(Gate::default());
        let lock = Arc::new(Lock::default());
        let writer = {
            let (gate, lock) = (Arc::clone(&gate), Arc::clone(&lock));
            thread::spawn(move || {
                // Two sections, then a step-aside and a third: a section adds in two
                // steps, so a lookup inside one would see an odd value.
                let mut held = lock.write();
                held.add(1);
                held.add(1);
                held = gate.between_sections(&lock, held);
                held.add(1);
                held.add(1);
                gate.unlock(held);
                thread::yield_now();
                let mut held = lock.write();
                held.add(1);
                held.add(1);
                gate.unlock(held);
            })
        };
        let lookup = {
            let (gate, lock) = (Arc::clone(&gate), Arc::clone(&lock));
            thread::spawn(move || {
                let first = gate.read(&lock).value();
                let second = gate.read(&lock).value();
                (first, second)
            })
        };
        let here = gate.read(&lock).value();
        assert_eq!(here % 2, 0, "a lookup saw part of a section: {here}");
        let (first, second) = lookup.join().unwrap();
        assert!(
            first % 2 == 0 && second % 2 == 0,
            "a lookup saw part of a section: {first}, {second}"
        );
        assert!(
            first <= second,
            "what a lookup saw went back: {first} > {second}"
        );
        writer.join().unwrap();
        assert_eq!(gate.read(&lock).value(), 6);
        assert!(!gate.has_waiting());
    });
}
