//! The ledger: bookings by reservation id and the per-rank totals they charge.

use std::borrow::Borrow;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use kv_types::{SequenceHash, WorkerId, WorkerKey};

use crate::rank::{ROOT, RankState};
use crate::slots::{LoadRow, RankSlot, RankTable, SlotLayout};

/// Default age after which a booking is reclaimed (`DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS`).
pub const DEFAULT_EXPIRY: Duration = Duration::from_secs(300);

/// A reservation id (the service's `selection_id`), unique service-wide while live.
///
/// Cheap to clone (`Arc<str>`); borrows as `str` so maps keyed by it can be queried with a
/// plain `&str`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReservationId(Arc<str>);

impl ReservationId {
    /// Wraps an id.
    pub fn new(id: impl Into<Arc<str>>) -> Self {
        Self(id.into())
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for ReservationId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl From<&str> for ReservationId {
    fn from(s: &str) -> Self {
        Self(s.into())
    }
}

impl From<String> for ReservationId {
    fn from(s: String) -> Self {
        Self(s.into())
    }
}

impl fmt::Display for ReservationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ReservationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// Everything that failed in a ledger operation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum LedgerError {
    /// The id is already booked (409 at the API).
    #[error("Request {id} already exists")]
    DuplicateReservation { id: ReservationId },
    /// No live booking has this id (404 at the API).
    #[error("reservation {id} not found")]
    NotFound { id: ReservationId },
    /// The target rank is not registered and the caller required it to be.
    #[error("{worker} is not registered")]
    UnknownRank { worker: WorkerKey },
    /// `decay_fraction` outside `[0, 1]` or NaN (400 at the API).
    #[error("decay_fraction must be between 0.0 and 1.0")]
    InvalidDecayFraction { value: f64 },
    /// A caller-supplied prefill hint larger than the prompt (400 at the API).
    #[error(
        "effective_prefill_tokens ({effective_prefill_tokens}) must not exceed isl_tokens ({isl})"
    )]
    PrefillExceedsIsl {
        effective_prefill_tokens: u64,
        isl: u64,
    },
    /// A replicated event named the id on a different rank than the one it is booked on.
    #[error("reservation {id} is booked on {booked}, not {requested}")]
    WorkerMismatch {
        id: ReservationId,
        booked: WorkerKey,
        requested: WorkerKey,
    },
    /// The booking behind the id is not the one the caller holds (it was freed and the id
    /// reused).
    #[error("reservation {id} was replaced by a newer booking")]
    StaleBooking { id: ReservationId },
}

/// Whether a booking was made here or applied from a replica peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Local,
    Remote,
}

/// What `book` does when the target rank is not registered (`scheduling.md` §6.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotPolicy {
    /// The admission path: the selector just chose this rank, create its slot lazily.
    CreateMissing,
    /// Explicit/replayed reservations and replica bookings: fail with `UnknownRank`.
    RequireRegistered,
}

/// Inputs of one booking.
#[derive(Debug, Clone)]
pub struct BookRequest<'a> {
    pub worker: WorkerKey,
    /// Tracking hashes of the prompt's complete blocks (`hashing.md` §5).
    pub tracking_hashes: &'a [SequenceHash],
    /// Normalized input sequence length in tokens.
    pub isl: u64,
    /// Prefill hint: charged only if `track_prefill_tokens` and present and > 0.
    pub effective_prefill_tokens: Option<u64>,
    pub track_prefill_tokens: bool,
    /// Stored, not used in accounting.
    pub expected_output_tokens: Option<u32>,
    pub lora_name: Option<Arc<str>>,
}

impl<'a> BookRequest<'a> {
    /// A booking on `worker` with no prefill hint and tracking on.
    pub fn new(worker: WorkerKey, tracking_hashes: &'a [SequenceHash], isl: u64) -> Self {
        Self {
            worker,
            tracking_hashes,
            isl,
            effective_prefill_tokens: None,
            track_prefill_tokens: true,
            expected_output_tokens: None,
            lora_name: None,
        }
    }

    /// Sets the prefill hint.
    pub fn with_prefill(mut self, effective_prefill_tokens: u64) -> Self {
        self.effective_prefill_tokens = Some(effective_prefill_tokens);
        self
    }
}

/// Identity of one booking: distinguishes a booking from a later one that reuses its id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BookingSeq(pub u64);

/// Current load of one rank (a `/loads` row).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankLoad {
    pub active_prefill_tokens: u64,
    /// `round(prompt_weight + output_weight)`.
    pub active_decode_blocks: u64,
    pub active_requests: u64,
}

/// Projection of a prospective request onto one rank (`scheduling.md` §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PotentialLoad {
    pub active_prefill_tokens: u64,
    /// `active_prefill_tokens` + the request's added prefill tokens.
    pub potential_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    /// `len(T) − overlap_depth`.
    pub additional_active_blocks: u64,
    /// `active_decode_blocks + additional_active_blocks`.
    pub potential_decode_blocks: u64,
    pub active_requests: u64,
}

/// Read-only description of a live booking.
#[derive(Debug, Clone)]
pub struct ReservationInfo {
    pub worker: WorkerKey,
    pub seq: BookingSeq,
    pub origin: Origin,
    pub admitted_at: Instant,
    /// Prefill tokens still charged (0 once prefill completed or when nothing was charged).
    pub pending_prefill_tokens: u64,
    pub prefill_completed: bool,
    pub track_prefill_tokens: bool,
    pub isl: u64,
    pub tracking_blocks: usize,
    pub output_blocks: u32,
    pub expected_output_tokens: Option<u32>,
    pub lora_name: Option<Arc<str>>,
}

/// What a free released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Freed {
    pub id: ReservationId,
    pub worker: WorkerKey,
    pub seq: BookingSeq,
    pub origin: Origin,
}

/// Ledger settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LedgerConfig {
    /// Bookings older than this (from admission) are reclaimed by [`Ledger::expire`].
    pub expiry: Duration,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        Self {
            expiry: DEFAULT_EXPIRY,
        }
    }
}

#[derive(Debug)]
struct Booking {
    worker: WorkerKey,
    seq: BookingSeq,
    origin: Origin,
    admitted_at: Instant,
    last_node: u32,
    path_len: u32,
    prefill_tokens: u64,
    prefill_completed: bool,
    track_prefill_tokens: bool,
    isl: u64,
    /// Output blocks still at weight 1.0.
    out_full: u32,
    /// Output blocks at weight `out_frac` (all of them after a decay).
    out_decayed: u32,
    out_frac: f64,
    expected_output_tokens: Option<u32>,
    lora_name: Option<Arc<str>>,
}

/// Active-load accounting of one partition (`scheduling.md` §6).
///
/// Not synchronized: wrap it in a lock (see [`crate::SharedLedger`]) to share it.
#[derive(Debug, Default)]
pub struct Ledger {
    config: LedgerConfig,
    ranks: RankTable,
    /// Keyed by ids that clients (and peer replicas) choose: SipHash with a per-process
    /// key, so ids cannot be picked to collide. Under an unkeyed hash a client could book
    /// ids that share a probe sequence and make every lookup under the partition's ledger
    /// lock scan all of them.
    bookings: HashMap<ReservationId, Booking>,
    next_seq: u64,
}

impl Ledger {
    /// An empty ledger.
    pub fn new(config: LedgerConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    /// The settings.
    pub fn config(&self) -> LedgerConfig {
        self.config
    }

    /// Registers a rank with zero load (no-op if present).
    pub fn register_rank(&mut self, worker: WorkerKey) {
        self.ranks.get_or_insert(worker);
    }

    /// Whether the rank has a slot.
    pub fn is_registered(&self, worker: WorkerKey) -> bool {
        self.ranks.contains(worker)
    }

    /// Drops a rank and every booking on it; returns the dropped ids.
    pub fn remove_rank(&mut self, worker: WorkerKey) -> Vec<ReservationId> {
        self.remove_ranks_where(|k| k == worker)
    }

    /// Drops every rank of a worker and their bookings; returns the dropped ids.
    pub fn remove_worker(&mut self, worker_id: WorkerId) -> Vec<ReservationId> {
        self.remove_ranks_where(|k| k.worker_id == worker_id)
    }

    fn remove_ranks_where(&mut self, pred: impl Fn(WorkerKey) -> bool) -> Vec<ReservationId> {
        self.ranks.retain(|k| !pred(k));
        let mut removed = Vec::new();
        self.bookings.retain(|id, b| {
            let drop = pred(b.worker);
            if drop {
                removed.push(id.clone());
            }
            !drop
        });
        removed
    }

    /// Books `id` on `req.worker` at `now`.
    pub fn book(
        &mut self,
        id: ReservationId,
        req: &BookRequest<'_>,
        slot: SlotPolicy,
        now: Instant,
    ) -> Result<BookingSeq, LedgerError> {
        self.book_with_origin(id, req, slot, Origin::Local, now)
    }

    /// Applies a peer's `AddRequest`: the rank must be registered; `now` is the local receive
    /// time (mirrored bookings expire like local ones).
    pub fn book_remote(
        &mut self,
        id: ReservationId,
        req: &BookRequest<'_>,
        now: Instant,
    ) -> Result<BookingSeq, LedgerError> {
        self.book_with_origin(id, req, SlotPolicy::RequireRegistered, Origin::Remote, now)
    }

    fn book_with_origin(
        &mut self,
        id: ReservationId,
        req: &BookRequest<'_>,
        slot: SlotPolicy,
        origin: Origin,
        now: Instant,
    ) -> Result<BookingSeq, LedgerError> {
        // One hash of the id for the check and the insert.
        let vacant = match self.bookings.entry(id) {
            Entry::Occupied(e) => {
                return Err(LedgerError::DuplicateReservation {
                    id: e.key().clone(),
                });
            }
            Entry::Vacant(v) => v,
        };
        if let Some(p) = req.effective_prefill_tokens
            && p > req.isl
        {
            return Err(LedgerError::PrefillExceedsIsl {
                effective_prefill_tokens: p,
                isl: req.isl,
            });
        }
        let mut rank = match slot {
            SlotPolicy::CreateMissing => self.ranks.get_or_insert(req.worker),
            SlotPolicy::RequireRegistered => match self.ranks.get_mut(req.worker) {
                Some(r) => r,
                None => return Err(LedgerError::UnknownRank { worker: req.worker }),
            },
        };
        let prefill_tokens = match req.effective_prefill_tokens {
            Some(p) if req.track_prefill_tokens && p > 0 => p,
            _ => 0,
        };
        let last_node = rank.insert_path(req.tracking_hashes);
        rank.prefill_tokens += prefill_tokens;
        rank.requests += 1;
        let seq = BookingSeq(self.next_seq);
        self.next_seq += 1;
        vacant.insert(Booking {
            worker: req.worker,
            seq,
            origin,
            admitted_at: now,
            last_node,
            path_len: req.tracking_hashes.len() as u32,
            prefill_tokens,
            prefill_completed: false,
            track_prefill_tokens: req.track_prefill_tokens,
            isl: req.isl,
            out_full: 0,
            out_decayed: 0,
            out_frac: 1.0,
            expected_output_tokens: req.expected_output_tokens,
            lora_name: req.lora_name.clone(),
        });
        Ok(seq)
    }

    /// Removes the booking's prefill load. `Ok(true)` the first time, `Ok(false)` when it
    /// was already complete (the caller re-publishes either way).
    pub fn prefill_complete(&mut self, id: &str) -> Result<bool, LedgerError> {
        let b = self.bookings.get_mut(id).ok_or_else(|| not_found(id))?;
        Ok(complete_prefill(&mut self.ranks, b))
    }

    /// Applies a peer's `MarkPrefillCompleted`: the id must be live on the same rank.
    pub fn prefill_complete_remote(
        &mut self,
        id: &str,
        worker: WorkerKey,
    ) -> Result<bool, LedgerError> {
        let b = self.bookings.get_mut(id).ok_or_else(|| not_found(id))?;
        if b.worker != worker {
            return Err(mismatch(id, b.worker, worker));
        }
        Ok(complete_prefill(&mut self.ranks, b))
    }

    /// Appends one output block of weight 1.0; with `decay_fraction = f`, then sets the
    /// weight of all the booking's output blocks and of the prompt blocks only it holds to
    /// `f` (replacement, not multiplication).
    pub fn output_block(
        &mut self,
        id: &str,
        decay_fraction: Option<f64>,
    ) -> Result<(), LedgerError> {
        if let Some(f) = decay_fraction
            && !(0.0..=1.0).contains(&f)
        {
            return Err(LedgerError::InvalidDecayFraction { value: f });
        }
        let b = self.bookings.get_mut(id).ok_or_else(|| not_found(id))?;
        let Some(mut rank) = self.ranks.get_mut(b.worker) else {
            // Bookings never outlive their rank (remove_rank drops them).
            return Err(not_found(id));
        };
        rank.add_weight(1.0, 1);
        b.out_full += 1;
        if let Some(f) = decay_fraction {
            rank.remove_weight(1.0, u64::from(b.out_full));
            rank.remove_weight(b.out_frac, u64::from(b.out_decayed));
            b.out_decayed += b.out_full;
            b.out_full = 0;
            b.out_frac = f;
            rank.add_weight(f, u64::from(b.out_decayed));
            rank.decay_exclusive_suffix(b.last_node, f);
        }
        Ok(())
    }

    /// Frees a booking: implicit prefill completion, then releases its blocks.
    pub fn free(&mut self, id: &str) -> Result<Freed, LedgerError> {
        let (id, b) = self
            .bookings
            .remove_entry(id)
            .ok_or_else(|| not_found(id))?;
        Ok(self.release(id, b))
    }

    /// Frees `id` only if it is still exactly the booking `seq` (a holder of an old booking
    /// must not free a newer one that reused the id).
    pub fn free_booking(&mut self, id: &str, seq: BookingSeq) -> Result<Freed, LedgerError> {
        match self.bookings.get(id) {
            None => Err(not_found(id)),
            Some(b) if b.seq != seq => Err(LedgerError::StaleBooking { id: id.into() }),
            Some(_) => self.free(id),
        }
    }

    /// Applies a peer's `Free`: the id must be live on the same rank.
    pub fn free_remote(&mut self, id: &str, worker: WorkerKey) -> Result<Freed, LedgerError> {
        match self.bookings.get(id) {
            None => Err(not_found(id)),
            Some(b) if b.worker != worker => Err(mismatch(id, b.worker, worker)),
            Some(_) => self.free(id),
        }
    }

    fn release(&mut self, id: ReservationId, mut b: Booking) -> Freed {
        complete_prefill(&mut self.ranks, &mut b);
        if let Some(mut rank) = self.ranks.get_mut(b.worker) {
            if b.last_node != ROOT {
                rank.release_path(b.last_node);
            }
            rank.remove_weight(1.0, u64::from(b.out_full));
            rank.remove_weight(b.out_frac, u64::from(b.out_decayed));
            rank.requests -= 1;
        }
        Freed {
            id,
            worker: b.worker,
            seq: b.seq,
            origin: b.origin,
        }
    }

    /// Frees every booking admitted more than the configured expiry before `now` (progress
    /// does not refresh the age). Local cleanup: returns the ids so the caller can drop its
    /// rows, but nothing should be published to peers.
    pub fn expire(&mut self, now: Instant) -> Vec<ReservationId> {
        let expiry = self.config.expiry;
        let ids: Vec<ReservationId> = self
            .bookings
            .iter()
            .filter(|(_, b)| now.saturating_duration_since(b.admitted_at) > expiry)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &ids {
            if let Some((id, b)) = self.bookings.remove_entry(id.as_str()) {
                self.release(id, b);
            }
        }
        ids
    }

    /// Whether `id` is live.
    pub fn contains(&self, id: &str) -> bool {
        self.bookings.contains_key(id)
    }

    /// Number of live bookings.
    pub fn len(&self) -> usize {
        self.bookings.len()
    }

    /// Whether no booking is live.
    pub fn is_empty(&self) -> bool {
        self.bookings.is_empty()
    }

    /// Description of a live booking.
    pub fn reservation(&self, id: &str) -> Option<ReservationInfo> {
        self.bookings.get(id).map(|b| ReservationInfo {
            worker: b.worker,
            seq: b.seq,
            origin: b.origin,
            admitted_at: b.admitted_at,
            pending_prefill_tokens: b.prefill_tokens,
            prefill_completed: b.prefill_completed,
            track_prefill_tokens: b.track_prefill_tokens,
            isl: b.isl,
            tracking_blocks: b.path_len as usize,
            output_blocks: b.out_full + b.out_decayed,
            expected_output_tokens: b.expected_output_tokens,
            lora_name: b.lora_name.clone(),
        })
    }

    /// Current load of a registered rank.
    pub fn load(&self, worker: WorkerKey) -> Option<RankLoad> {
        self.ranks.get(worker).map(rank_load)
    }

    /// Current load of every registered rank (unordered).
    pub fn loads(&self) -> impl Iterator<Item = (WorkerKey, RankLoad)> + '_ {
        self.ranks.load_rows().map(|(k, r)| (k, r.load()))
    }

    /// Registered ranks (unordered).
    pub fn ranks(&self) -> impl Iterator<Item = WorkerKey> + '_ {
        self.ranks.iter().map(|(k, _)| k)
    }

    /// Longest prefix of `tracking_hashes` active on the rank (0 for unknown ranks).
    pub fn overlap_depth(&self, worker: WorkerKey, tracking_hashes: &[SequenceHash]) -> usize {
        self.ranks
            .get(worker)
            .map_or(0, |r| r.overlap_depth(tracking_hashes))
    }

    /// The slot of a registered rank, to pass to [`Ledger::potential_load_at`] later (or to
    /// [`Ledger::potential_load_bound`] while [`Ledger::slot_layout`] is unchanged).
    pub fn rank_slot(&self, worker: WorkerKey) -> Option<RankSlot> {
        self.ranks.slot(worker)
    }

    /// The current assignment of ranks to slots. Equal to a value read earlier exactly when
    /// no rank gained or lost a slot in between (values are never reused, even by another
    /// ledger), so every slot [`Ledger::rank_slot`] gave meanwhile still holds its rank.
    pub fn slot_layout(&self) -> SlotLayout {
        self.ranks.layout()
    }

    /// Projects a prospective request onto a rank. `added_prefill_tokens` is what the
    /// request would charge there (`isl − min(isl, cached)` when prefill is tracked, else 0).
    /// An unknown rank projects zero load with every tracking block additional.
    pub fn potential_load(
        &self,
        worker: WorkerKey,
        tracking_hashes: &[SequenceHash],
        added_prefill_tokens: u64,
    ) -> PotentialLoad {
        self.potential_load_at(None, worker, tracking_hashes, added_prefill_tokens)
    }

    /// [`Ledger::potential_load`] reading the rank at `slot` (from [`Ledger::rank_slot`])
    /// without a key lookup; a stale or missing slot falls back to the lookup, so the answer
    /// is always the one `potential_load` gives.
    #[inline]
    pub fn potential_load_at(
        &self,
        slot: Option<RankSlot>,
        worker: WorkerKey,
        tracking_hashes: &[SequenceHash],
        added_prefill_tokens: u64,
    ) -> PotentialLoad {
        self.project(
            self.ranks.load_at(slot, worker),
            tracking_hashes,
            added_prefill_tokens,
        )
    }

    /// [`Ledger::potential_load_at`] through a slot that [`Ledger::rank_slot`] gave for
    /// `worker` while [`Ledger::slot_layout`] returned what it returns now. The slot still
    /// holds `worker`, so its key is not checked: a caller that binds many ranks' slots at
    /// once checks the layout once instead of a key per rank. Passing a slot read under
    /// another layout is a caller bug; debug builds assert on it.
    #[inline]
    pub fn potential_load_bound(
        &self,
        slot: RankSlot,
        worker: WorkerKey,
        tracking_hashes: &[SequenceHash],
        added_prefill_tokens: u64,
    ) -> PotentialLoad {
        let row = self.ranks.load_bound(slot);
        debug_assert!(
            row.is_some_and(|(r, _)| r.holds(worker)),
            "slot {slot:?} does not hold {worker:?}: read under another layout"
        );
        self.project(row, tracking_hashes, added_prefill_tokens)
    }

    #[inline(always)]
    fn project(
        &self,
        row: Option<(&LoadRow, u32)>,
        tracking_hashes: &[SequenceHash],
        added_prefill_tokens: u64,
    ) -> PotentialLoad {
        // The load column answers idle ranks alone; only a rank with live paths is walked.
        let (load, depth) = match row {
            Some((row, s)) => {
                let depth = if row.busy {
                    self.overlap_depth_at(s, tracking_hashes)
                } else {
                    0
                };
                (row.load(), depth)
            }
            None => (RankLoad::default(), 0),
        };
        let additional = (tracking_hashes.len() - depth) as u64;
        PotentialLoad {
            active_prefill_tokens: load.active_prefill_tokens,
            potential_prefill_tokens: load.active_prefill_tokens + added_prefill_tokens,
            active_decode_blocks: load.active_decode_blocks,
            additional_active_blocks: additional,
            potential_decode_blocks: load.active_decode_blocks + additional,
            active_requests: load.active_requests,
        }
    }
}

impl Ledger {
    /// Out of line: the per-candidate projection inlines into the caller's loop, and most
    /// candidates are idle.
    #[inline(never)]
    fn overlap_depth_at(&self, slot: u32, tracking_hashes: &[SequenceHash]) -> usize {
        self.ranks
            .state_at(slot)
            .map_or(0, |r| r.overlap_depth(tracking_hashes))
    }
}

fn rank_load(r: &RankState) -> RankLoad {
    RankLoad {
        active_prefill_tokens: r.prefill_tokens,
        active_decode_blocks: r.decode_blocks(),
        active_requests: r.requests,
    }
}

fn complete_prefill(ranks: &mut RankTable, b: &mut Booking) -> bool {
    if b.prefill_completed {
        return false;
    }
    b.prefill_completed = true;
    if let Some(mut rank) = ranks.get_mut(b.worker) {
        rank.prefill_tokens -= b.prefill_tokens;
    }
    b.prefill_tokens = 0;
    true
}

fn not_found(id: &str) -> LedgerError {
    LedgerError::NotFound { id: id.into() }
}

fn mismatch(id: &str, booked: WorkerKey, requested: WorkerKey) -> LedgerError {
    LedgerError::WorkerMismatch {
        id: id.into(),
        booked,
        requested,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: WorkerKey = WorkerKey::new(1, 0);

    fn hashes(v: &[u64]) -> Vec<SequenceHash> {
        v.iter().copied().map(SequenceHash).collect()
    }

    fn book(l: &mut Ledger, id: &str, t: &[SequenceHash], prefill: Option<u64>, now: Instant) {
        let mut req = BookRequest::new(W, t, 1_000);
        req.effective_prefill_tokens = prefill;
        l.book(id.into(), &req, SlotPolicy::CreateMissing, now)
            .unwrap();
    }

    fn check(l: &Ledger, prefill: u64, blocks: u64, requests: u64) {
        assert_eq!(
            l.load(W).unwrap(),
            RankLoad {
                active_prefill_tokens: prefill,
                active_decode_blocks: blocks,
                active_requests: requests,
            }
        );
    }

    #[test]
    fn booking_charges_prefill_blocks_and_a_request() {
        let mut l = Ledger::default();
        let now = Instant::now();
        book(&mut l, "a", &hashes(&[1, 2, 3]), Some(48), now);
        check(&l, 48, 3, 1);
        book(&mut l, "b", &hashes(&[1, 2, 9]), Some(16), now);
        check(&l, 64, 4, 2);
        assert_eq!(l.prefill_complete("a"), Ok(true));
        assert_eq!(l.prefill_complete("a"), Ok(false));
        check(&l, 16, 4, 2);
        l.free("b").unwrap();
        check(&l, 0, 3, 1);
        l.free("a").unwrap();
        check(&l, 0, 0, 0);
    }

    #[test]
    fn prefill_is_charged_only_with_tracking_and_a_positive_hint() {
        let now = Instant::now();
        let t = hashes(&[1]);
        for (track, hint, charged) in [
            (true, Some(10), 10),
            (true, Some(0), 0),
            (true, None, 0),
            (false, Some(10), 0),
        ] {
            let mut l = Ledger::default();
            let mut req = BookRequest::new(W, &t, 100);
            req.track_prefill_tokens = track;
            req.effective_prefill_tokens = hint;
            l.book("x".into(), &req, SlotPolicy::CreateMissing, now)
                .unwrap();
            assert_eq!(l.load(W).unwrap().active_prefill_tokens, charged);
        }
    }

    #[test]
    fn typed_errors() {
        let mut l = Ledger::default();
        let now = Instant::now();
        let t = hashes(&[1]);
        book(&mut l, "a", &t, None, now);
        let req = BookRequest::new(W, &t, 10);
        assert!(matches!(
            l.book("a".into(), &req, SlotPolicy::CreateMissing, now),
            Err(LedgerError::DuplicateReservation { .. })
        ));
        assert!(matches!(l.free("zz"), Err(LedgerError::NotFound { .. })));
        assert!(matches!(
            l.prefill_complete("zz"),
            Err(LedgerError::NotFound { .. })
        ));
        for bad in [-0.1, 1.5, f64::NAN] {
            assert!(matches!(
                l.output_block("a", Some(bad)),
                Err(LedgerError::InvalidDecayFraction { .. })
            ));
        }
        let other = BookRequest::new(WorkerKey::new(2, 0), &t, 10);
        assert!(matches!(
            l.book("b".into(), &other, SlotPolicy::RequireRegistered, now),
            Err(LedgerError::UnknownRank { .. })
        ));
        let too_big = BookRequest::new(W, &t, 10).with_prefill(11);
        assert!(matches!(
            l.book("c".into(), &too_big, SlotPolicy::CreateMissing, now),
            Err(LedgerError::PrefillExceedsIsl { .. })
        ));
        // A taken id is reported first, whatever else is wrong, and nothing is booked.
        assert!(matches!(
            l.book("a".into(), &too_big, SlotPolicy::CreateMissing, now),
            Err(LedgerError::DuplicateReservation { .. })
        ));
        assert!(matches!(
            l.book("a".into(), &other, SlotPolicy::RequireRegistered, now),
            Err(LedgerError::DuplicateReservation { .. })
        ));
        assert!(!l.contains("b") && !l.contains("c"));
        assert!(matches!(
            l.free_remote("a", WorkerKey::new(1, 1)),
            Err(LedgerError::WorkerMismatch { .. })
        ));
        check(&l, 0, 1, 1);
    }

    #[test]
    fn decay_replaces_output_and_exclusive_prompt_weights() {
        let mut l = Ledger::default();
        let now = Instant::now();
        book(&mut l, "a", &hashes(&[1, 2, 3, 4]), None, now);
        book(&mut l, "b", &hashes(&[1, 2]), None, now);
        l.output_block("a", None).unwrap();
        l.output_block("a", None).unwrap();
        check(&l, 0, 6, 2);
        // Third output block, then all three outputs and prompt nodes 3, 4 go to 0.25:
        // prompt 2 + 2·0.25, outputs 3·0.25 → 3.25 → 3.
        l.output_block("a", Some(0.25)).unwrap();
        check(&l, 0, 3, 2);
        // Replacement, not multiplication: 2 + 0.5·2 + 0.5·4 = 5.
        l.output_block("a", Some(0.5)).unwrap();
        check(&l, 0, 5, 2);
        l.free("a").unwrap();
        check(&l, 0, 2, 1);
    }

    #[test]
    fn expiry_is_measured_from_admission() {
        let mut l = Ledger::new(LedgerConfig {
            expiry: Duration::from_secs(300),
        });
        let t0 = Instant::now();
        book(&mut l, "old", &hashes(&[1]), Some(5), t0);
        book(
            &mut l,
            "new",
            &hashes(&[2]),
            Some(7),
            t0 + Duration::from_secs(100),
        );
        l.output_block("old", None).unwrap();
        assert!(l.expire(t0 + Duration::from_secs(300)).is_empty());
        let gone = l.expire(t0 + Duration::from_secs(301));
        assert_eq!(gone, vec![ReservationId::from("old")]);
        check(&l, 7, 1, 1);
    }

    #[test]
    fn removing_a_worker_drops_its_bookings() {
        let mut l = Ledger::default();
        let now = Instant::now();
        let t = hashes(&[1]);
        for (id, rank) in [("a", 0), ("b", 1)] {
            let req = BookRequest::new(WorkerKey::new(1, rank), &t, 10);
            l.book(id.into(), &req, SlotPolicy::CreateMissing, now)
                .unwrap();
        }
        l.register_rank(WorkerKey::new(2, 0));
        let req = BookRequest::new(WorkerKey::new(2, 0), &t, 10);
        l.book("c".into(), &req, SlotPolicy::RequireRegistered, now)
            .unwrap();
        let mut gone = l.remove_worker(WorkerId(1));
        gone.sort();
        assert_eq!(gone, vec!["a".into(), "b".into()] as Vec<ReservationId>);
        assert!(l.contains("c") && !l.contains("a"));
        assert!(!l.is_registered(WorkerKey::new(1, 1)));
        assert_eq!(
            l.remove_rank(WorkerKey::new(2, 0)),
            vec!["c".into()] as Vec<ReservationId>
        );
        assert!(l.is_empty());
    }

    #[test]
    fn projection_counts_only_blocks_not_already_active() {
        let mut l = Ledger::default();
        let now = Instant::now();
        book(&mut l, "a", &hashes(&[1, 2, 3]), Some(40), now);
        let p = l.potential_load(W, &hashes(&[1, 2, 7, 8]), 30);
        assert_eq!(p.potential_prefill_tokens, 70);
        assert_eq!(p.additional_active_blocks, 2);
        assert_eq!(p.potential_decode_blocks, 5);
        assert_eq!(p.active_requests, 1);
        let unknown = l.potential_load(WorkerKey::new(9, 0), &hashes(&[1, 2]), 16);
        assert_eq!(unknown.potential_decode_blocks, 2);
        assert_eq!(unknown.potential_prefill_tokens, 16);
    }

    #[test]
    fn remote_bookings_are_marked_and_need_a_registered_rank() {
        let mut l = Ledger::default();
        let now = Instant::now();
        let t = hashes(&[1]);
        let req = BookRequest::new(W, &t, 10).with_prefill(10);
        assert!(l.book_remote("r".into(), &req, now).is_err());
        l.register_rank(W);
        l.book_remote("r".into(), &req, now).unwrap();
        assert_eq!(l.reservation("r").unwrap().origin, Origin::Remote);
        assert_eq!(l.prefill_complete_remote("r", W), Ok(true));
        assert_eq!(l.free_remote("r", W).unwrap().origin, Origin::Remote);
        check(&l, 0, 0, 0);
    }
}
