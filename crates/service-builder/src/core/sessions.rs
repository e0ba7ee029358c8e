//! Session affinity around a booking: holding a session while its first booking is in
//! flight, and committing or releasing the hold.

use std::sync::Arc;
use std::time::Instant;

use kv_types::{WorkerId, WorkerKey};

use super::SelectionCore;
use super::partition::Partition;
use crate::admission::Wait;
use crate::catalog::PartitionKey;
use crate::error::SelectionError;
use crate::session::{BindingUpdate, Hold, MAX_SESSION_ID_BYTES, SessionTable, SessionTarget};

/// A session held by an in-flight booking: abandons an uncommitted initialization or
/// releases an unused lease when dropped on an error path.
pub(super) struct SessionGuard<'p> {
    pub(super) table: Option<&'p SessionTable>,
    pub(super) sid: String,
    pub(super) state: GuardState,
    /// Where a hold released unused (a failed booking) republishes its binding, as a
    /// released reservation lease does (replica-sync §7.2): replica sync with affinity on.
    pub(super) mesh: Option<(Arc<replica_sync::ReplicaMesh>, &'p PartitionKey)>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum GuardState {
    Idle,
    Init,
    Bound(SessionTarget),
    /// Committed: the lease now belongs to the reservation row.
    Leased,
}

impl<'p> SessionGuard<'p> {
    pub(super) fn none() -> Self {
        Self {
            table: None,
            sid: String::new(),
            state: GuardState::Idle,
            mesh: None,
        }
    }

    pub(super) fn held(
        table: &'p SessionTable,
        sid: &str,
        state: GuardState,
        mesh: Option<(Arc<replica_sync::ReplicaMesh>, &'p PartitionKey)>,
    ) -> Self {
        Self {
            table: Some(table),
            sid: sid.to_owned(),
            state,
            mesh,
        }
    }

    pub(super) fn bound_target(&self) -> Option<SessionTarget> {
        match self.state {
            GuardState::Bound(t) => Some(t),
            _ => None,
        }
    }

    /// Binds (or checks the binding against) the booked worker and rank.
    pub(super) fn commit(
        &mut self,
        booked: WorkerKey,
        partition: &Partition,
    ) -> Result<Option<BindingUpdate>, SelectionError> {
        let Some(table) = self.table else {
            return Ok(None);
        };
        // A bound target that departed while this request was scheduled is re-acquired
        // without waiting, at most twice (§8.3 item 4).
        for attempt in 0..3 {
            let held = match self.state {
                GuardState::Init => {
                    let target = SessionTarget {
                        worker_id: booked.worker_id.0,
                        dp_rank: Some(booked.dp_rank.0),
                    };
                    let update = table.commit_init(&self.sid, target, Instant::now());
                    self.state = GuardState::Leased;
                    return Ok(Some(update));
                }
                GuardState::Bound(held) => held,
                GuardState::Idle | GuardState::Leased => return Ok(None),
            };
            match table.commit_bound(&self.sid, booked) {
                Ok(update) => {
                    self.state = GuardState::Leased;
                    return Ok(Some(update));
                }
                Err(message) => {
                    // The binding (and with it our lease) is gone.
                    self.state = GuardState::Idle;
                    if partition.schedules(held.worker_id, held.dp_rank) {
                        return Err(SelectionError::bad_request(message));
                    }
                    if attempt == 2 {
                        return Ok(None);
                    }
                    // A fresh hold binds the booked target; another request's new binding
                    // must agree with it; another initializer or a full table leaves the
                    // booking without a binding.
                    self.state = match table.hold(&self.sid, Instant::now(), Wait::No) {
                        Hold::Init => GuardState::Init,
                        Hold::Bound(target) => GuardState::Bound(target),
                        Hold::Busy | Hold::Full => return Ok(None),
                    };
                }
            }
        }
        Ok(None)
    }

    /// Hands the committed lease to the reservation row.
    pub(super) fn into_lease(mut self) -> Option<String> {
        if self.state == GuardState::Leased {
            self.state = GuardState::Idle;
            Some(std::mem::take(&mut self.sid))
        } else {
            None
        }
    }
}

impl Drop for SessionGuard<'_> {
    fn drop(&mut self) {
        let Some(table) = self.table else { return };
        match self.state {
            GuardState::Init => table.abandon(&self.sid),
            GuardState::Bound(_) | GuardState::Leased => {
                if let (Some(update), Some((mesh, key))) =
                    (table.release(&self.sid, Instant::now()), &self.mesh)
                {
                    crate::replica::publish(
                        Some(mesh),
                        crate::replica::binding_event(key, &update),
                    );
                }
            }
            GuardState::Idle => {}
        }
    }
}

pub(super) fn check_session_id(sid: &str) -> Result<(), SelectionError> {
    if sid.len() > MAX_SESSION_ID_BYTES {
        return Err(SelectionError::bad_request(
            "session affinity ID must not exceed 256 bytes",
        ));
    }
    Ok(())
}

pub(super) fn affinity(target: SessionTarget) -> selection_policy::AffinityTarget {
    selection_policy::AffinityTarget {
        worker_id: WorkerId(target.worker_id),
        dp_rank: target.dp_rank.map(kv_types::DpRank),
    }
}

impl SelectionCore {
    /// Holds a session for a booking, dropping bindings to departed workers (§8.3 step 1).
    /// `None` only without `wait`, when another booking is initializing the session.
    pub(super) fn hold_session<'p>(
        &self,
        partition: &'p Partition,
        table: &'p SessionTable,
        sid: &str,
        now: Instant,
        wait: Wait<'_>,
    ) -> Option<SessionGuard<'p>> {
        let mesh = || {
            self.mesh()
                .filter(|m| m.session_affinity())
                .map(|m| (m, &partition.key))
        };
        for _ in 0..32 {
            match table.hold(sid, now, wait) {
                Hold::Init => {
                    return Some(SessionGuard::held(table, sid, GuardState::Init, mesh()));
                }
                Hold::Full => {
                    self.affinity_skipped(partition);
                    return Some(SessionGuard::none());
                }
                Hold::Busy => return None,
                Hold::Bound(target) if partition.schedules(target.worker_id, target.dp_rank) => {
                    let state = GuardState::Bound(target);
                    return Some(SessionGuard::held(table, sid, state, mesh()));
                }
                Hold::Bound(target) => {
                    table.release(sid, now);
                    table.invalidate(sid, target);
                }
            }
        }
        self.affinity_skipped(partition);
        Some(SessionGuard::none())
    }

    /// A session booking goes ahead without affinity: counted, and logged for the first
    /// three, then at powers of two.
    pub(super) fn affinity_skipped(&self, partition: &Partition) {
        let n = self.metrics.session_affinity_skipped.inc() + 1;
        if n <= 3 || n.is_power_of_two() {
            tracing::warn!(
                partition = %partition.key.for_log(),
                occurrences = n,
                "session booked without affinity: the partition's session table is full, or \
                 the session's first booking is stuck"
            );
        }
    }
}
