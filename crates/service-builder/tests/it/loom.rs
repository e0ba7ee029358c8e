//! loom models of the admission queue's ticket protocol (compiled only with `--cfg loom`; run
//! by `cargo xtask loom`).
//!
//! The production [`Ticket`](../../src/admission.rs) waits with parking_lot's
//! `Condvar::wait_until` and a real deadline, which loom cannot drive, so this is a minimal
//! replica of the protocol on loom's primitives. Keep it in step with `src/admission.rs`
//! (`Ticket::resolve`, `Ticket::wait`, `PartitionQueue::{offer, drain, shut_down}`) and its
//! callers in `src/core.rs` (`admit`: offer under the ledger lock, then wait;
//! `recheck_queue` after every free and after a request let out of the queue has booked).
//! The gate is "a slot is free" (one counter under the ledger lock); policy classes and
//! ordering are the selection-policy queue's business and are not modeled.
//!
//! A deadline is a flag that a timer thread raises (under the ticket lock, then it
//! notifies, as the timeout would wake the sleeper); `wait_until` reports a timeout when
//! the flag is up once it has re-locked, so a notification that races the deadline may be
//! reported as a timeout, as with parking_lot.
//!
//! Invariants: a ticket is resolved at most once and its waiter returns exactly that
//! resolution (or times out when nothing resolved it); a release never loses a wake-up: a
//! waiter without a deadline is always let through once a slot is freed (otherwise loom
//! reports the blocked waiter as a deadlock).

use std::collections::VecDeque;

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::{Arc, Condvar, Mutex, MutexGuard};
use loom::thread;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    Waiting,
    Admitted,
    ShutDown,
    Abandoned,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Outcome {
    Admitted,
    ShutDown,
    TimedOut,
}

/// How a timed-out wait treats a ticket that was resolved meanwhile.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Timeout {
    /// The production rule: abandon only a ticket that is still waiting.
    KeepsAResolution,
    /// The rule before the fix: abandon unconditionally.
    Overrides,
}

#[derive(Debug)]
struct Ticket {
    state: Mutex<State>,
    cv: Condvar,
    deadline_passed: AtomicBool,
    timeout: Timeout,
}

impl Ticket {
    fn new(timeout: Timeout) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State::Waiting),
            cv: Condvar::new(),
            deadline_passed: AtomicBool::new(false),
            timeout,
        })
    }

    fn resolve(&self, to: State) -> bool {
        let mut s = self.state.lock().unwrap();
        if *s != State::Waiting {
            return false;
        }
        *s = to;
        drop(s);
        self.cv.notify_all();
        true
    }

    /// The timer: the waiter's deadline passes.
    fn pass_deadline(&self) {
        let s = self.state.lock().unwrap();
        self.deadline_passed.store(true, Ordering::SeqCst);
        drop(s);
        self.cv.notify_all();
    }

    fn wait(&self) -> Outcome {
        let mut s = self.state.lock().unwrap();
        loop {
            match *s {
                State::Admitted => return Outcome::Admitted,
                State::ShutDown => return Outcome::ShutDown,
                State::Abandoned => return Outcome::TimedOut,
                State::Waiting => {
                    let timed_out;
                    (s, timed_out) = self.wait_until(s);
                    if timed_out && (self.timeout == Timeout::Overrides || *s == State::Waiting) {
                        *s = State::Abandoned;
                        return Outcome::TimedOut;
                    }
                }
            }
        }
    }

    /// parking_lot's `wait_until`: unlock, sleep until notified or the deadline, re-lock.
    fn wait_until<'a>(&'a self, s: MutexGuard<'a, State>) -> (MutexGuard<'a, State>, bool) {
        if self.deadline_passed.load(Ordering::SeqCst) {
            // A deadline in the past still unlocks and re-locks.
            drop(s);
            return (self.state.lock().unwrap(), true);
        }
        let s = self.cv.wait(s).unwrap();
        let timed_out = self.deadline_passed.load(Ordering::SeqCst);
        (s, timed_out)
    }
}

/// One partition: free slots under the ledger lock, and the queue of tickets.
#[derive(Debug, Default)]
struct Partition {
    free_slots: Mutex<i32>,
    queue: Mutex<VecDeque<Arc<Ticket>>>,
}

impl Partition {
    /// `true` = admitted at once (nobody waits and a slot is free), else queued.
    fn offer(&self, ticket: &Arc<Ticket>) -> bool {
        let slots = self.free_slots.lock().unwrap();
        let mut q = self.queue.lock().unwrap();
        if q.is_empty() && *slots > 0 {
            return true;
        }
        q.push_back(Arc::clone(ticket));
        false
    }

    /// `PartitionQueue::drain`: admits one waiter the gate lets through, skipping
    /// abandoned tickets; returns whether it admitted one.
    fn drain(&self) -> bool {
        let slots = self.free_slots.lock().unwrap();
        let mut q = self.queue.lock().unwrap();
        while *slots > 0 {
            let Some(ticket) = q.pop_front() else { break };
            if ticket.resolve(State::Admitted) {
                return true;
            }
        }
        false
    }

    fn shut_down(&self) -> bool {
        let mut resolved = false;
        for ticket in self.queue.lock().unwrap().drain(..) {
            resolved |= ticket.resolve(State::ShutDown);
        }
        resolved
    }

    fn book(&self) {
        *self.free_slots.lock().unwrap() -= 1;
    }

    /// A free: the slot comes back, then `recheck_queue`.
    fn free(&self) {
        *self.free_slots.lock().unwrap() += 1;
        self.drain();
    }

    /// A select: offer, wait if queued; once let out of the queue, book and re-check.
    fn request(&self, ticket: &Arc<Ticket>) -> Outcome {
        if self.offer(ticket) {
            self.book();
            return Outcome::Admitted;
        }
        let outcome = ticket.wait();
        if outcome == Outcome::Admitted {
            self.book();
            self.drain();
        }
        outcome
    }
}

/// No slot is free; request 1 waits with a deadline, request 2 (without one) arrives at any
/// time, and one earlier request frees its slot. Whatever request 1 does (admitted and
/// later freeing, or timing out, even at the moment it is admitted), request 2 gets through.
fn a_release_reaches_a_waiter(timeout: Timeout) {
    loom::model(move || {
        let p = Arc::new(Partition::default());
        let first = Ticket::new(timeout);
        assert!(!p.offer(&first));

        let waiter = {
            let (p, first) = (Arc::clone(&p), Arc::clone(&first));
            thread::spawn(move || {
                let outcome = first.wait();
                if outcome == Outcome::Admitted {
                    p.book();
                    p.drain();
                    p.free();
                }
                outcome
            })
        };
        let timer = {
            let first = Arc::clone(&first);
            thread::spawn(move || first.pass_deadline())
        };
        let releaser = {
            let p = Arc::clone(&p);
            thread::spawn(move || p.free())
        };
        let second = Ticket::new(timeout);
        assert_eq!(p.request(&second), Outcome::Admitted);

        let outcome = waiter.join().unwrap();
        timer.join().unwrap();
        releaser.join().unwrap();
        let state = *first.state.lock().unwrap();
        match outcome {
            Outcome::Admitted => assert_eq!(state, State::Admitted),
            Outcome::TimedOut => assert_eq!(state, State::Abandoned),
            Outcome::ShutDown => panic!("nobody shut down"),
        }
        // Both requests finished or gave up: the one freed slot is free again, or held by
        // request 2.
        assert_eq!(*p.free_slots.lock().unwrap(), 0);
    });
}

#[test]
fn loom_a_release_never_loses_a_wakeup() {
    a_release_reaches_a_waiter(Timeout::KeepsAResolution);
}

/// The model has teeth: with the rule before the fix, a waiter that times out just as a
/// drain admits it swallows the release, and the next waiter blocks forever.
#[test]
#[should_panic(expected = "deadlock")]
fn loom_finds_the_lost_wakeup_of_an_overriding_timeout() {
    a_release_reaches_a_waiter(Timeout::Overrides);
}

/// A free, a shutdown and the deadline race for one waiting ticket: exactly one of them
/// decides, and the waiter returns what it decided.
#[test]
fn loom_a_ticket_is_resolved_exactly_once() {
    loom::model(|| {
        let p = Arc::new(Partition::default());
        let ticket = Ticket::new(Timeout::KeepsAResolution);
        assert!(!p.offer(&ticket));
        let releaser = {
            let p = Arc::clone(&p);
            thread::spawn(move || {
                *p.free_slots.lock().unwrap() += 1;
                p.drain()
            })
        };
        let stopper = {
            let p = Arc::clone(&p);
            thread::spawn(move || p.shut_down())
        };
        let timer = {
            let ticket = Arc::clone(&ticket);
            thread::spawn(move || ticket.pass_deadline())
        };
        let outcome = ticket.wait();
        let admitted = releaser.join().unwrap();
        let shut_down = stopper.join().unwrap();
        timer.join().unwrap();
        assert!(!(admitted && shut_down), "resolved twice");
        let want = if admitted {
            Outcome::Admitted
        } else if shut_down {
            Outcome::ShutDown
        } else {
            Outcome::TimedOut
        };
        assert_eq!(outcome, want);
    });
}

/// The session table's first-binding protocol (`src/session.rs`: `hold`, `commit_init`,
/// `abandon`), replicated for one session on loom's primitives (the production wait is
/// bounded by `INIT_WAIT`, which the model leaves out, so a missed notification shows up
/// as a deadlock). Invariant: exactly one request initializes the session, and every hold
/// that finds it bound sees that request's target; an abandoned initialization lets the
/// next request initialize.
#[test]
fn loom_a_session_gets_exactly_one_first_binding() {
    #[derive(Clone, Copy, PartialEq, Debug)]
    enum Entry {
        Initializing,
        Bound(u64),
    }
    #[derive(Debug, Default)]
    struct Table {
        entry: Mutex<Option<Entry>>,
        changed: Condvar,
    }
    impl Table {
        /// `Some(target)` = bound, `None` = the caller initializes.
        fn hold(&self) -> Option<u64> {
            let mut e = self.entry.lock().unwrap();
            loop {
                match *e {
                    Some(Entry::Initializing) => e = self.changed.wait(e).unwrap(),
                    Some(Entry::Bound(t)) => return Some(t),
                    None => {
                        *e = Some(Entry::Initializing);
                        return None;
                    }
                }
            }
        }
        fn commit_init(&self, target: u64) {
            *self.entry.lock().unwrap() = Some(Entry::Bound(target));
            self.changed.notify_all();
        }
        fn abandon(&self) {
            let mut e = self.entry.lock().unwrap();
            if *e == Some(Entry::Initializing) {
                *e = None;
            }
            drop(e);
            self.changed.notify_all();
        }
    }

    loom::model(|| {
        let table = Arc::new(Table::default());
        let commits = Arc::new(loom::sync::atomic::AtomicUsize::new(0));
        // Requests 1 and 2 commit when they initialize; request 3's first booking fails
        // (it abandons), then it holds once more.
        let spawn = |me: u64| {
            let (table, commits) = (Arc::clone(&table), Arc::clone(&commits));
            thread::spawn(move || {
                let mut seen = Vec::new();
                for attempt in 0..2 {
                    match table.hold() {
                        Some(t) => {
                            seen.push(t);
                            break;
                        }
                        None if me == 3 && attempt == 0 => table.abandon(),
                        None => {
                            commits.fetch_add(1, Ordering::SeqCst);
                            table.commit_init(me);
                            seen.push(me);
                            break;
                        }
                    }
                }
                seen
            })
        };
        let threads = [spawn(1), spawn(2), spawn(3)];
        let seen: Vec<u64> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        assert_eq!(commits.load(Ordering::SeqCst), 1, "two first bindings");
        let Some(Entry::Bound(bound)) = *table.entry.lock().unwrap() else {
            panic!("the session is not bound");
        };
        assert_eq!(seen.len(), 3);
        assert!(seen.iter().all(|&t| t == bound), "{seen:?} vs {bound}");
    });
}
