//! In-process bookings as guards (tower's load-handle pattern).

use std::sync::Arc;
use std::time::Instant;

use crate::ledger::{
    BookRequest, BookingSeq, Freed, Ledger, LedgerError, ReservationId, SlotPolicy,
};
use crate::sync::Mutex;

/// A ledger shared between the selector, the lifecycle routes and load handles.
pub type SharedLedger = Arc<Mutex<Ledger>>;

/// A live booking that frees itself when dropped, so no early return leaks load.
///
/// Drop takes the ledger lock once and frees only the exact booking it made (a later
/// booking that reused the id after expiry is left alone); it never panics.
#[derive(Debug)]
pub struct LoadHandle {
    ledger: SharedLedger,
    id: ReservationId,
    seq: BookingSeq,
    armed: bool,
}

impl LoadHandle {
    /// Books `id` and returns its guard.
    pub fn book(
        ledger: &SharedLedger,
        id: ReservationId,
        req: &BookRequest<'_>,
        slot: SlotPolicy,
        now: Instant,
    ) -> Result<Self, LedgerError> {
        let seq = ledger.lock().book(id.clone(), req, slot, now)?;
        Ok(Self {
            ledger: Arc::clone(ledger),
            id,
            seq,
            armed: true,
        })
    }

    /// The reservation id.
    pub fn id(&self) -> &ReservationId {
        &self.id
    }

    /// The booking's identity.
    pub fn seq(&self) -> BookingSeq {
        self.seq
    }

    /// See [`Ledger::prefill_complete`].
    pub fn prefill_complete(&self) -> Result<bool, LedgerError> {
        let mut ledger = self.ledger.lock();
        self.check(&ledger)?;
        ledger.prefill_complete(self.id.as_str())
    }

    /// See [`Ledger::output_block`].
    pub fn output_block(&self, decay_fraction: Option<f64>) -> Result<(), LedgerError> {
        let mut ledger = self.ledger.lock();
        self.check(&ledger)?;
        ledger.output_block(self.id.as_str(), decay_fraction)
    }

    /// Frees now and reports what was released (drop would do the same silently).
    pub fn release(mut self) -> Result<Freed, LedgerError> {
        self.armed = false;
        self.ledger.lock().free_booking(self.id.as_str(), self.seq)
    }

    /// Gives up the guard: the booking stays until freed by id or expired.
    pub fn into_id(mut self) -> (ReservationId, BookingSeq) {
        self.armed = false;
        (self.id.clone(), self.seq)
    }

    fn check(&self, ledger: &Ledger) -> Result<(), LedgerError> {
        match ledger.reservation(self.id.as_str()) {
            Some(info) if info.seq == self.seq => Ok(()),
            Some(_) => Err(LedgerError::StaleBooking {
                id: self.id.clone(),
            }),
            None => Err(LedgerError::NotFound {
                id: self.id.clone(),
            }),
        }
    }
}

impl Drop for LoadHandle {
    fn drop(&mut self) {
        if self.armed {
            // Already freed, expired or replaced: nothing left to release.
            let _ = self.ledger.lock().free_booking(self.id.as_str(), self.seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_types::{SequenceHash, WorkerKey};

    #[test]
    fn drop_releases_and_does_not_touch_a_reused_id() {
        let ledger: SharedLedger = Arc::default();
        let w = WorkerKey::new(1, 0);
        let t = [SequenceHash(1), SequenceHash(2)];
        let now = Instant::now();
        let req = BookRequest::new(w, &t, 32).with_prefill(32);
        {
            let h = LoadHandle::book(&ledger, "a".into(), &req, SlotPolicy::CreateMissing, now)
                .unwrap();
            assert_eq!(h.prefill_complete(), Ok(true));
            assert_eq!(ledger.lock().load(w).unwrap().active_requests, 1);
        }
        assert_eq!(ledger.lock().load(w).unwrap().active_requests, 0);

        let old =
            LoadHandle::book(&ledger, "b".into(), &req, SlotPolicy::CreateMissing, now).unwrap();
        ledger.lock().free("b").unwrap();
        ledger
            .lock()
            .book("b".into(), &req, SlotPolicy::CreateMissing, now)
            .unwrap();
        drop(old);
        assert!(ledger.lock().contains("b"));
        assert_eq!(ledger.lock().load(w).unwrap().active_prefill_tokens, 32);
    }
}
