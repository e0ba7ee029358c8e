//! Session-affinity tables, hard mode (`spec/service-semantics.md` §8).
//!
//! One table per partition. A booking *holds* its session before scheduling: an absent
//! session becomes `Initializing` (owned by that request until it commits or abandons), a
//! bound one lends its target as the affinity target and counts a lease. Leases live in the
//! reservation row and are released when the reservation goes away, which starts the idle
//! TTL. A concurrent request for a session that is being initialized waits (bounded) on a
//! condition variable, so the table never hands out two different first bindings.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kv_types::WorkerKey;
use parking_lot::{Condvar, Mutex};

use crate::admission::{MAX_QUEUE_WAIT, Wait};

/// Largest accepted session id, in bytes.
pub const MAX_SESSION_ID_BYTES: usize = 256;
/// Entries per table.
pub const MAX_SESSIONS_PER_TABLE: usize = 65_536;
/// How long a request waits behind another request initializing the same session:
/// until the initializer resolves (§8.2), which it does within its own admission deadline,
/// so this only guards against a bug.
const INIT_WAIT: Duration = MAX_QUEUE_WAIT.saturating_add(Duration::from_secs(30));
/// How often such a wait checks whether its caller went away.
const CANCEL_CHECK: Duration = Duration::from_millis(100);

/// Where a session is bound: a worker and, for bindings made by bookings, its rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionTarget {
    pub worker_id: u64,
    pub dp_rank: Option<u32>,
}

/// `(sequence, writer_id)`: versions compare lexicographically.
pub type BindingVersion = (u64, u64);

#[derive(Debug)]
enum Entry {
    Initializing,
    Bound {
        target: SessionTarget,
        version: BindingVersion,
        leases: u32,
        idle_deadline: Instant,
    },
}

/// What a hold got.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Hold {
    /// The caller owns the initialization: it must commit or abandon.
    Init,
    /// Bound: the caller holds one lease on this target.
    Bound(SessionTarget),
    /// The table is full: proceed without affinity.
    Full,
    /// Another booking is initializing the session and the caller asked not to wait.
    Busy,
}

/// A binding change other replicas should learn about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BindingUpdate {
    pub session_id: String,
    pub target: SessionTarget,
    pub version: BindingVersion,
    pub ttl: Duration,
}

#[derive(Debug)]
pub(crate) struct SessionTable {
    ttl: Duration,
    writer_id: u64,
    entries: Mutex<Tables>,
    changed: Condvar,
}

#[derive(Debug)]
struct Tables {
    map: HashMap<String, Entry>,
    sequence: u64,
}

impl SessionTable {
    pub(crate) fn new(ttl: Duration, writer_id: u64, start_sequence: u64) -> Self {
        Self {
            ttl,
            writer_id,
            entries: Mutex::new(Tables {
                map: HashMap::new(),
                sequence: start_sequence,
            }),
            changed: Condvar::new(),
        }
    }

    /// The live binding, if any (reads never create, refresh or hold).
    pub(crate) fn read(&self, session: &str, now: Instant) -> Option<SessionTarget> {
        match self.entries.lock().map.get(session) {
            Some(Entry::Bound {
                target,
                leases,
                idle_deadline,
                ..
            }) if *leases > 0 || *idle_deadline > now => Some(*target),
            _ => None,
        }
    }

    /// Holds the session for a booking. Behind a concurrent initializer it waits (bounded)
    /// when `wait` is set, else returns [`Hold::Busy`] at once.
    pub(crate) fn hold(&self, session: &str, now: Instant, wait: Wait<'_>) -> Hold {
        let mut t = self.entries.lock();
        let give_up = Instant::now() + INIT_WAIT;
        loop {
            match t.map.get_mut(session) {
                Some(Entry::Initializing) if !wait.allowed() => return Hold::Busy,
                // Nothing held: the caller's result goes nowhere.
                Some(Entry::Initializing) if wait.cancelled() => return Hold::Busy,
                Some(Entry::Initializing) => {
                    // In slices, so a caller that went away is noticed.
                    let slice = (Instant::now() + CANCEL_CHECK).min(give_up);
                    if self.changed.wait_until(&mut t, slice).timed_out()
                        && Instant::now() >= give_up
                    {
                        // The initializer is stuck: proceed without affinity rather than hang.
                        return Hold::Full;
                    }
                }
                Some(Entry::Bound {
                    target,
                    leases,
                    idle_deadline,
                    ..
                }) if *leases > 0 || *idle_deadline > now => {
                    *leases += 1;
                    return Hold::Bound(*target);
                }
                Some(_) => {
                    t.map.insert(session.to_owned(), Entry::Initializing);
                    return Hold::Init;
                }
                None => {
                    if t.map.len() >= MAX_SESSIONS_PER_TABLE {
                        reap(&mut t.map, now);
                        if t.map.len() >= MAX_SESSIONS_PER_TABLE {
                            return Hold::Full;
                        }
                    }
                    t.map.insert(session.to_owned(), Entry::Initializing);
                    return Hold::Init;
                }
            }
        }
    }

    /// Completes an initialization with the booked target; the caller holds one lease.
    pub(crate) fn commit_init(
        &self,
        session: &str,
        target: SessionTarget,
        now: Instant,
    ) -> BindingUpdate {
        let mut t = self.entries.lock();
        t.sequence += 1;
        let version = (t.sequence, self.writer_id);
        t.map.insert(
            session.to_owned(),
            Entry::Bound {
                target,
                version,
                leases: 1,
                idle_deadline: now + self.ttl,
            },
        );
        drop(t);
        self.changed.notify_all();
        BindingUpdate {
            session_id: session.to_owned(),
            target,
            version,
            ttl: self.ttl,
        }
    }

    /// Checks a booked target against a bound lease (hard mode). On mismatch the binding is
    /// dropped (the next request re-initializes) and the caller's lease is gone with it.
    pub(crate) fn commit_bound(
        &self,
        session: &str,
        booked: WorkerKey,
    ) -> Result<BindingUpdate, String> {
        let mut t = self.entries.lock();
        let Some(Entry::Bound {
            target, version, ..
        }) = t.map.get(session)
        else {
            return Err(format!("session {session} binding was removed"));
        };
        let (target, version) = (*target, *version);
        let worker_ok = target.worker_id == booked.worker_id.0;
        let rank_ok = target.dp_rank.is_none_or(|r| r == booked.dp_rank.0);
        if worker_ok && rank_ok {
            return Ok(BindingUpdate {
                session_id: session.to_owned(),
                target,
                version,
                ttl: self.ttl,
            });
        }
        t.map.remove(session);
        drop(t);
        self.changed.notify_all();
        Err(if worker_ok {
            format!(
                "session {session} is bound to DP rank {}, not {}",
                target.dp_rank.unwrap_or_default(),
                booked.dp_rank
            )
        } else {
            format!(
                "session {session} is bound to worker {}, not {}",
                target.worker_id, booked.worker_id
            )
        })
    }

    /// Drops an uncommitted initialization.
    pub(crate) fn abandon(&self, session: &str) {
        let mut t = self.entries.lock();
        if matches!(t.map.get(session), Some(Entry::Initializing)) {
            t.map.remove(session);
        }
        drop(t);
        self.changed.notify_all();
    }

    /// Drops a binding that points at a departed worker (only if it still does).
    pub(crate) fn invalidate(&self, session: &str, stale: SessionTarget) {
        let mut t = self.entries.lock();
        if matches!(t.map.get(session), Some(Entry::Bound { target, .. }) if *target == stale) {
            t.map.remove(session);
        }
    }

    /// Releases one lease; the last one starts the idle TTL. Returns the binding (version
    /// unchanged) for peers to refresh their idle deadline (replica-sync §7.2).
    pub(crate) fn release(&self, session: &str, now: Instant) -> Option<BindingUpdate> {
        let mut t = self.entries.lock();
        let Some(Entry::Bound {
            target,
            version,
            leases,
            idle_deadline,
        }) = t.map.get_mut(session)
        else {
            return None;
        };
        *leases = leases.saturating_sub(1);
        if *leases == 0 {
            *idle_deadline = now + self.ttl;
        }
        Some(BindingUpdate {
            session_id: session.to_owned(),
            target: *target,
            version: *version,
            ttl: self.ttl,
        })
    }

    /// Raises the version counter past a peer's `sequence` (replica-sync §7.3 step 3), so
    /// this replica's next binding wins over everything it has seen.
    pub(crate) fn observe_sequence(&self, sequence: u64) {
        let mut t = self.entries.lock();
        t.sequence = t.sequence.max(sequence.saturating_add(1));
    }

    /// Applies a peer's binding (replica-sync §7.3 step 6): inserted when absent; ignored
    /// while a local request initializes the session; replacing an idle-expired binding;
    /// refreshing one to the same target at an equal or newer version; replacing one to
    /// another target only at a newer version. Returns whether it was applied.
    pub(crate) fn apply_remote(&self, update: &BindingUpdate, now: Instant) -> bool {
        let mut t = self.entries.lock();
        t.sequence = t.sequence.max(update.version.0.saturating_add(1));
        let leases = match t.map.get(&update.session_id) {
            None if t.map.len() < MAX_SESSIONS_PER_TABLE => 0,
            None | Some(Entry::Initializing) => return false,
            Some(Entry::Bound {
                leases,
                idle_deadline,
                ..
            }) if *leases == 0 && *idle_deadline <= now => 0,
            Some(Entry::Bound {
                target,
                version,
                leases,
                ..
            }) => {
                let applies = if *target == update.target {
                    update.version >= *version
                } else {
                    update.version > *version
                };
                if !applies {
                    return false;
                }
                *leases
            }
        };
        t.map.insert(
            update.session_id.clone(),
            Entry::Bound {
                target: update.target,
                version: update.version,
                leases,
                idle_deadline: now + self.ttl,
            },
        );
        true
    }

    /// Removes expired bindings; returns how many.
    pub(crate) fn reap(&self, now: Instant) -> usize {
        reap(&mut self.entries.lock().map, now)
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.lock().map.len()
    }
}

fn reap(map: &mut HashMap<String, Entry>, now: Instant) -> usize {
    let before = map.len();
    map.retain(|_, e| match e {
        Entry::Initializing => true,
        Entry::Bound {
            leases,
            idle_deadline,
            ..
        } => *leases > 0 || *idle_deadline > now,
    });
    before - map.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(w: u64, r: Option<u32>) -> SessionTarget {
        SessionTarget {
            worker_id: w,
            dp_rank: r,
        }
    }

    #[test]
    fn first_hold_initializes_then_binds() {
        let t = SessionTable::new(Duration::from_secs(10), 0, 1);
        let now = Instant::now();
        assert_eq!(t.hold("s", now, Wait::Yes(None)), Hold::Init);
        t.commit_init("s", target(7, Some(1)), now);
        assert_eq!(t.read("s", now), Some(target(7, Some(1))));
        assert_eq!(
            t.hold("s", now, Wait::Yes(None)),
            Hold::Bound(target(7, Some(1)))
        );
        assert!(t.commit_bound("s", WorkerKey::new(7, 1)).is_ok());
    }

    #[test]
    fn peer_bindings_apply_by_the_replica_rules() {
        let ttl = Duration::from_secs(10);
        let t = SessionTable::new(ttl, 0, 1);
        let now = Instant::now();
        let update = |w: u64, version: BindingVersion| BindingUpdate {
            session_id: "s".into(),
            target: target(w, Some(0)),
            version,
            ttl,
        };
        // Absent: inserted.
        assert!(t.apply_remote(&update(1, (5, 9)), now));
        // Same target, same version: adopted (the deadline refresh a released lease sends).
        let later = now + Duration::from_secs(8);
        assert!(t.apply_remote(&update(1, (5, 9)), later));
        assert_eq!(
            t.read("s", now + Duration::from_secs(15)),
            Some(target(1, Some(0)))
        );
        // Another target needs a newer version.
        assert!(!t.apply_remote(&update(2, (5, 9)), later));
        assert!(!t.apply_remote(&update(2, (4, 99)), later));
        assert!(t.apply_remote(&update(2, (5, 10)), later));
        assert_eq!(t.read("s", later), Some(target(2, Some(0))));
        // Idle-expired: replaced whatever the version.
        let expired = later + ttl + Duration::from_secs(1);
        assert!(t.apply_remote(&update(3, (1, 1)), expired));
        assert_eq!(t.read("s", expired), Some(target(3, Some(0))));
        // A local initializer wins.
        assert_eq!(t.hold("x", now, Wait::No), Hold::Init);
        let x = BindingUpdate {
            session_id: "x".into(),
            ..update(1, (50, 9))
        };
        assert!(!t.apply_remote(&x, now));
    }

    #[test]
    fn a_seen_sequence_orders_the_next_local_binding_after_it() {
        let t = SessionTable::new(Duration::from_secs(10), 0, 1);
        let now = Instant::now();
        t.observe_sequence(41);
        t.observe_sequence(7);
        assert_eq!(t.hold("s", now, Wait::No), Hold::Init);
        assert_eq!(t.commit_init("s", target(7, None), now).version.0, 43);
    }

    #[test]
    fn releasing_a_lease_returns_the_unchanged_binding() {
        let t = SessionTable::new(Duration::from_secs(10), 0, 1);
        let now = Instant::now();
        assert_eq!(t.hold("s", now, Wait::No), Hold::Init);
        let bound = t.commit_init("s", target(7, Some(1)), now);
        let released = t.release("s", now).expect("still bound");
        assert_eq!(
            (released.target, released.version),
            (bound.target, bound.version)
        );
        assert!(t.release("gone", now).is_none());
    }

    #[test]
    fn a_hold_that_may_not_wait_is_busy_behind_an_initializer() {
        let t = SessionTable::new(Duration::from_secs(10), 0, 1);
        let now = Instant::now();
        assert_eq!(t.hold("s", now, Wait::No), Hold::Init);
        assert_eq!(t.hold("s", now, Wait::No), Hold::Busy);
        // Other sessions are not affected.
        assert_eq!(t.hold("other", now, Wait::No), Hold::Init);
        t.commit_init("s", target(7, Some(1)), now);
        assert_eq!(t.hold("s", now, Wait::No), Hold::Bound(target(7, Some(1))));
    }

    #[test]
    fn mismatched_commit_drops_the_binding_with_the_contract_message() {
        let t = SessionTable::new(Duration::from_secs(10), 0, 1);
        let now = Instant::now();
        t.hold("s", now, Wait::Yes(None));
        t.commit_init("s", target(7, Some(1)), now);
        t.hold("s", now, Wait::Yes(None));
        assert_eq!(
            t.commit_bound("s", WorkerKey::new(8, 1)).unwrap_err(),
            "session s is bound to worker 7, not 8"
        );
        assert_eq!(t.read("s", now), None);
        t.hold("s", now, Wait::Yes(None));
        t.commit_init("s", target(7, Some(1)), now);
        t.hold("s", now, Wait::Yes(None));
        assert_eq!(
            t.commit_bound("s", WorkerKey::new(7, 0)).unwrap_err(),
            "session s is bound to DP rank 1, not 0"
        );
    }

    #[test]
    fn idle_ttl_starts_when_the_last_lease_is_released() {
        let t = SessionTable::new(Duration::from_secs(10), 0, 1);
        let now = Instant::now();
        t.hold("s", now, Wait::Yes(None));
        t.commit_init("s", target(1, Some(0)), now);
        let later = now + Duration::from_secs(60);
        assert!(
            t.read("s", later).is_some(),
            "a leased binding does not expire"
        );
        t.release("s", later);
        assert!(t.read("s", later + Duration::from_secs(9)).is_some());
        assert!(t.read("s", later + Duration::from_secs(11)).is_none());
        assert_eq!(t.reap(later + Duration::from_secs(11)), 1);
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn abandoned_initialization_lets_the_next_request_initialize() {
        let t = SessionTable::new(Duration::from_secs(10), 0, 1);
        let now = Instant::now();
        assert_eq!(t.hold("s", now, Wait::Yes(None)), Hold::Init);
        t.abandon("s");
        assert_eq!(t.hold("s", now, Wait::Yes(None)), Hold::Init);
    }

    #[test]
    fn a_waiting_hold_sees_the_concurrent_commit() {
        let t = std::sync::Arc::new(SessionTable::new(Duration::from_secs(10), 0, 1));
        let now = Instant::now();
        assert_eq!(t.hold("s", now, Wait::Yes(None)), Hold::Init);
        let t2 = std::sync::Arc::clone(&t);
        let waiter = std::thread::spawn(move || t2.hold("s", now, Wait::Yes(None)));
        std::thread::sleep(Duration::from_millis(20));
        t.commit_init("s", target(3, Some(0)), now);
        assert_eq!(waiter.join().unwrap(), Hold::Bound(target(3, Some(0))));
    }

    #[test]
    fn remote_bindings_apply_by_version() {
        let t = SessionTable::new(Duration::from_secs(10), 1, 100);
        let now = Instant::now();
        let u = |w, seq| BindingUpdate {
            session_id: "s".into(),
            target: target(w, Some(0)),
            version: (seq, 2),
            ttl: Duration::from_secs(10),
        };
        assert!(t.apply_remote(&u(5, 50), now));
        assert!(!t.apply_remote(&u(6, 49), now));
        assert_eq!(t.read("s", now), Some(target(5, Some(0))));
        // Our next local version is above everything observed.
        t.hold("x", now, Wait::Yes(None));
        assert!(t.commit_init("x", target(1, None), now).version.0 > 100);
    }
}
