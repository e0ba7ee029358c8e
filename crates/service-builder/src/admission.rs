//! The partition's admission queue in service form (`spec/scheduling.md` §5): a request
//! whose eligible ranks are all busy waits (on the blocking pool) until a free, a prefill
//! completion, a catalog change or the periodic re-check lets it through.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_types::WorkerKey;
use parking_lot::{Condvar, Mutex};
use selection_policy::{
    AdmissionQueue, Arrival, Offer, PolicyClass, PolicyClasses, QueueRejected, TryOffer, Waiting,
};

/// Longest a request waits in the queue before it gives up (429, request deadline
/// exceeded); keeps a caller that went away from holding a thread forever.
pub(crate) const MAX_QUEUE_WAIT: Duration = Duration::from_secs(300);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TicketState {
    Waiting,
    Admitted,
    ShutDown,
    Abandoned,
}

/// One queued request.
#[derive(Debug)]
pub(crate) struct Ticket {
    state: Mutex<TicketState>,
    cv: Condvar,
    /// Eligibility for the gate: the allow-list (None = all).
    pub(crate) allowed: Option<Vec<u64>>,
}

/// How a wait ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum WaitOutcome {
    Admitted,
    ShutDown,
    TimedOut,
}

impl Ticket {
    pub(crate) fn new(allowed: Option<Vec<u64>>) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(TicketState::Waiting),
            cv: Condvar::new(),
            allowed,
        })
    }

    fn resolve(&self, to: TicketState) -> bool {
        let mut s = self.state.lock();
        if *s != TicketState::Waiting {
            return false;
        }
        *s = to;
        drop(s);
        self.cv.notify_all();
        true
    }

    pub(crate) fn wait(&self, max: Duration) -> WaitOutcome {
        let deadline = Instant::now() + max;
        let mut s = self.state.lock();
        loop {
            match *s {
                TicketState::Admitted => return WaitOutcome::Admitted,
                TicketState::ShutDown => return WaitOutcome::ShutDown,
                TicketState::Abandoned => return WaitOutcome::TimedOut,
                TicketState::Waiting => {
                    // A drain may admit the ticket between the timeout and re-locking: then
                    // the admission stands (the drain stopped at this ticket, so dropping it
                    // would strand the next waiter). Loom model: tests/it/loom.rs.
                    if self.cv.wait_until(&mut s, deadline).timed_out()
                        && *s == TicketState::Waiting
                    {
                        *s = TicketState::Abandoned;
                        return WaitOutcome::TimedOut;
                    }
                }
            }
        }
    }
}

/// The queue of one partition, with its policy classes.
#[derive(Debug)]
pub(crate) struct PartitionQueue {
    queue: Mutex<AdmissionQueue<Arc<Ticket>>>,
    classes: PolicyClasses,
}

impl PartitionQueue {
    /// `None` when no class has a busy threshold (nothing ever waits).
    pub(crate) fn new(classes: &PolicyClasses) -> Option<Self> {
        if !classes.queueing_enabled() {
            return None;
        }
        AdmissionQueue::new(classes.classes().to_vec(), Instant::now())
            .ok()
            .map(|q| Self {
                queue: Mutex::new(q),
                classes: classes.clone(),
            })
    }

    pub(crate) fn classes(&self) -> &PolicyClasses {
        &self.classes
    }

    /// Offers a request; `Ok(None)` = admitted now, `Ok(Some(ticket))` = wait on it.
    pub(crate) fn offer(
        &self,
        arrival: Arrival<Arc<Ticket>>,
        registered_workers: usize,
        gate: impl FnMut(&PolicyClass, &Waiting<Arc<Ticket>>) -> bool,
    ) -> Result<Option<Arc<Ticket>>, QueueRejected> {
        let ticket = Arc::clone(&arrival.payload);
        let offered = self
            .queue
            .lock()
            .offer(arrival, registered_workers, Instant::now(), gate)?;
        Ok(match offered {
            Offer::Admit(_) => None,
            Offer::Queued => Some(ticket),
        })
    }

    /// [`Self::offer`] for a caller that must not wait: `Ok(false)` where `offer` would
    /// have queued the request (nothing is queued then).
    pub(crate) fn try_offer(
        &self,
        arrival: Arrival<Arc<Ticket>>,
        registered_workers: usize,
        gate: impl FnMut(&PolicyClass, &Waiting<Arc<Ticket>>) -> bool,
    ) -> Result<bool, QueueRejected> {
        let offered = self
            .queue
            .lock()
            .try_offer(arrival, registered_workers, gate)?;
        Ok(matches!(offered, TryOffer::Admit(_)))
    }

    /// Admits the best waiting request the gate lets through now, if any.
    ///
    /// One at a time: the admitted request books (changing the load the gate reads) and
    /// then re-checks the queue itself, so a single free cannot release every waiter
    /// against a stale load picture. Abandoned tickets are skipped.
    pub(crate) fn drain(&self, mut gate: impl FnMut(&PolicyClass, &Waiting<Arc<Ticket>>) -> bool) {
        let mut q = self.queue.lock();
        while let Some(ticket) = q.next_ready(&mut gate) {
            if ticket.resolve(TicketState::Admitted) {
                return;
            }
        }
    }

    pub(crate) fn shut_down(&self) {
        for ticket in self.queue.lock().drain_all() {
            ticket.resolve(TicketState::ShutDown);
        }
    }

    /// `(pending_count, pending_isl_tokens)` for `/loads`.
    pub(crate) fn pending(&self) -> (u64, u64) {
        let q = self.queue.lock();
        (q.len() as u64, q.pending_isl_tokens())
    }
}

/// Whether `key` may serve a waiting request (allow-list and pin).
pub(crate) fn eligible(w: &Waiting<Arc<Ticket>>, key: WorkerKey) -> bool {
    w.pinned.is_none_or(|p| p == key)
        && w.payload
            .allowed
            .as_ref()
            .is_none_or(|a| a.contains(&key.worker_id.0))
}
