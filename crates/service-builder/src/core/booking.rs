//! Claims, bookings, reservations (replay and explicit forms), their lifecycle calls and
//! expiry.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kv_types::{BlockHash, SequenceHash, WorkerKey};
use load_accounting::{BookRequest, LedgerError, ReservationId, SlotPolicy};

use super::SelectionCore;
use super::attempt::{Attempt, Stop, settled};
use super::partition::{Partition, SelectScratch};
use super::prompt::check_hash_only;
use super::sessions::SessionGuard;
use super::state::{ReservationRow, RowState};
use crate::admission::{Cancel, Wait};
use crate::error::SelectionError;
use crate::pending::PendingKey;
use crate::request::{ReservationRequest, ReservationResponse};
use crate::session::BindingUpdate;

/// How often the booking path re-runs the expiry scan (the periodic task runs regardless).
pub(super) const EXPIRY_RECHECK: Duration = Duration::from_secs(30);

/// How often a claim at the reservation limit may sweep expired bookings (see `claim`).
pub(super) const FULL_SWEEP_EVERY: Duration = Duration::from_secs(1);

/// One booking's inputs, as the ledger and the replica peers both need them.
pub(super) struct Booking<'a> {
    /// The id as the claim allocated it (the ledger books under a clone of it).
    pub(super) id: &'a ReservationId,
    pub(super) worker: WorkerKey,
    pub(super) tracking: &'a [SequenceHash],
    pub(super) isl: u64,
    /// Prefill tokens to charge (when tracked and > 0).
    pub(super) prefill: Option<u64>,
    pub(super) track: bool,
    pub(super) expected_output_tokens: Option<u32>,
    pub(super) lora_name: Option<&'a str>,
}

/// An id claimed in the reservation index; released on drop unless installed.
pub(super) struct Claim<'a> {
    pub(super) core: &'a SelectionCore,
    /// The id, as the index keys it and the ledger books it.
    pub(super) rid: ReservationId,
    pub(super) installed: AtomicBool,
}

impl Claim<'_> {
    pub(super) fn install(&self) {
        self.install_with_session(None);
    }

    pub(super) fn install_with_session(&self, session: Option<String>) {
        if let Some(row) = self.core.reservations.lock().get_mut(&self.rid) {
            row.state = RowState::Booked;
            row.session = session;
        }
        self.installed.store(true, Ordering::Relaxed);
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if !self.installed.load(Ordering::Relaxed) {
            let mut rows = self.core.reservations.lock();
            if matches!(
                rows.get(&self.rid),
                Some(ReservationRow {
                    state: RowState::Claimed,
                    ..
                })
            ) {
                rows.remove(&self.rid);
            }
        }
    }
}

pub(super) fn ledger_error(e: LedgerError) -> SelectionError {
    match e {
        LedgerError::DuplicateReservation { .. } => SelectionError::sequence(409, e.to_string()),
        LedgerError::NotFound { .. } => SelectionError::sequence(404, e.to_string()),
        LedgerError::UnknownRank { worker } => {
            SelectionError::sequence(404, format!("{worker} not found"))
        }
        LedgerError::InvalidDecayFraction { .. } | LedgerError::PrefillExceedsIsl { .. } => {
            SelectionError::bad_request(e.to_string())
        }
        other => SelectionError::internal(other.to_string()),
    }
}

impl SelectionCore {
    /// Records a booking's blocks in approximate mode; `chain`, when known, is their
    /// sequence chain (kept out of the index's write lock).
    pub(super) fn record_decision(
        &self,
        partition: &Partition,
        worker: WorkerKey,
        blocks: &[BlockHash],
        chain: Option<&[SequenceHash]>,
    ) {
        if blocks.is_empty() || !partition.records_decisions {
            return;
        }
        let now = Instant::now();
        partition.index.write(|index| match chain {
            Some(seqs) => index.record_decision_chained(worker, blocks, seqs, now),
            None => index.record_decision(worker, blocks, now),
        });
    }

    pub(super) fn claim(
        &self,
        id: &str,
        partition: &Arc<Partition>,
    ) -> Result<Claim<'_>, SelectionError> {
        // Bookings past their expiry still hold rows until the periodic sweep (up to 60 s
        // later); at the limit, they are reclaimed first, at most once a second, so the
        // limit counts live reservations.
        if let Some(max) = self.config.max_active_reservations
            && self.reservations.lock().len() >= max
        {
            let now = Instant::now();
            let due = {
                let mut next = self.next_full_sweep.lock();
                let due = now >= *next;
                if due {
                    *next = now + FULL_SWEEP_EVERY;
                }
                due
            };
            if due {
                self.expire(now);
            }
        }
        let mut rows = self.reservations.lock();
        let len = rows.len();
        let rid = ReservationId::from(id);
        // One probe: the entry is the conflict check and the insert.
        let std::collections::hash_map::Entry::Vacant(slot) = rows.entry(rid.clone()) else {
            return Err(SelectionError::conflict(format!(
                "selection {id} is already reserved or being reserved"
            )));
        };
        if let Some(max) = self.config.max_active_reservations
            && len >= max
        {
            self.metrics.reservations_rejected_full.inc();
            return Err(SelectionError::new(
                crate::ErrorKind::ResourceExhausted,
                429,
                format!("active reservation limit reached (current={len}, limit={max})"),
            ));
        }
        slot.insert(ReservationRow {
            partition: Arc::clone(partition),
            state: RowState::Claimed,
            session: None,
        });
        Ok(Claim {
            core: self,
            rid,
            installed: AtomicBool::new(false),
        })
    }

    /// Books `b` in the partition's ledger (running the throttled expiry scan first).
    pub(super) fn book_on(
        &self,
        partition: &Partition,
        b: &Booking<'_>,
        slot: SlotPolicy,
    ) -> Result<(), SelectionError> {
        let req = BookRequest {
            worker: b.worker,
            tracking_hashes: b.tracking,
            isl: b.isl,
            effective_prefill_tokens: b.prefill,
            track_prefill_tokens: b.track,
            expected_output_tokens: b.expected_output_tokens,
            lora_name: b.lora_name.map(Arc::from),
        };
        let now = Instant::now();
        let mut ledger = partition.ledger.lock();
        // The expiry scan visits every booking: run it on the booking path at most every
        // 30 s per partition (spec §6.7), not on every booking.
        let expired = match partition.next_expiry_check.try_lock() {
            Some(mut next) if now >= *next => {
                *next = now + EXPIRY_RECHECK;
                ledger.expire(now)
            }
            _ => Vec::new(),
        };
        let booked = ledger.book(b.id.clone(), &req, slot, now);
        drop(ledger);
        self.metrics
            .expired_reservations
            .inc_by(expired.len() as u64);
        booked.map_err(ledger_error)?;
        self.metrics.bookings.inc();
        Ok(())
    }

    /// Tells replica peers about a booking that landed (and the session binding it made).
    pub(super) fn publish_booking(
        &self,
        partition: &Partition,
        b: &Booking<'_>,
        binding: Option<BindingUpdate>,
    ) {
        let Some(mesh) = self.mesh() else { return };
        let kind =
            crate::replica::admission(b.tracking, b.track, b.prefill, b.expected_output_tokens);
        let lora = b.lora_name.map(str::to_owned);
        crate::replica::publish(
            Some(&mesh),
            crate::replica::sequence_event(partition, b.id.as_str(), b.worker, lora, kind),
        );
        if let Some(update) = binding
            && mesh.session_affinity()
        {
            crate::replica::publish(
                Some(&mesh),
                crate::replica::binding_event(&partition.key, &update),
            );
        }
    }

    /// `POST /reservations`.
    pub fn create_reservation(
        &self,
        req: ReservationRequest,
    ) -> Result<ReservationResponse, SelectionError> {
        self.reserve(req, Wait::Yes(None)).done()
    }

    /// [`create_reservation`](Self::create_reservation) unless it would have to wait behind
    /// a concurrent first booking of the cached selection's session (the replay form with
    /// session affinity on; the explicit form never waits). See
    /// [`try_select_and_reserve`](Self::try_select_and_reserve).
    pub fn try_create_reservation(
        &self,
        req: ReservationRequest,
    ) -> Attempt<ReservationResponse, ReservationRequest> {
        self.reserve(req, Wait::No)
    }

    /// [`create_reservation`](Self::create_reservation) for a caller that may go away.
    pub(crate) fn create_reservation_cancellable(
        &self,
        req: ReservationRequest,
        cancel: &Cancel,
    ) -> Result<ReservationResponse, SelectionError> {
        self.reserve(req, Wait::Yes(Some(cancel))).done()
    }

    pub(super) fn reserve(
        &self,
        req: ReservationRequest,
        wait: Wait<'_>,
    ) -> Attempt<ReservationResponse, ReservationRequest> {
        let Some(result) = settled(self.create_reservation_inner(&req, wait)) else {
            return Attempt::WouldWait(req);
        };
        if let Err(e) = &result {
            self.metrics
                .reject(crate::metrics::RejectedOperation::Reservation, e);
        }
        Attempt::Done(result)
    }

    pub(super) fn create_reservation_inner(
        &self,
        req: &ReservationRequest,
        wait: Wait<'_>,
    ) -> Result<ReservationResponse, Stop> {
        self.check_running()?;
        let key: PendingKey = (
            req.partition.model_name.clone(),
            req.partition.routing_group.clone(),
            req.selection_id.clone(),
        );
        if req.worker_id.is_none() {
            return self.replay_reservation(req, &key, wait);
        }
        if self.pending.lock().discard(&key, Instant::now()) {
            self.metrics.pending_expired.inc();
        }
        let partition = self.ready_partition(&req.partition)?;
        let mut scratch = SelectScratch::default();
        let isl = self.normalize_prompt(
            &partition,
            &req.prompt,
            &req.router_config_override,
            false,
            &mut scratch,
        )?;
        if let Some(e) = req.effective_prefill_tokens.filter(|&e| e > isl) {
            return Err(Stop::Failed(SelectionError::bad_request(format!(
                "effective_prefill_tokens ({e}) must not exceed isl_tokens ({isl})"
            ))));
        }
        let worker_id = req.worker_id.unwrap_or_default();
        let workers = Arc::clone(&partition.workers.read());
        let Some(entry) = workers.get(&worker_id) else {
            return Err(Stop::Failed(SelectionError::not_found(format!(
                "schedulable worker {worker_id} not found for {}",
                req.partition
            ))));
        };
        if partition.records_decisions
            && req.prompt.routing_tokens().is_none()
            && let (Some(blocks), Some(seqs)) =
                (&req.prompt.block_hashes, &req.prompt.sequence_hashes)
        {
            check_hash_only(blocks, seqs, isl)?;
        }
        let worker = WorkerKey::new(worker_id, req.dp_rank.unwrap_or(0));
        let track = req.track_prefill_tokens.unwrap_or_else(|| {
            req.effective_prefill_tokens.is_some()
                || self
                    .config
                    .router
                    .track_prefill_tokens(&req.router_config_override)
        });
        let claim = self.claim(&req.selection_id, &partition)?;
        let booking = Booking {
            id: &claim.rid,
            worker,
            tracking: &scratch.tracking,
            isl,
            prefill: req.effective_prefill_tokens,
            track,
            expected_output_tokens: req.expected_output_tokens,
            lora_name: req.prompt.lora_name.as_deref(),
        };
        self.book_on(&partition, &booking, SlotPolicy::RequireRegistered)?;
        self.record_decision(&partition, worker, &scratch.blocks, scratch.chain());
        claim.install();
        self.publish_booking(&partition, &booking, None);
        Ok(ReservationResponse {
            selection_id: req.selection_id.clone(),
            model_name: partition.key.model_name.clone(),
            routing_group: partition.key.routing_group.clone(),
            worker_id,
            dp_rank: worker.dp_rank.0,
            endpoint: entry.record.endpoint.clone().unwrap_or_default(),
        })
    }

    pub(super) fn replay_reservation(
        &self,
        req: &ReservationRequest,
        key: &PendingKey,
        wait: Wait<'_>,
    ) -> Result<ReservationResponse, Stop> {
        let found = self.pending.lock().get(key, Instant::now());
        let Some((cached, generation)) = found else {
            return Err(Stop::Failed(SelectionError::not_found(format!(
                "no pending selection {} for {} (expired, already used, or never selected)",
                req.selection_id, req.partition
            ))));
        };
        let partition = self.ready_partition(&req.partition)?;
        let workers = Arc::clone(&partition.workers.read());
        let worker = cached.worker;
        let entry = workers
            .get(&worker.worker_id.0)
            .filter(|w| w.record.has_rank(worker.dp_rank.0))
            .ok_or_else(|| {
                SelectionError::not_found(format!(
                    "schedulable worker {} (dp_rank {}) not found for {}",
                    worker.worker_id, worker.dp_rank, req.partition
                ))
            })?;
        let claim = self.claim(&req.selection_id, &partition)?;
        let mut session = match (partition.sessions.as_ref(), cached.session_id.as_deref()) {
            (Some(table), Some(sid)) => {
                match self.hold_session(&partition, table, sid, Instant::now(), wait) {
                    Some(held) => held,
                    // The claim's row goes with the claim; the cached selection stays.
                    None => return Err(Stop::WouldWait),
                }
            }
            _ => SessionGuard::none(),
        };
        let booking = Booking {
            id: &claim.rid,
            worker,
            tracking: &cached.tracking_hashes,
            isl: cached.isl,
            prefill: Some(cached.effective_prefill_tokens),
            track: cached.track_prefill,
            expected_output_tokens: cached.expected_output_tokens,
            lora_name: cached.lora_name.as_deref(),
        };
        self.book_on(&partition, &booking, SlotPolicy::RequireRegistered)?;
        let binding = match session.commit(worker, &partition) {
            Ok(b) => b,
            Err(e) => {
                // A session bound elsewhere consumes the cached selection (§7, §16.2).
                let _ = partition.ledger.lock().free(&req.selection_id);
                self.pending.lock().consume(key, generation);
                return Err(e.into());
            }
        };
        partition.routing.record(cached.routing);
        self.record_decision(&partition, worker, &cached.block_hashes, None);
        claim.install_with_session(session.into_lease());
        self.publish_booking(&partition, &booking, binding);
        self.pending.lock().consume(key, generation);
        Ok(ReservationResponse {
            selection_id: req.selection_id.clone(),
            model_name: partition.key.model_name.clone(),
            routing_group: partition.key.routing_group.clone(),
            worker_id: worker.worker_id.0,
            dp_rank: worker.dp_rank.0,
            endpoint: entry.record.endpoint.clone().unwrap_or_default(),
        })
    }

    pub(super) fn booked_partition(&self, id: &str) -> Result<Arc<Partition>, SelectionError> {
        let rows = self.reservations.lock();
        match rows.get(id) {
            Some(ReservationRow {
                partition,
                state: RowState::Booked,
                ..
            }) => Ok(Arc::clone(partition)),
            _ => Err(SelectionError::not_found(format!(
                "reservation {id} not found"
            ))),
        }
    }

    pub(super) fn forget_row(&self, id: &str) {
        let mut rows = self.reservations.lock();
        // One probe in the usual case (a booked row); a claimed row goes back.
        let Some((key, row)) = rows.remove_entry(id) else {
            return;
        };
        if matches!(row.state, RowState::Booked) {
            drop(rows);
            self.release_row_session(&row, Instant::now());
        } else {
            rows.insert(key, row);
        }
    }

    /// Maps a ledger miss to 404 and forgets the stale row.
    pub(super) fn lifecycle_result<T>(
        &self,
        id: &str,
        r: Result<T, LedgerError>,
    ) -> Result<T, SelectionError> {
        r.map_err(|e| {
            if matches!(e, LedgerError::NotFound { .. }) {
                self.forget_row(id);
                SelectionError::not_found(format!("reservation {id} not found"))
            } else {
                ledger_error(e)
            }
        })
    }

    /// `POST /reservations/{id}/prefill_complete`.
    pub fn prefill_complete(&self, id: &str) -> Result<(), SelectionError> {
        let partition = self.booked_partition(id)?;
        self.check_running()?;
        let r = {
            let mut ledger = partition.ledger.lock();
            let worker = ledger.reservation(id).map(|i| i.worker);
            ledger.prefill_complete(id).map(|_| worker)
        };
        let worker = self.lifecycle_result(id, r)?;
        self.recheck_queue(&partition);
        // Re-published on repeats too, so peers that missed it converge.
        if let Some(worker) = worker {
            self.publish_replica_with(|| {
                crate::replica::sequence_event(
                    &partition,
                    id,
                    worker,
                    None,
                    replica_sync::SequenceEventKind::MarkPrefillCompleted,
                )
            });
        }
        Ok(())
    }

    /// `POST /reservations/{id}/output_block`.
    pub fn add_output_block(
        &self,
        id: &str,
        decay_fraction: Option<f64>,
    ) -> Result<(), SelectionError> {
        if let Some(f) = decay_fraction
            && !(0.0..=1.0).contains(&f)
        {
            return Err(SelectionError::bad_request(
                "decay_fraction must be between 0.0 and 1.0",
            ));
        }
        let partition = self.booked_partition(id)?;
        let r = partition.ledger.lock().output_block(id, decay_fraction);
        self.lifecycle_result(id, r)
    }

    /// `DELETE /reservations/{id}`.
    pub fn free_reservation(&self, id: &str) -> Result<(), SelectionError> {
        let partition = self.booked_partition(id)?;
        let r = partition.ledger.lock().free(id);
        let out = self.lifecycle_result(id, r);
        self.forget_row(id);
        let freed = out?;
        self.metrics.frees.inc();
        self.recheck_queue(&partition);
        self.publish_replica_with(|| {
            crate::replica::sequence_event(
                &partition,
                id,
                freed.worker,
                None,
                replica_sync::SequenceEventKind::Free,
            )
        });
        Ok(())
    }

    /// Reclaims bookings older than the expiry and drops reservation rows whose booking is
    /// gone. Returns how many bookings expired.
    pub fn expire(&self, now: Instant) -> usize {
        let partitions: Vec<Arc<Partition>> =
            self.state.read().partitions.values().cloned().collect();
        let mut expired = 0;
        for p in &partitions {
            expired += p.ledger.lock().expire(now).len();
            if let Some(t) = &p.sessions {
                t.reap(now);
            }
            p.index.write(|index| index.expire(now, usize::MAX));
            self.recheck_queue(p);
        }
        let swept = self.pending.lock().sweep(now);
        self.metrics.pending_expired.inc_by(swept as u64);
        let mut rows = self.reservations.lock();
        rows.retain(|id, row| match row.state {
            RowState::Claimed => true,
            RowState::Booked => {
                let live = row.partition.ledger.lock().contains(id.as_str());
                if !live {
                    self.release_row_session(row, now);
                }
                live
            }
        });
        drop(rows);
        self.metrics.expired_reservations.inc_by(expired as u64);
        expired
    }
}
