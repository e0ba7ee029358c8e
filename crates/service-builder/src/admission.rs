//! The partition's admission queue in service form (`spec/scheduling.md` §5): a request
//! whose eligible ranks are all busy waits (on a thread of its own, see `SelectionService`) until a free, a prefill
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
    /// The caller went away ([`Cancel::cancel`]); skipped by drains like an abandoned one.
    Cancelled,
}

/// One queued request.
#[derive(Debug)]
pub(crate) struct Ticket {
    state: Mutex<TicketState>,
    cv: Condvar,
    /// Eligibility for the gate: the allow-list (None = all).
    pub(crate) allowed: Option<Vec<u64>>,
    /// ... and the taints a worker must carry (service-semantics §5.3).
    pub(crate) required_taints: Vec<String>,
}

/// How a wait ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum WaitOutcome {
    Admitted,
    ShutDown,
    TimedOut,
    Cancelled,
}

impl Ticket {
    pub(crate) fn new(allowed: Option<Vec<u64>>, required_taints: Vec<String>) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(TicketState::Waiting),
            cv: Condvar::new(),
            allowed,
            required_taints,
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
                TicketState::Cancelled => return WaitOutcome::Cancelled,
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

/// Whether an operation may wait (in the admission queue, or behind another request
/// initializing its session), and what tells it that its caller went away.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Wait<'a> {
    /// The `try_*` calls: stop instead (`Stop::WouldWait`), with nothing changed.
    No,
    /// Wait; with a [`Cancel`], only while the caller is there.
    Yes(Option<&'a Cancel>),
}

impl<'a> Wait<'a> {
    pub(crate) fn allowed(self) -> bool {
        matches!(self, Self::Yes(_))
    }

    pub(crate) fn cancel(self) -> Option<&'a Cancel> {
        match self {
            Self::Yes(cancel) => cancel,
            Self::No => None,
        }
    }

    /// Whether the caller has gone away.
    pub(crate) fn cancelled(self) -> bool {
        self.cancel().is_some_and(Cancel::is_cancelled)
    }
}

/// Releases what an operation booked for a caller that never received it.
pub(crate) type Undo = Box<dyn FnOnce() + Send>;

/// The caller's side of an operation an async caller runs on a waiting thread. When the
/// caller goes away ([`Self::cancel`], from a drop guard), a request waiting in the
/// admission queue leaves it, and what a finished operation booked but nobody received is
/// freed: service-semantics §5.2, "if the caller disappears ... the booking is freed and
/// the id claim released (no leaked load)".
#[derive(Default)]
pub(crate) struct Cancel {
    state: Mutex<CancelState>,
}

#[derive(Default)]
struct CancelState {
    cancelled: bool,
    /// The ticket the operation waits on, while it may.
    ticket: Option<Arc<Ticket>>,
    /// Frees what the finished operation booked, until the caller takes the result.
    undo: Option<Undo>,
}

impl std::fmt::Debug for Cancel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state.lock();
        f.debug_struct("Cancel")
            .field("cancelled", &s.cancelled)
            .field("waiting", &s.ticket.is_some())
            .field("undo", &s.undo.is_some())
            .finish()
    }
}

impl Cancel {
    pub(crate) fn is_cancelled(&self) -> bool {
        self.state.lock().cancelled
    }

    /// The operation is about to wait on `ticket`; resolves it at once if the caller is
    /// already gone.
    pub(crate) fn watch(&self, ticket: &Arc<Ticket>) {
        let mut s = self.state.lock();
        if s.cancelled {
            drop(s);
            ticket.resolve(TicketState::Cancelled);
        } else {
            s.ticket = Some(Arc::clone(ticket));
        }
    }

    /// The operation finished with something to free if nobody takes its result: freed now
    /// if the caller is already gone, else kept until [`Self::delivered`] or
    /// [`Self::cancel`].
    pub(crate) fn finished(&self, undo: Undo) {
        let mut s = self.state.lock();
        s.ticket = None;
        if s.cancelled {
            drop(s);
            undo();
        } else {
            s.undo = Some(undo);
        }
    }

    /// The caller took the result.
    pub(crate) fn delivered(&self) {
        let mut s = self.state.lock();
        s.undo = None;
        s.ticket = None;
    }

    /// The caller went away: a waiting ticket is cancelled, an unseen booking freed.
    pub(crate) fn cancel(&self) {
        let (ticket, undo) = {
            let mut s = self.state.lock();
            s.cancelled = true;
            (s.ticket.take(), s.undo.take())
        };
        if let Some(ticket) = ticket {
            ticket.resolve(TicketState::Cancelled);
        }
        if let Some(undo) = undo {
            undo();
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

    /// Takes a ticket whose caller stopped waiting (timed out or went away) out of the
    /// queue, so `/loads` and the queue limits count only requests still waiting.
    pub(crate) fn remove(&self, ticket: &Arc<Ticket>) {
        self.queue.lock().remove_where(|t| Arc::ptr_eq(t, ticket));
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

/// Whether `key`, a rank of a worker with `taints`, may serve a waiting request (pin,
/// allow-list and required taints).
pub(crate) fn eligible(w: &Waiting<Arc<Ticket>>, key: WorkerKey, taints: &[String]) -> bool {
    eligible_for(w.pinned, &w.payload, key, taints)
}

/// Whether a request pinned to `pinned` (if any) with `ticket`'s allow-list and required
/// taints may go to `key`, whose worker has `taints`.
pub(crate) fn eligible_for(
    pinned: Option<WorkerKey>,
    ticket: &Ticket,
    key: WorkerKey,
    taints: &[String],
) -> bool {
    pinned.is_none_or(|p| p == key)
        && ticket
            .allowed
            .as_ref()
            .is_none_or(|a| a.contains(&key.worker_id.0))
        && ticket.required_taints.iter().all(|t| taints.contains(t))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn counter() -> (Arc<AtomicUsize>, Box<dyn FnOnce() + Send>) {
        let n = Arc::new(AtomicUsize::new(0));
        let m = Arc::clone(&n);
        (
            n,
            Box::new(move || {
                m.fetch_add(1, Ordering::SeqCst);
            }),
        )
    }

    #[test]
    fn a_cancelled_caller_frees_what_finished_unseen_whichever_comes_first() {
        // Finished, then the caller goes away: freed by the cancel.
        let c = Cancel::default();
        let (freed, undo) = counter();
        c.finished(undo);
        assert_eq!(freed.load(Ordering::SeqCst), 0);
        c.cancel();
        assert_eq!(freed.load(Ordering::SeqCst), 1);

        // Gone first, then finished: freed at once.
        let c = Cancel::default();
        let (freed, undo) = counter();
        c.cancel();
        c.finished(undo);
        assert_eq!(freed.load(Ordering::SeqCst), 1);

        // Delivered: never freed, even by a late cancel.
        let c = Cancel::default();
        let (freed, undo) = counter();
        c.finished(undo);
        c.delivered();
        c.cancel();
        assert_eq!(freed.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_cancelled_caller_stops_its_wait_but_not_an_admission() {
        let c = Cancel::default();
        let ticket = Ticket::new(None, Vec::new());
        c.watch(&ticket);
        c.cancel();
        assert_eq!(ticket.wait(Duration::from_secs(5)), WaitOutcome::Cancelled);

        // Watching after the caller left cancels at once.
        let late = Ticket::new(None, Vec::new());
        c.watch(&late);
        assert_eq!(late.wait(Duration::from_secs(5)), WaitOutcome::Cancelled);

        // An admission that came first stands (the booking is then undone instead).
        let c = Cancel::default();
        let admitted = Ticket::new(None, Vec::new());
        c.watch(&admitted);
        assert!(admitted.resolve(TicketState::Admitted));
        c.cancel();
        assert_eq!(admitted.wait(Duration::from_secs(5)), WaitOutcome::Admitted);
    }
}
